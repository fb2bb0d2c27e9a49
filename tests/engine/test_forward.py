"""Our llama-family forward matches `transformers` on tiny random models of every supported
shape variant, through the dense path and through the engine's paged, chunked path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from edge_runtime import Engine
from edge_runtime.model.dense import dense_logits
from edge_runtime.model.testing import make_tiny_model_dir
from edge_runtime.model.weights import load_llama

from .helpers import engine_logits_for, reference_logits

VARIANTS = {
    "llama-tied": {},
    "untied-embeddings": {"tie_word_embeddings": False},
    "qkv-bias": {"attention_bias": True},
    "mha": {"num_heads": 4, "num_kv_heads": 4},
    "rope-linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "rope-llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])


def test_dense_forward_matches_transformers(variant_dir: Path) -> None:
    ours = load_llama(variant_dir)
    ref = AutoModelForCausalLM.from_pretrained(str(variant_dir), local_files_only=True, dtype=torch.float32).eval()
    ids = torch.randint(3, ours.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (dense_logits(ours, ids) - ref(ids).logits).abs().max().item()
    assert diff <= 1e-4


@pytest.mark.parametrize("chunk", [7, 256])
def test_paged_engine_logits_match_transformers_over_prefill_and_decode(variant_dir: Path, chunk: int) -> None:
    engine = Engine.load(str(variant_dir), dtype="float32", kv_cache_bytes=4 << 20, block_size=4, max_batched_tokens=chunk)
    ref = AutoModelForCausalLM.from_pretrained(str(variant_dir), local_files_only=True, dtype=torch.float32).eval()
    prompt = torch.randint(3, engine.model.cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    logits, generated = engine_logits_for(engine, prompt, steps=12)
    full = reference_logits(ref, prompt + generated)
    expected = full[len(prompt) - 1 : len(prompt) - 1 + 12]
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() <= 1e-4
