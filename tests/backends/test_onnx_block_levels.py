"""A table's levels are converted for MatMulNBits a few rows at a time (`onnx_blocks.byte_levels`,
#28: a whole Q6_K embedding at once held ~6x its bytes): the chunks give bit for bit the levels,
zero and bits of the whole-table conversion, for every block type a GGUF mix holds, and 4-bit
and unsigned 8-bit levels are the blocks' own bytes, not a copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_runtime.backends import onnx_blocks
from edge_runtime.model.gguf_load import load_llama_gguf
from tests.model.quant_helpers import Q4_K_M_LIKE, private_cache, tiny_quant_gguf  # noqa: F401

LEGACY = {"token_embd.weight": "Q4_1", "attn_q.weight": "Q4_0", "attn_k.weight": "Q5_1", "attn_v.weight": "Q5_0",
          "attn_output.weight": "Q5_K", "ffn_gate.weight": "Q4_0", "ffn_up.weight": "Q4_1", "ffn_down.weight": "Q8_0"}


def _whole(blocks):
    """The conversion of the whole table at once (what `block_part` did before the chunks)."""
    blocks = blocks if blocks.bits in (4, 8) else blocks.bytewise()
    levels, zero = blocks.levels.cpu().numpy(), blocks.zero
    if blocks.bits == 8 and levels.dtype == np.int8:
        levels, zero = levels.view(np.uint8) ^ np.uint8(0x80), 128
    return levels, zero, blocks.bits


@pytest.mark.parametrize("types", [Q4_K_M_LIKE, LEGACY], ids=["q4_k_m", "legacy"])
def test_levels_a_few_rows_at_a_time_are_the_whole_tables(tmp_path, monkeypatch, types):
    model = load_llama_gguf(tiny_quant_gguf(tmp_path, types, tie=True)[1])
    monkeypatch.setattr(onnx_blocks, "LEVEL_ROWS", 7)  # chunks that do not divide the rows
    weights = [model.embed, *(getattr(layer, f"{s}_weight") for layer in model.layers
                              for s in ("qkv", "o", "gate_up", "down"))]
    seen = set()
    for weight in weights:
        for blocks in weight.parts:
            seen.add((blocks.bits, blocks.levels.dtype))
            levels, zero, bits = onnx_blocks.byte_levels(blocks)
            want_levels, want_zero, want_bits = _whole(blocks)
            assert (zero, bits) == (want_zero, want_bits)
            assert levels.dtype == np.uint8 or bits == 4
            assert np.array_equal(levels, want_levels)
            if blocks.bits == 4 or (blocks.bits == 8 and blocks.levels.dtype == torch.uint8):
                assert np.shares_memory(levels, blocks.levels.numpy())  # the blocks' bytes, not a copy
    assert len(seen) >= 3  # 4-bit, packed 5/6-bit and 8-bit levels all went through
