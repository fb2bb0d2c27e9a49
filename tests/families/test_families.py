"""Every family the engine claims, as a tiny random model built with transformers' own config
class and loaded with `Engine.load(folder)`, against transformers in float32: the logits of 16
greedy steps within 1e-4 and the tokens equal on 5 prompts, on the torch backend and on ONNX
Runtime (both graph flavours, dense and paged KV); the dense training forward and the windowed
DPO log-probs too. Contexts run past any sliding window, and prompts are prefilled in chunks, so
windowed keys are dropped at both prefill and decode.

A family plugs in by adding an entry to FAMILIES with its distinctive settings switched on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from edge_runtime import Engine
from edge_runtime.model.dense import dense_logits
from edge_runtime.model.testing import make_tiny_model_dir
from edge_runtime.model.weights import load_llama
from edge_runtime.train.logprobs import pair_logps
from edge_runtime.train.pairs import PairTokens
from tests.engine.helpers import engine_logits_for, reference_logits

FAMILIES = {
    "llama": {},
    "qwen2": {"model_type": "qwen2"},  # q/k/v biases (random), no o_proj bias
    # A window far shorter than the contexts (up to 40 tokens).
    "mistral": {"model_type": "mistral", "config": {"sliding_window": 8}},
    # NoPE layers (no_rope_layers[i] == 0) between RoPE ones.
    "smollm3": {"model_type": "smollm3", "num_layers": 4, "config": {"no_rope_layers": [1, 0, 1, 0]}},
}
PROMPT_LENGTHS = (24, 13, 9, 20, 5)
STEPS = 16
TOLERANCE = 1e-4
# Blocks of 4 and 8-token prefill chunks: prompts span several chunks, each a continuation
# chunk attending to a cached past that a sliding window partly drops.
CONFIG = dict(dtype="float32", kv_cache_bytes=4 << 20, block_size=4, max_batched_tokens=8)
BACKENDS = [("torch", None, None), ("onnxruntime", "ort", "dense"), ("onnxruntime", "ort", "paged"),
            ("onnxruntime", "standard", "paged")]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(model folder, prompts, transformers' greedy tokens and logits for each prompt)."""
    folder = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), **FAMILIES[request.param])
    ref = _reference(folder)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, ref.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    expected = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(STEPS):  # greedy without a cache: every step is a full causal forward
            ids.append(int(reference_logits(ref, ids)[-1].argmax()))
        logits = reference_logits(ref, ids)[len(prompt) - 1 : len(prompt) - 1 + STEPS]
        expected.append((ids[len(prompt):], logits))
    return folder, prompts, expected


def _reference(folder: Path):
    return AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32).eval()


def _engine(folder: Path, backend: str, flavour: str | None, kv_layout: str | None, cache_dir: Path) -> Engine:
    engine = Engine.load(str(folder), **CONFIG)
    if backend == "onnxruntime":
        from edge_runtime.backends.onnxruntime_backend import OnnxRuntimeBackend

        engine.backend = OnnxRuntimeBackend(engine.model, engine.cache, engine.adapters, flavour=flavour,
                                            cache_dir=cache_dir, kv_layout=kv_layout)
    return engine


@pytest.mark.parametrize("backend,flavour,kv_layout", BACKENDS, ids=["torch", "ort-dense", "ort-paged", "standard"])
def test_greedy_decoding_matches_transformers(family, backend, flavour, kv_layout, tmp_path):
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    folder, prompts, expected = family
    engine = _engine(folder, backend, flavour, kv_layout, tmp_path)
    for prompt, (tokens, logits) in zip(prompts, expected, strict=True):
        ours, generated = engine_logits_for(engine, prompt, steps=STEPS)
        first = (ours[0] - logits[0]).abs().max().item()
        assert first <= TOLERANCE, f"first-step logits differ by {first:.2e} (prompt of {len(prompt)})"
        assert generated == tokens, f"greedy tokens differ (prompt of {len(prompt)})"
        worst = (ours - logits).abs().max().item()
        assert worst <= TOLERANCE, f"logits differ by {worst:.2e} over {STEPS} steps (prompt of {len(prompt)})"


def test_dense_training_forward_matches_transformers(family):
    folder = family[0]
    ours, ref = load_llama(folder), _reference(folder)
    ids = torch.randint(3, ours.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        diff = (dense_logits(ours, ids) - ref(ids).logits).abs().max().item()
    assert diff <= TOLERANCE


def test_windowed_dpo_log_probs_match_transformers(family):
    """The staged fine-tune's forward (prompt and completion windows over a pair) scores each
    completion as transformers does, past the sliding window."""
    folder = family[0]
    ours, ref = load_llama(folder), _reference(folder)
    gen = torch.Generator().manual_seed(5)
    prompt, chosen, rejected = (torch.randint(3, ours.cfg.vocab_size, (n,), generator=gen).tolist() for n in (14, 12, 7))
    expected = []
    for completion in (chosen, rejected):
        logits = reference_logits(ref, prompt + completion)[len(prompt) - 1 : -1]
        expected.append((logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])).sum().item())
    tokens = PairTokens(tuple(prompt), tuple(chosen), tuple(rejected))
    for window_tokens in (None, 6):
        assert pair_logps(ours, tokens, None, window_tokens) == pytest.approx(expected, abs=1e-4)
