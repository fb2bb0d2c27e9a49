"""The compiled prefill attention (kv/attention.c `prefill_attention`): every row of a chunk alone over
its causal prefix (window, soft cap), bit for bit the decode kernel's row over the same keys whatever
the chunk's extent or the thread split, and within the decode kernel's bound of a float64 attention;
and `PagedContext` sends prefill chunks through it where the compiled kernels serve."""

from __future__ import annotations

import pytest
import torch

from edge_runtime.kv import attention_kernel
from tests.engine.test_attention_kernel import _float64

pytestmark = pytest.mark.skipif(attention_kernel._library() is None, reason="no C compiler on this platform")

SLOTS, KV_HEADS, HEADS, D = 640, 2, 8, 64


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _chunk(dtype: torch.dtype, n: int, past: int, window: int | None, seed: int = 0):
    """Caches, q [n, heads, d] (rows strided past the k heads, as the fused projection leaves them),
    the sequence's slots (a shuffled run) and each row's (start, len) of them: its causal prefix,
    within `window`."""
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = (torch.randn(SLOTS, KV_HEADS, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(n, HEADS + KV_HEADS, D, generator=g).to(dtype)[:, :HEADS]
    slots = torch.randperm(SLOTS, generator=g)[: past + n]
    ends = torch.arange(past + 1, past + n + 1)
    starts = torch.zeros(n, dtype=torch.long) if window is None else (ends - window).clamp(min=0)
    return k_cache, v_cache, q, slots, starts, ends - starts


def _prefill(q, k_cache, v_cache, slots, starts, lens, cap=None, threads=1):
    out = torch.full((q.shape[0], HEADS * D), float("nan"), dtype=q.dtype)
    assert attention_kernel.decode_ready(q, k_cache)
    attention_kernel.prefill_attention(q, k_cache, v_cache, slots, starts, lens, torch.arange(q.shape[0]), cap, out,
                                       threads)
    return out


def _as_decode_rows(q, k_cache, v_cache, slots, starts, lens, cap=None):
    """Each row as a lone decode row over the same slots (its own index row)."""
    outs = []
    for t in range(q.shape[0]):
        index = slots[starts[t] : starts[t] + lens[t]][None]
        out = torch.empty(1, HEADS * D, dtype=q.dtype)
        attention_kernel.decode_attention(q[t : t + 1], k_cache, v_cache, index, lens[t : t + 1],
                                          torch.zeros(1, dtype=torch.long), cap, out)
        outs.append(out)
    return torch.cat(outs)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("cap,window", [(None, None), (2.0, None), (None, 24)])
def test_prefill_attention_matches_a_float64_softmax_attention(dtype, tol, cap, window):
    """Within the bound the decode kernel's test holds it to."""
    k_cache, v_cache, q, slots, starts, lens = _chunk(dtype, 70, 30, window)
    got = _prefill(q, k_cache, v_cache, slots, starts, lens, cap)
    index = torch.zeros(q.shape[0], int(lens.max()), dtype=torch.long)
    for t in range(q.shape[0]):
        index[t, : lens[t]] = slots[starts[t] : starts[t] + lens[t]]
    want = _float64(q, k_cache, v_cache, index, lens, cap)
    assert (got.double() - want).abs().max().item() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cap,window", [(None, None), (2.0, 24)])
def test_a_prefill_row_is_the_decode_row_over_the_same_keys(dtype, cap, window):
    k_cache, v_cache, q, slots, starts, lens = _chunk(dtype, 45, 19, window, seed=2)
    got = _prefill(q, k_cache, v_cache, slots, starts, lens, cap)
    assert torch.equal(got, _as_decode_rows(q, k_cache, v_cache, slots, starts, lens, cap))


@pytest.mark.parametrize("threads", [2, 3, 7])
def test_a_rows_bits_do_not_depend_on_the_chunk_or_the_thread_split(threads):
    """Off-grid sub-chunks of the rows, and the rows split across threads (a chunk big enough to be
    split), give every row the bits the whole chunk gives it on one thread."""
    k_cache, v_cache, q, slots, starts, lens = _chunk(torch.float32, 300, 200, None, seed=3)
    whole = _prefill(q, k_cache, v_cache, slots, starts, lens)
    assert torch.equal(_prefill(q, k_cache, v_cache, slots, starts, lens, threads=threads), whole)
    lo = 0
    for n in (1, 3, 5, 16, 17, 64, 194):
        part = slice(lo, lo + n)
        got = _prefill(q[part], k_cache, v_cache, slots, starts[part], lens[part], threads=threads)
        assert torch.equal(got, whole[part])
        lo += n
    assert lo == 300


def test_prefill_attention_reads_and_writes_only_its_rows():
    """Row t is query and output row rows[t] of the step's flat batch."""
    k_cache, v_cache, q, slots, starts, lens = _chunk(torch.float32, 6, 4, None, seed=4)
    rows = torch.tensor([1, 3, 4, 6, 8, 9])
    flat = torch.full((10, HEADS, D), float("nan"))
    flat[rows] = q
    out = torch.full((10, HEADS * D), 7.0)
    attention_kernel.prefill_attention(flat, k_cache, v_cache, slots, starts, lens, rows, None, out)
    assert (out[[0, 2, 5, 7]] == 7.0).all()
    assert torch.equal(out[rows], _prefill(q, k_cache, v_cache, slots, starts, lens))


def test_the_invariance_gap_names_what_keeps_torchs_attention(monkeypatch):
    cache = torch.zeros(2, 2, SLOTS, KV_HEADS, D)
    assert attention_kernel.invariance_gap(cache, HEADS) is None
    assert "bfloat16" in attention_kernel.invariance_gap(cache.bfloat16(), HEADS)
    assert "width 60" in attention_kernel.invariance_gap(torch.zeros(2, 2, SLOTS, KV_HEADS, 60), HEADS)
    monkeypatch.setenv(attention_kernel.ENV, "off")
    assert attention_kernel.ENV in attention_kernel.invariance_gap(cache, HEADS)
    monkeypatch.delenv(attention_kernel.ENV)
    monkeypatch.setattr(attention_kernel, "_library", lambda: None)
    assert "no C compiler" in attention_kernel.invariance_gap(cache, HEADS)


@pytest.mark.parametrize("d", [8, 40, 128])
def test_a_prefill_row_is_the_decode_row_at_other_head_widths(d):
    """Widths past the 64-wide fast path (under one 16-float step, a tail of 8, two 64-float blocks)."""
    g = torch.Generator().manual_seed(5)
    n, past, kv_heads, heads = 19, 77, 2, 6
    k_cache, v_cache = (torch.randn(SLOTS, kv_heads, d, generator=g) for _ in range(2))
    q = torch.randn(n, heads, d, generator=g)
    slots = torch.randperm(SLOTS, generator=g)[: past + n]
    lens = torch.arange(past + 1, past + n + 1)
    out = torch.empty(n, heads * d)
    attention_kernel.prefill_attention(q, k_cache, v_cache, slots, torch.zeros(n, dtype=torch.long), lens,
                                       torch.arange(n), 3.0, out)
    for t in range(n):
        want = torch.empty(1, heads * d)
        attention_kernel.decode_attention(q[t : t + 1], k_cache, v_cache, slots[None, : lens[t]], lens[t : t + 1],
                                          torch.zeros(1, dtype=torch.long), 3.0, want)
        assert torch.equal(out[t], want[0])


def test_rows_of_two_chunks_in_one_call_are_each_chunks_alone():
    """A step's chunks of two sequences (each reading its own run of the shared slot array, rows of both
    sharing a group of rows) give the rows each chunk gives alone."""
    k_cache, v_cache, q, slots, starts, lens = _chunk(torch.float32, 11, 40, None, seed=6)
    k2, v2, q2, slots2, starts2, lens2 = _chunk(torch.float32, 5, 90, 32, seed=7)
    slots2 = torch.randperm(100, generator=torch.Generator().manual_seed(8))[: slots2.shape[0]] + 500  # its own
    k_cache[500:600], v_cache[500:600] = k2[:100], v2[:100]
    first = _prefill(q, k_cache, v_cache, slots, starts, lens)
    second = _prefill(q2, k_cache, v_cache, slots2, starts2, lens2)
    both = _prefill(torch.cat([q, q2]), k_cache, v_cache, torch.cat([slots, slots2]),
                    torch.cat([starts, starts2 + slots.shape[0]]), torch.cat([lens, lens2]))
    assert torch.equal(both, torch.cat([first, second]))
