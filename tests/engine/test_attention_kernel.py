"""The compiled decode attention, KV write and rotary turn (edge_runtime/kv/attention.c): against a
float64 softmax attention and torch's path, each decode row's bits alone and in a batch, and the
rotary turn bit for bit torch's."""

from __future__ import annotations

import pytest
import torch

from edge_runtime.kv import attention_kernel
from edge_runtime.kv.paged_attention import attend
from edge_runtime.model.llama import rotate_half

pytestmark = pytest.mark.skipif(attention_kernel._library() is None, reason="no C compiler on this platform")

SLOTS, KV_HEADS, HEADS, D = 512, 2, 8, 64


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():  # as the engine's forward runs (the kernel leaves autograd to torch)
        yield
LENS = [5, 300, 17, 64, 1, 129, 8, 250]


def _cache(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(SLOTS, KV_HEADS, D, generator=g).to(dtype) for _ in range(2))


def _batch(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries as the fused projection leaves them (rows strided past the k heads), each row's
    slots (a shuffled run, padded with slot 0) and lengths."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(len(LENS), HEADS + KV_HEADS, D, generator=g).to(dtype)[:, :HEADS]
    index = torch.zeros(len(LENS), max(LENS), dtype=torch.long)
    for b, n in enumerate(LENS):
        index[b, :n] = torch.randperm(SLOTS, generator=g)[:n]
    return q, index, torch.tensor(LENS)


def _kernel(q, k_cache, v_cache, index, lens, cap=None):
    out = torch.full((q.shape[0], HEADS * D), float("nan"), dtype=q.dtype)
    assert attention_kernel.decode_ready(q, k_cache)
    attention_kernel.decode_attention(q, k_cache, v_cache, index, lens, torch.arange(q.shape[0]), cap, out)
    return out


def _float64(q, k_cache, v_cache, index, lens, cap=None):
    out = torch.empty(q.shape[0], HEADS * D, dtype=torch.float64)
    group = HEADS // KV_HEADS
    for b, n in enumerate(lens.tolist()):
        k, v = k_cache[index[b, :n]].double(), v_cache[index[b, :n]].double()
        for h in range(HEADS):
            s = k[:, h // group] @ q[b, h].double() * D**-0.5
            s = s if cap is None else torch.tanh(s / cap) * cap
            out[b, h * D : (h + 1) * D] = torch.softmax(s, 0) @ v[:, h // group]
    return out


def _torch_path(q, k_cache, v_cache, index, lens, cap=None):
    b, group = q.shape[0], HEADS // KV_HEADS
    kd, vd = (c[index].permute(0, 2, 1, 3) for c in (k_cache, v_cache))
    mask = (torch.arange(index.shape[1])[None] < lens[:, None])[:, None, None, :]
    return attend(q.reshape(b, KV_HEADS, group, D), kd, vd, mask, cap).reshape(b, HEADS * D)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("cap", [None, 2.0])
def test_decode_attention_matches_a_float64_softmax_attention(dtype, tol, cap):
    k_cache, v_cache = _cache(dtype)
    q, index, lens = _batch(dtype)
    got = _kernel(q, k_cache, v_cache, index, lens, cap)
    want = _float64(q, k_cache, v_cache, index, lens, cap)
    assert (got.double() - want).abs().max().item() < tol
    # no further from the float64 answer than torch's own path
    torch_err = (_torch_path(q, k_cache, v_cache, index, lens, cap).double() - want).abs().max().item()
    assert (got.double() - want).abs().max().item() <= max(torch_err, tol / 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_rows_bits_do_not_depend_on_the_rows_beside_it(dtype):
    k_cache, v_cache = _cache(dtype)
    q, index, lens = _batch(dtype)
    batched = _kernel(q, k_cache, v_cache, index, lens)
    for b, n in enumerate(LENS):
        alone = _kernel(q[b : b + 1], k_cache, v_cache, index[b : b + 1, :n].contiguous(), lens[b : b + 1])
        assert torch.equal(alone[0], batched[b])


def test_decode_attention_reads_and_writes_only_its_rows():
    k_cache, v_cache = _cache(torch.float32)
    _, index, lens = _batch(torch.float32)
    q = torch.randn(10, HEADS, D)
    out = torch.full((10, HEADS * D), 7.0)
    rows = torch.tensor([9, 2])
    attention_kernel.decode_attention(q, k_cache, v_cache, index[:2].contiguous(), lens[:2], rows, None, out)
    assert torch.equal(out[9], _kernel(q[9:10], k_cache, v_cache, index[:1].contiguous(), lens[:1])[0])
    kept = [i for i in range(10) if i not in (9, 2)]
    assert bool((out[kept] == 7.0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_is_index_copy(dtype):
    k_cache, v_cache = _cache(dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    kv = torch.randn(3, 2 * KV_HEADS + 1, D).to(dtype)  # k and v strided, as split from one projection
    k, v = kv[:, :KV_HEADS], kv[:, KV_HEADS : 2 * KV_HEADS]
    slots = torch.tensor([4, 100, 7])
    assert attention_kernel.usable(k_cache) and attention_kernel.rows_ok(k, dtype) and attention_kernel.rows_ok(v, dtype)
    attention_kernel.write_kv(k, v, slots, k_cache, v_cache)
    want_k.index_copy_(0, slots, k)
    want_v.index_copy_(0, slots, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("rotary", [D, D // 2])
def test_rope_is_torchs_rotation_bit_for_bit(rotary):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, HEADS + 3, D, generator=g)[:, :HEADS]
    cos, sin = torch.randn(5, rotary, generator=g), torch.randn(5, rotary, generator=g)
    turned = x[..., :rotary]
    want = torch.cat([turned * cos[:, None] + rotate_half(turned) * sin[:, None], x[..., rotary:]], -1)
    assert torch.equal(attention_kernel.rope(x, cos, sin), want)


def test_autograd_and_other_dtypes_are_left_to_torch():
    x = torch.randn(2, HEADS, D, requires_grad=True)
    cos, sin = torch.randn(2, D), torch.randn(2, D)
    assert attention_kernel.rope(x, cos, sin) is not None  # under no_grad
    with torch.enable_grad():
        assert attention_kernel.rope(x, cos, sin) is None
        assert not attention_kernel.usable(_cache(torch.float32)[0])
    assert attention_kernel.rope(x.detach().bfloat16(), cos.bfloat16(), sin.bfloat16()) is None


def test_the_kernel_can_be_turned_off(monkeypatch):
    k_cache, _ = _cache(torch.float32)
    q, _, _ = _batch(torch.float32)
    monkeypatch.setenv(attention_kernel.ENV, "off")
    assert not attention_kernel.decode_ready(q, k_cache)
    assert attention_kernel.rope(q, torch.randn(len(LENS), D), torch.randn(len(LENS), D)) is None


def test_pruned_positions_get_exact_zero_weights_and_full_masks_change_nothing():
    k_cache, v_cache = _cache(torch.float32)
    q, index, lens = _batch(torch.float32)
    b, width = index.shape
    mask = torch.ones(b, KV_HEADS, width, dtype=torch.bool)
    weights = torch.full((b, HEADS, width), float("nan"))
    out = torch.empty(b, HEADS * D)
    attention_kernel.decode_attention(q, k_cache, v_cache, index, lens, torch.arange(b), None, out, mask=mask,
                                      weights=weights)
    assert torch.equal(out, _kernel(q, k_cache, v_cache, index, lens))
    assert torch.allclose(weights.sum(-1), torch.ones(b, HEADS))
    mask[1, 0, ::2] = False  # row 1, the first KV head: every other position pruned
    attention_kernel.decode_attention(q, k_cache, v_cache, index, lens, torch.arange(b), None, out, mask=mask,
                                      weights=weights)
    group = HEADS // KV_HEADS
    assert bool((weights[1, :group, ::2] == 0).all()) and bool((weights[1, :group, 1 : LENS[1] : 2] > 0).all())
    kept = index[1, 1 : LENS[1] : 2]
    k = k_cache[kept, 0].double()
    s = q[1, :group].double() @ k.T * D**-0.5
    want = torch.softmax(s, -1) @ v_cache[kept, 0].double()
    assert (out[1, : group * D].double() - want.reshape(-1)).abs().max().item() < 2e-6


def test_entries_read_each_key_and_value_where_it_lies():
    """Compacted rows: each (position, head) from its own row of the slab of d-wide rows."""
    k_cache, v_cache = _cache(torch.float32)
    slab = torch.stack([k_cache, v_cache])  # [k/v, slots, kv_heads, d]: values SLOTS * KV_HEADS rows on
    q, index, lens = _batch(torch.float32)
    b, width = index.shape
    entries = index[:, :, None] * KV_HEADS + torch.arange(KV_HEADS)  # the rows the index names
    out = torch.empty(b, HEADS * D)
    attention_kernel.decode_attention(q, slab, slab, index, lens, torch.arange(b), None, out,
                                      entries=entries.contiguous(), v_shift=SLOTS * KV_HEADS)
    assert torch.equal(out, _kernel(q, k_cache, v_cache, index, lens))


def test_the_engines_decode_steps_take_the_kernel_and_match_torchs_path(tmp_path, monkeypatch):
    from edge_runtime.model.testing import make_tiny_model_dir

    from .helpers import engine_logits_for, make_engine

    model_dir = make_tiny_model_dir(tmp_path, random_norms=True, seed=3, num_heads=4, num_kv_heads=2, num_layers=2)
    calls = []
    real = attention_kernel.decode_attention
    monkeypatch.setattr(attention_kernel, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.enable_grad():  # the engine's forward sets its own mode
        compiled, ids = engine_logits_for(make_engine(model_dir), list(range(40, 77)), 12)
        assert calls
        monkeypatch.setenv(attention_kernel.ENV, "off")
        reference, ref_ids = engine_logits_for(make_engine(model_dir), list(range(40, 77)), 12)
    assert ids == ref_ids
    assert torch.allclose(compiled, reference, atol=1e-4, rtol=1e-4)


def test_the_row_invariant_path_keeps_torchs_decode_attention(tmp_path, monkeypatch):
    """With engine.deterministic a decode row must keep the bits it has inside a prefill chunk,
    which attends through torch: the compiled decode attention stays out."""
    from edge_runtime.model.testing import make_tiny_model_dir

    from .helpers import engine_logits_for, make_engine

    model_dir = make_tiny_model_dir(tmp_path, num_heads=4, num_kv_heads=2, num_layers=2)
    calls = []
    real = attention_kernel.decode_attention
    monkeypatch.setattr(attention_kernel, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.enable_grad():
        engine_logits_for(make_engine(model_dir, deterministic=True), list(range(40, 60)), 4)
    assert calls == []
