"""The row-invariant torch kernels (issue #31) on the default model's shapes, without the model: a
row's projection and attention output are the same bits whatever rows share the call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edge_runtime.kv.paged_attention import ATTEND_MIN_ROWS, attend
from edge_runtime.model.llama import KEY_TILE, ROW_TILE, tiled_linear

# SmolLM2-135M: fused q/k/v, o, fused gate/up, down (K = 1536 has a GEMM path of its own for
# 64..192 rows), and a slice of the LM head.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 576)]
COUNTS = [1, 2, 3, 5, 15, 16, 17, 40, 64, 100, 161]


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_tiled_linear_rows_do_not_depend_on_the_row_count(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen) / k**0.5
    bias = torch.randn(n, generator=gen)
    x = torch.randn(max(COUNTS) + 7, k, generator=gen)
    whole = tiled_linear(x, weight, bias)
    assert torch.allclose(whole, F.linear(x, weight, bias), atol=1e-4)
    for m in COUNTS:
        assert torch.equal(tiled_linear(x[:m], weight, bias), whole[:m]), m
        # ... and wherever the row sits among others
        shifted = torch.cat([x[m : m + 7], x[:m]])
        assert torch.equal(tiled_linear(shifted, weight, bias)[7:], whole[:m]), m


def test_the_plain_linear_is_not_row_invariant_here() -> None:
    """Why the tiles exist: on this machine's GEMM a row rounds by the row count (if a GEMM
    library ever stops doing so, the tiles cost and buy nothing)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(3072, 576, generator=gen) / 24
    x = torch.randn(64, 576, generator=gen)
    whole = F.linear(x, weight)
    if all(torch.equal(F.linear(x[:m], weight), whole[:m]) for m in (1, 2, 8, 16)):
        pytest.skip("this GEMM library rounds every row count alike")


def test_attention_rows_do_not_depend_on_query_or_key_count() -> None:
    gen = torch.Generator().manual_seed(1)
    kv_heads, d, keys = 3, 64, 300
    q = torch.randn(kv_heads, 48, d, generator=gen)
    k = torch.randn(kv_heads, keys, d, generator=gen)
    v = torch.randn(kv_heads, keys, d, generator=gen)
    full = attend(q, k[:, :100], v[:, :100], torch.ones(48, 100, dtype=torch.bool), min_rows=ATTEND_MIN_ROWS)
    for rows in (1, 2, 3, 5, 17):
        for width in (100, 101, 164, 300):  # keys past 100 are padding the mask hides
            mask = torch.zeros(rows, width, dtype=torch.bool)
            mask[:, :100] = True
            got = attend(q[:, :rows], k[:, :width], v[:, :width], mask, min_rows=ATTEND_MIN_ROWS)
            assert torch.equal(got, full[:, :rows]), (rows, width)


def test_row_tile_is_what_the_docs_say() -> None:
    assert ROW_TILE == 16 and ATTEND_MIN_ROWS == 4 and KEY_TILE == 64


@pytest.mark.parametrize(("keys", "width"), [(2, 57), (9, 16), (15, 80), (337, 673), (300, 420), (640, 700)])
def test_a_decode_rows_attention_does_not_depend_on_the_padded_width(keys: int, width: int) -> None:
    """A decode row's keys padded (masked) to the longest context beside it give the bits of the
    same row alone and of the same row inside a prefill chunk, with the key tiles. Without them
    (torch's CPU kernels here) a row under 16 keys and a 300+-key row beside a longer one moved."""
    gen = torch.Generator().manual_seed(keys)
    kv_heads, group, d = 3, 3, 64  # the default model's heads
    k = torch.randn(kv_heads, width, d, generator=gen)
    v = torch.randn(kv_heads, width, d, generator=gen)
    q = torch.randn(kv_heads, group * 16, d, generator=gen)  # a 16-row chunk ending at `keys`, folded

    def decode(w: int) -> torch.Tensor:
        mask = torch.zeros(1, 1, 1, w, dtype=torch.bool)
        mask[..., :keys] = True
        row = q.view(kv_heads, group, 16, d)[:, :, -1][None]  # [1, kv_heads, group, d]
        return attend(row, k[None, :, :w], v[None, :, :w], mask, min_rows=ATTEND_MIN_ROWS, tiled_keys=True)[0]

    rows = min(16, keys)
    chunk_q = q.view(kv_heads, group, 16, d)[:, :, 16 - rows :].reshape(kv_heads, group * rows, d)
    mask = torch.arange(keys)[None, :] <= torch.arange(keys - rows, keys)[:, None]
    chunk = attend(chunk_q, k[:, :keys], v[:, :keys], mask.repeat(group, 1), min_rows=ATTEND_MIN_ROWS,
                   tiled_keys=True).view(kv_heads, group, rows, d)[:, :, -1]
    alone = decode(keys)
    plain = attend(q.view(kv_heads, group, 16, d)[:, :, -1][None], k[None, :, :keys], v[None, :, :keys],
                   torch.ones(1, 1, 1, keys, dtype=torch.bool))[0]
    assert torch.allclose(alone, plain, atol=1e-5)  # the same attention, summed in tiles
    assert torch.equal(decode(width), alone)
    assert torch.equal(chunk, alone)
