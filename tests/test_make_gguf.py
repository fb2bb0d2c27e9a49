"""tools/make_gguf.py: llama.cpp's type per tensor in each mix at the real shapes, and the tiny
file it writes read back by gguf-py, transformers' GGUF loader and this engine's loader."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tests.tool_modules import load_tool

tool = load_tool("make_gguf")


def _types(shape_name: str, mix: str) -> dict[str, str]:
    return {t.name: t.qtype for t in tool.tensor_plan(tool.SHAPES[shape_name], tool.MIXES[mix])}


def test_q4_k_m_gives_six_bits_to_the_head_and_to_attn_v_ffn_down_of_the_use_more_bits_layers() -> None:
    types = _types("llama-3.2-1b", "q4_k_m")
    # 16 layers: the first and last two, and every third from layer 4 (llama.cpp's use_more_bits)
    more = [0, 1, 4, 7, 10, 13, 14, 15]
    assert [i for i in range(16) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"] == more
    assert [i for i in range(16) if types[f"blk.{i}.ffn_down.weight"] == "Q6_K"] == more
    assert types["token_embd.weight"] == "Q6_K" and "output.weight" not in types  # tied: the embedding is the head
    assert {types[f"blk.{i}.{n}.weight"] for i in range(16)
            for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")} == {"Q4_K"}
    assert {types[f"blk.{i}.attn_norm.weight"] for i in range(16)} == {"F32"}

    eight = _types("llama-3.1-8b", "q4_k_m")  # untied: a Q6_K head, a Q4_K embedding
    assert eight["output.weight"] == "Q6_K" and eight["token_embd.weight"] == "Q4_K"
    assert sum(eight[f"blk.{i}.ffn_down.weight"] == "Q6_K" for i in range(32)) == 16


def test_q8_0_mix_is_q8_0_everywhere_but_the_norms() -> None:
    counts = Counter(_types("llama-3.1-8b", "q8_0").values())
    assert counts == {"Q8_0": 2 + 7 * 32, "F32": 1 + 2 * 32}


def test_rows_not_a_multiple_of_256_fall_back_to_32_wide_blocks() -> None:
    mix = tool.MIXES["q4_k_m"]
    assert tool.tensor_type(mix, "attn_q", 0, 16, 320, True) == "Q5_0"
    assert tool.tensor_type(mix, "ffn_down", 0, 16, 320, True) == "Q8_0"  # a Q6_K layer
    assert tool.tensor_type(mix, "token_embd", 0, 16, 320, True) == "Q8_0"


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_random_blocks_dequantise_to_the_intended_spread_centred_per_sub_block(qtype: str) -> None:
    import gguf

    blocks = tool.random_blocks(qtype, 2048, np.random.default_rng(1), 0.02)
    weights = gguf.quants.dequantize(blocks.reshape(32, -1), gguf.GGMLQuantizationType[qtype])
    assert np.isfinite(weights).all()
    assert 0.018 < weights.std() < 0.022 and abs(weights.mean()) < 0.001
    # no sub-block drifts off zero beyond what 32 random draws of std 0.02 would (0.0035)
    assert weights.reshape(-1, 32).mean(axis=1).std() < 0.0045


def test_chunks_of_a_large_tensor_stay_bounded() -> None:
    head = tool.PlannedTensor("output.weight", (128256, 4096), "Q6_K")
    sizes = []
    for i, chunk in enumerate(tool.tensor_chunks(head, np.random.default_rng(0), 0.02, 1 << 20)):
        sizes.append(len(chunk))
        if i == 3:
            break
    assert max(sizes) <= 1 << 20


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf")
    shape = tool.SHAPES["tiny"]
    return {mix: tool.write_gguf(shape, tool.MIXES[mix], folder / tool.file_name(shape, tool.MIXES[mix]))
            for mix in ("q4_k_m", "q8_0", "q4_0")}


@pytest.mark.parametrize("mix", ["q4_k_m", "q8_0", "q4_0"])
def test_tiny_file_reads_back_with_the_planned_types_and_metadata(tiny_files: dict[str, Path], mix: str) -> None:
    import gguf

    reader = gguf.GGUFReader(str(tiny_files[mix]))
    planned = {t.name: t for t in tool.tensor_plan(tool.SHAPES["tiny"], tool.MIXES[mix])}
    assert [t.name for t in reader.tensors] == list(planned)
    for t in reader.tensors:
        assert t.tensor_type.name == planned[t.name].qtype
        assert tuple(int(d) for d in reversed(t.shape)) == planned[t.name].dims
    fields = {name: f.contents() for name, f in reader.fields.items()}
    assert fields["general.file_type"] == int(gguf.LlamaFileType[tool.MIXES[mix].file_type])
    assert fields["llama.block_count"] == 4 and fields["llama.rope.freq_base"] == 500000.0
    assert len(fields["tokenizer.ggml.tokens"]) == 512 and fields["tokenizer.ggml.model"] == "gpt2"
    assert "rope_freqs.weight" not in planned  # the project's loader refuses it (see the module docstring)
    for t in reader.tensors[1:4]:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        assert np.isfinite(w).all() and (0.016 < w.std() < 0.024 or t.tensor_type.name == "F32")


def test_transformers_loads_the_tiny_file_and_activations_stay_finite_through_32_layers(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shape = tool.SHAPES["tiny"].scaled(name="tiny-32", num_layers=32)
    path = tool.write_gguf(shape, tool.MIXES["q4_k_m"], tmp_path / "deep.gguf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert len(tokenizer) == model.config.vocab_size == 512
    assert tokenizer.decode([tokenizer.convert_tokens_to_ids("<fill_500>")]) == "<fill_500>"
    ids = tokenizer("the user asks and the assistant answers", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    stds = [float(h.std()) for h in out.hidden_states[:-1]]  # the residual stream, before the final norm
    assert all(np.isfinite(stds)) and max(stds) < 2.0  # grows like sqrt(layers) from 0.02, no blow-up
    assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("mix", ["q8_0", "q4_k_m"])
def test_the_engine_loads_the_tiny_file_and_generates(tiny_files: dict[str, Path], mix: str,
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from edge_runtime import Engine, SamplingParams

    monkeypatch.setenv("MACE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MACE_STATE_DIR", str(tmp_path / "state"))
    engine = Engine.load(tiny_files[mix], dtype="float32", backend="torch", kv_cache_bytes=1 << 20,
                         cost_profile="off")
    out = engine.generate("the user asks", SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.text
