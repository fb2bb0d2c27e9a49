"""The compiled decode and prefill attention, KV write and float32 rotary turn on CPU (attention.c, built
once per machine by `qkernel.build_library` and loaded with ctypes); torch's ops stay the path wherever
it is unavailable, turned off (MACE_ATTN_KERNEL=off) or the shapes are past it. Owns no state."""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from pathlib import Path

import torch
from torch import Tensor

from edge_runtime.model.qkernel import KernelUnavailable, build_library, switch_on

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("attention.c")
ENV = "MACE_ATTN_KERNEL"  # "off": torch's ops only (the reference path)
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]
_P, _I = ctypes.c_void_p, ctypes.c_int64


def enabled() -> bool:
    return switch_on(ENV)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built library, or None (logged once) where it cannot be had."""
    try:
        lib = build_library(SOURCE, _FLAGS)
    except KernelUnavailable as e:
        log.info("decode attention with torch's ops: %s", e)
        return None
    lib.decode_attention.argtypes = [_P, _I, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float,
                                     ctypes.c_float, _P, _P, _P, _I, ctypes.c_int, _P]
    lib.decode_attention.restype = ctypes.c_int
    lib.prefill_attention.argtypes = [_P, _I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float,
                                      ctypes.c_float, _P, _I, ctypes.c_int, _P]
    lib.prefill_attention.restype = ctypes.c_int
    lib.write_kv.argtypes = [_P, _I, _P, _I, _P, _I, _I, _I, _P, _P]
    lib.write_kv.restype = None
    lib.rope_f32.argtypes = [_P, _I, _P, _P, _I, _I, _I, _I, _P]
    lib.rope_f32.restype = None
    return lib


def usable(cache: Tensor) -> bool:
    """Whether the compiled calls may run on this cache ([..., kv_heads, d] on the CPU, float32 or
    bfloat16) in the current mode: turned on, built, outside autograd and graph capture (the
    kernel's results are plain numbers)."""
    return (cache.device.type == "cpu" and cache.dtype in (torch.float32, torch.bfloat16) and enabled()
            and not torch.is_grad_enabled() and not _capturing() and _library() is not None)


def invariance_gap(cache: Tensor, heads: int) -> str | None:
    """Why a serving step's attention over `cache` ([layers, 2, slots, kv_heads, d]) with `heads`
    query heads would not go through the compiled per-row kernel (each row's bits its own prefix's,
    prefill rows as decode rows), or None where it does (outside autograd, as serving runs)."""
    kv_heads, d = cache.shape[-2:]
    if not enabled():
        return f"{ENV}=off: prefill chunks attend through torch's GEMMs, whose rounding follows the chunk"
    if _library() is None:
        return "the compiled attention is not built here (no C compiler): torch's GEMMs attend"
    if cache.device.type != "cpu" or cache.dtype != torch.float32:
        return f"a {cache.dtype} KV cache on {cache.device.type}: the fused layer's float32 rows take torch's attention"
    if d % 8 or heads % kv_heads:
        return f"{heads} heads over {kv_heads} of width {d}: past the compiled attention"
    return None


def rows_ok(x: Tensor, dtype: torch.dtype) -> bool:
    """[rows, d] or [rows, heads, d] of `dtype` whose every row is contiguous (any stride between
    rows)."""
    return x.dtype == dtype and x.stride(-1) == 1 and (x.dim() < 3 or x.stride(-2) == x.shape[-1])


def _capturing() -> bool:
    """Whether a tracer or compiler is recording the ops (it would keep this call's output as a
    constant)."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.compiler.is_exporting()


def decode_shapes_ok(q: Tensor, k_cache: Tensor) -> bool:
    """Whether `decode_attention` takes these shapes (the caller checked `usable`)."""
    heads, d = q.shape[1:]
    return rows_ok(q, k_cache.dtype) and k_cache.is_contiguous() and heads % k_cache.shape[1] == 0 and d % 8 == 0


def decode_ready(q: Tensor, k_cache: Tensor) -> bool:
    """Whether `decode_attention` runs for these tensors now (else torch's path)."""
    return usable(k_cache) and decode_shapes_ok(q, k_cache)


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, index: Tensor, lens: Tensor, rows: Tensor,
                     cap: float | None, out: Tensor, entries: Tensor | None = None, v_shift: int = 0,
                     mask: Tensor | None = None, weights: Tensor | None = None) -> None:
    """out[rows[b]] = softmax(cap(q[rows[b]] . K^T / sqrt(d))) V for each decode row b over its
    lens[b] cached positions (per KV head, its query heads folded over it), on the calling thread.
    q [T, heads, d] (rows contiguous), out [T, heads * d] contiguous; index [B, width], lens and
    rows [B] int64. Position j of row b: slot index[b, j] of the caches [slots, kv_heads, d]; or,
    with `entries` [B, width, kv_heads] (compacted rows), the key in row entries[b, j, h] of the
    slab of d-wide rows that `k_cache` starts (the value `v_shift` rows after). `mask` (bool
    [B, kv_heads, width], False: pruned) gives exact zero weights; `weights` (float32
    [B, heads, width]) receives the softmax weights. `decode_ready` must hold."""
    heads, d = q.shape[1:]
    kv_heads = k_cache.shape[1] if entries is None else entries.shape[-1]
    width = index.shape[1]
    # The kernel walks these by row-major offsets (no-ops for the plan's own tensors).
    index, lens, rows = index.contiguous(), lens.contiguous(), rows.contiguous()
    entries = None if entries is None else entries.contiguous()
    mask = None if mask is None else mask.contiguous()
    scratch = torch.empty(heads * (2 * d + width + 1) + d, dtype=torch.float32)
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    rc = _library().decode_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), index.data_ptr(), ptr(entries), v_shift,
        lens.data_ptr(), rows.data_ptr(), index.shape[0], width, heads, kv_heads, d, d ** -0.5, cap or 0.0,
        ptr(mask), ptr(weights), out.data_ptr(), out.stride(0), int(q.dtype == torch.bfloat16), scratch.data_ptr())
    if rc != 0:
        raise KernelUnavailable(f"decode attention refused {heads} heads over {kv_heads} of width {d}")


# Below this many (query row, key) pairs a part, a prefill call runs on fewer threads: a thread's
# start (~50 us) outweighs its share.
_SPLIT_PAIRS = 2048
# attention.c's PREFILL_ROWS and KEY_TILE: the rows of a chunk one pass over their keys computes, and the
# keys a tile of that pass holds.
PREFILL_ROWS, KEY_TILE = 8, 64


def prefill_scratch(heads: int, d: int, width: int) -> Tensor:
    """`prefill_attention`'s scratch (attention.c's formula) for rows of up to `width` keys."""
    return torch.empty(PREFILL_ROWS * heads * (2 * d + width + 1) + KEY_TILE * d, dtype=torch.float32)


def prefill_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, starts: Tensor, lens: Tensor,
                      rows: Tensor, cap: float | None, out: Tensor, threads: int = 1) -> None:
    """out[rows[t]] = softmax(cap(q[rows[t]] . K^T / sqrt(d))) V over the lens[t] slots
    slots[starts[t]:starts[t] + lens[t]] of the caches [slots, kv_heads, d], for every row t (a
    prefill chunk's rows: each its causal prefix within its window, all reading one slot array).
    Each row is computed as `decode_attention` computes a decode row over the same slots, bit for bit,
    whatever rows share the call or how they are split across the `threads` (ranges of rows, ctypes
    releasing the GIL; the last on the calling thread). q [T, heads, d] (rows contiguous), out
    [T, heads * d] contiguous; slots, starts, lens, rows int64. `decode_ready` must hold."""
    heads, d = q.shape[1:]
    kv_heads = k_cache.shape[1]
    slots, starts, lens, rows = slots.contiguous(), starts.contiguous(), lens.contiguous(), rows.contiguous()
    n = rows.shape[0]
    if n == 0:
        return
    width = int(lens.max())
    work = lens.cumsum(0)
    parts = max(1, min(threads, n, int(work[-1]) // _SPLIT_PAIRS))
    # Ranges of rows with about equal (row, key) pairs each: causal rows grow towards the chunk's end.
    # Not cut at whole groups of PREFILL_ROWS: the kernel is bound by its arithmetic (4 rows a pass
    # run as fast as 8), so a part's partial group costs less than the parts' imbalance would.
    bounds = [0, *torch.searchsorted(work, work[-1] * torch.arange(1, parts) / parts).tolist(), n]
    lib, failed = _library(), []

    def run(first: int, last: int) -> None:
        scratch = prefill_scratch(heads, d, width)
        rc = lib.prefill_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                   slots.data_ptr(), starts.data_ptr(), lens.data_ptr(), rows.data_ptr(), first, last,
                                   width, heads, kv_heads, d, d ** -0.5, cap or 0.0, out.data_ptr(), out.stride(0),
                                   int(q.dtype == torch.bfloat16), scratch.data_ptr())
        if rc != 0:
            failed.append(rc)

    workers = [threading.Thread(target=run, args=(bounds[i], bounds[i + 1])) for i in range(parts - 1)]
    for w in workers:
        w.start()
    run(bounds[-2], bounds[-1])
    for w in workers:
        w.join()
    if failed:
        raise KernelUnavailable(f"prefill attention refused {heads} heads over {kv_heads} of width {d}")


def write_kv(k: Tensor, v: Tensor, slots: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    """k_cache[slots[t]] = k[t] and v_cache[slots[t]] = v[t] (`index_copy_`'s effect); slots int64
    contiguous; `usable`, `rows_ok` for k and v and a contiguous cache must hold."""
    width = k_cache[0].numel()
    _library().write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(), k.shape[0], width,
                        k.element_size(), k_cache.data_ptr(), v_cache.data_ptr())


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor | None:
    """`apply_rope`'s result bit for bit, in one call (float32 on CPU), or None where this kernel
    does not take the shapes (the caller runs torch's ops)."""
    if (x.dtype != torch.float32 or cos.dtype != torch.float32 or x.dim() != 3 or x.device.type != "cpu"
            or (x.requires_grad and torch.is_grad_enabled()) or not rows_ok(x, torch.float32)
            or not cos.is_contiguous() or not sin.is_contiguous() or cos.shape[-1] % 2 or cos.shape[-1] > x.shape[-1]
            or not enabled() or _capturing() or _library() is None):
        return None
    t, heads, d = x.shape
    out = torch.empty(t, heads, d)
    _library().rope_f32(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), t, heads, d, cos.shape[-1],
                        out.data_ptr())
    return out
