"""Tiny llama GGUFs whose matrices are in chosen llama.cpp block types, for the tests of the
quantised-weight model (`make_tiny_gguf(block_types=...)`: K-quants get random well-formed
blocks, the other types quantise the tiny model's own weights)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_runtime.model import source
from edge_runtime.model.testing import make_tiny_gguf, make_tiny_model_dir

# What llama.cpp's Q4_K_M mix writes, at this size: Q4_K matrices, Q6_K for the head and for
# attn_v / ffn_down of some layers; layer 0 also takes Q5_K and Q8_0, so q|k|v and gate|up mix
# formats within a layer.
Q4_K_M_LIKE = {"token_embd.weight": "Q6_K", "output.weight": "Q6_K", "blk.0.attn_v.weight": "Q6_K",
               "blk.0.ffn_down.weight": "Q5_K", "blk.0.ffn_up.weight": "Q8_0", "attn_q.weight": "Q4_K",
               "attn_k.weight": "Q4_K", "attn_output.weight": "Q4_K", "ffn_gate.weight": "Q4_K",
               "ffn_up.weight": "Q4_K", "ffn_down.weight": "Q6_K", "attn_v.weight": "Q4_K"}


def tiny_quant_gguf(root: Path, types: dict[str, str], *, tie: bool = False, num_layers: int = 2) -> tuple[Path, Path]:
    """(the HF folder, a llama GGUF written from it) with rows 256 wide, so K-quants fit."""
    folder = make_tiny_model_dir(root / "hf", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                                 num_layers=num_layers, tie_word_embeddings=tie, random_norms=True)
    (root / "gguf").mkdir(parents=True, exist_ok=True)
    return folder, make_tiny_gguf(folder, root / "gguf" / "tiny.gguf", block_types=types)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """A test's own model cache and state folder, and no block-cache override from the
    environment (a test module imports this fixture to use it)."""
    monkeypatch.setenv("MACE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("MACE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(source.BLOCKS_ENV, raising=False)
