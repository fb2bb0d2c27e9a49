"""The tiny in-process test model loads with plain transformers and tokenizes like a real one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from edge_runtime.model.testing import make_tiny_model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def test_tiny_dir_loads_with_auto_classes_and_vocab_matches_tokenizer(tiny_dir: Path) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (tiny_dir / "model.safetensors").is_file()

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    assert config["vocab_size"] == len(tokenizer) == model.config.vocab_size
    assert model.config.num_key_value_heads == 2
    assert model.config.tie_word_embeddings is True

    ids = torch.tensor([tokenizer.encode("Hello, how are you?")])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_special_tokens_have_smollm2_ids_and_eos_is_im_end(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert ids == [0, 1, 2]
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == 2
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["eos_token_id"] == 2


def test_chat_template_renders_chatml_with_generation_prompt(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 👋"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 👋<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # The markers must encode as single special tokens, not as their characters.
    ids = tokenizer.encode(text)
    assert ids[0] == 1 and ids.count(2) == 2


@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox jumps over the lazy dog.",
        "emoji 😀🫠 and family 👨‍👩‍👧 and flags 🇫🇷",
        "中文 日本語 한국어 — café, naïve, Ελληνικά, עברית",
        "  leading spaces\n\ttabs\r\nand\x00control\u200b chars  ",
        "",
    ],
)
def test_utf8_round_trips_through_encode_decode(tiny_dir: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    ids = tokenizer.encode(text)
    assert all(0 <= i < len(tokenizer) for i in ids)
    assert tokenizer.decode(ids) == text


def test_learned_merges_make_common_words_multi_byte_tokens(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    text = "the user and the device"
    assert len(tokenizer.encode(text)) < len(text.encode("utf-8"))


def test_options_change_the_written_model(tmp_path: Path) -> None:
    path = make_tiny_model_dir(
        tmp_path / "opts",
        vocab_extra=5,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=48,
        tie_word_embeddings=False,
        attention_bias=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    config = model.config
    assert config.vocab_size == len(tokenizer) == 307 + 5
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (32, 1, 48)
    assert (config.num_attention_heads, config.num_key_value_heads) == (2, 1)
    assert config.tie_word_embeddings is False
    assert config.rope_parameters["rope_type"] == "linear"
    assert config.rope_parameters["factor"] == 2.0
    state = model.state_dict()
    assert not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    assert state["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0


def test_same_seed_gives_same_weights_and_other_seed_differs(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    a = load_file(make_tiny_model_dir(tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(make_tiny_model_dir(tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(make_tiny_model_dir(tmp_path / "c", seed=4) / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
