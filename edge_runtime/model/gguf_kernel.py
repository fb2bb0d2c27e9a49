"""Matrix products on llama.cpp-format GGUF blocks where they lie (a uint8 view of the mapped file,
never re-encoded): de-quantisation and x @ W^T over bounded row tiles; gguf's numpy de-quantisation
is the reference path wherever the compiled one is unavailable or turned off (MACE_GGUF_KERNEL=off)."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants
from torch import Tensor

from edge_runtime.model.qkernel import KernelUnavailable, build_library, switch_on

log = logging.getLogger(__name__)

Q = GGMLQuantizationType
SUPPORTED = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K})
ENV = "MACE_GGUF_KERNEL"  # "off": the numpy reference path only
# "int8": products of up to FUSED_MAX_ROWS rows quantise x to int8 per 32 values (llama.cpp's way,
# MatMulNBits' accuracy level 4); "f32" (default): x stays float32. See `matmul`.
ACTIVATIONS_ENV = "MACE_GGUF_ACTIVATIONS"
# Float32 weights one reference tile holds (4 MiB): a tile is the whole transient cost of a product,
# whatever the weight's size.
TILE_ELEMENTS = 1 << 20
SOURCE = Path(__file__).with_name("gguf_native.c")
INCLUDES = tuple(SOURCE.with_name(f"gguf_native_{part}.c") for part in ("q8", "k8", "pool", "fused", "lora", "stack"))  # what SOURCE includes
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-pthread"]  # no errno: sqrt inline
# Weights each thread takes at least (the library's own pool wakes a spinning worker in well under a
# microsecond, a sleeping one in 10-50 us on a quiet machine), and the rows of x above which a product
# de-quantises tiles of W for torch's GEMM instead (the fused kernel reads each weight once per 8 rows
# of x; a GEMM blocks for the cache, which wins once the de-quantisation is shared by many rows).
PARALLEL_MIN_WEIGHTS = 1 << 18
FUSED_MAX_ROWS = 16
_OFFSET_TYPES = frozenset({Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K})  # a per-32 offset beside the scaled levels
# int8 x as llama.cpp's q8_K (per 256, with sums per 16): the K-quants' integer scales apply exactly.
Q8K_TYPES = frozenset({Q.Q4_K, Q.Q5_K, Q.Q6_K})


class GGUFKernelError(ValueError):
    """A block tensor that does not fit its declared type and width (wrong dtype, row bytes or
    layout), or a type this module does not handle."""


def enabled() -> bool:
    return switch_on(ENV)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernels, or None (logged once) where they cannot be had."""
    try:
        return bind(build_library(SOURCE, _FLAGS, INCLUDES))
    except KernelUnavailable as e:
        log.info("GGUF blocks go through gguf's numpy de-quantisation: %s", e)
        return None


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` (gguf_native.c built) with its functions' argument types declared."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.gg_dequant.argtypes = [i32, p, i64, i64, p]
    lib.gg_matmul.argtypes = [i32, p, i64, i64, p, i64, p, p, i64]
    lib.gg_xsums.argtypes = [p, i64, i64, p]
    lib.gg_quantize_x.argtypes = [p, i64, i64, p, p]
    lib.gg_matmul_q8.argtypes = [i32, p, i64, i64, p, p, i64, p, p, i64]
    lib.gg_quantize_k8.argtypes = [p, i64, i64, p, p, p]
    lib.gg_dequant_mt.argtypes = [i32, p, i64, i64, p, i32]
    lib.gg_matmul_mt.argtypes = [i32, p, i64, i64, p, i64, p, i32, p, i64, i32]
    lib.gg_group_k8.argtypes = [p, i64, i64, i64, i32, p, ctypes.c_float, ctypes.c_float, p, i32, p, p, p, p, p, i64,
                                p, i64, i32]
    lib.gg_group_k8.restype = i32
    lib.gg_decode_stack.argtypes = [p, p, i64, i64, i64, p, i64, i64, i64, i64, ctypes.c_float, ctypes.c_float, p, p, p,
                                    p, p, p, i64, ctypes.c_float, ctypes.c_float, p, p, p, p, p, p, p, p, p, p, p, i32]
    lib.gg_decode_stack.restype = i32
    lib.gg_lora.argtypes = [p, i64, p, i64, p, i64, i32]
    lib.gg_lora.restype = i32
    lib.gg_dequant.restype = lib.gg_matmul.restype = lib.gg_matmul_q8.restype = i32
    lib.gg_dequant_mt.restype = lib.gg_matmul_mt.restype = i32
    lib.gg_quantize_x.restype = lib.gg_quantize_k8.restype = None
    lib.gg_xsums.restype = None
    return lib


def int8_activations() -> bool:
    """The default of `matmul`'s int8_x (MACE_GGUF_ACTIVATIONS=int8 turns it on)."""
    return os.environ.get(ACTIVATIONS_ENV, "f32").lower() == "int8"


def available() -> bool:
    """Whether the compiled kernels serve the calls (else the numpy reference path does)."""
    return enabled() and _library() is not None


def _threads(n: int, weights: int) -> int:
    """Threads for a call over n weight rows: torch's intra-op count where the work is large enough.
    The library's persistent pool runs them (the calling thread takes the first range; ctypes
    releases the GIL for the call)."""
    return max(1, min(torch.get_num_threads(), n, weights // PARALLEL_MIN_WEIGHTS))


def row_bytes(qtype: GGMLQuantizationType, k: int) -> int:
    """Bytes of one row of `k` weights of `qtype` in the file."""
    if qtype not in SUPPORTED:
        raise GGUFKernelError(f"GGUF type {getattr(qtype, 'name', qtype)} is not supported here")
    block, size = GGML_QUANT_SIZES[qtype]
    if k <= 0 or k % block:
        raise GGUFKernelError(f"{qtype.name} rows hold whole blocks of {block} weights; {k} is not a multiple")
    return k // block * size


def _check_raw(raw: Tensor, qtype: GGMLQuantizationType, k: int) -> None:
    want = row_bytes(qtype, k)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != want:
        raise GGUFKernelError(f"{qtype.name} weights of width {k} are uint8 [rows, {want}]; "
                              f"got {raw.dtype} {list(raw.shape)}")
    if raw.device.type != "cpu" or not raw.is_contiguous():
        raise GGUFKernelError("block weights must be a contiguous CPU tensor (a view of the mapped file)")


def _check_out(out: Tensor | None, shape: tuple[int, ...]) -> Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.float32)
    if out.dtype != torch.float32 or tuple(out.shape) != shape or not out.is_contiguous():
        raise GGUFKernelError(f"out must be contiguous float32 {list(shape)}; got {out.dtype} {list(out.shape)}")
    return out


def _tile_rows(k: int) -> int:
    return max(1, TILE_ELEMENTS // k)


def _reference_rows(raw: Tensor, qtype: GGMLQuantizationType, lo: int, hi: int) -> Tensor:
    """Rows lo:hi de-quantised by gguf's numpy code (the independent reference)."""
    return torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(raw[lo:hi].numpy(), qtype)))


def _ok(status: int, qtype: GGMLQuantizationType) -> None:
    """The compiled call's status: -1 is a type it does not handle (its output is not written), -2 a
    scratch allocation that failed."""
    if status == -2:
        raise MemoryError("the compiled GGUF kernels could not allocate their scratch for x")
    if status != 0:
        raise GGUFKernelError(f"the compiled kernels do not handle {qtype.name}")


def _compiled_rows(lib: ctypes.CDLL, raw: Tensor, qtype: GGMLQuantizationType, k: int, lo: int, hi: int,
                   out: Tensor) -> None:
    """out (float32 [hi - lo, k], contiguous) = rows lo:hi de-quantised by the compiled kernels."""
    _ok(lib.gg_dequant_mt(int(qtype), raw[lo].data_ptr(), hi - lo, k, out.data_ptr(), _threads(hi - lo, (hi - lo) * k)),
        qtype)


def _tiles(raw: Tensor, qtype: GGMLQuantizationType, k: int):
    """(lo, hi, float32 rows lo:hi) over the whole weight, a bounded tile at a time; the compiled
    path re-uses one tile buffer, so a tile is valid only until the next is taken."""
    n = raw.shape[0]
    step = min(n, _tile_rows(k))
    lib = _library() if enabled() else None
    buffer = torch.empty((step, k), dtype=torch.float32) if lib is not None else None
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        if buffer is None:
            yield lo, hi, _reference_rows(raw, qtype, lo, hi)
        else:
            _compiled_rows(lib, raw, qtype, k, lo, hi, buffer[:hi - lo])
            yield lo, hi, buffer[:hi - lo]


def dequantize(raw: Tensor, qtype: GGMLQuantizationType, k: int, out: Tensor | None = None) -> Tensor:
    """float32 [rows, k]: the block rows `raw` (uint8 [rows, row_bytes(qtype, k)]) de-quantised,
    equal bit for bit to gguf's numpy de-quantisation."""
    _check_raw(raw, qtype, k)
    out = _check_out(out, (raw.shape[0], k))
    lib = _library() if enabled() else None
    if lib is not None:
        if raw.shape[0]:
            _compiled_rows(lib, raw, qtype, k, 0, raw.shape[0], out)
        return out
    step = _tile_rows(k)
    for lo in range(0, raw.shape[0], step):
        hi = min(raw.shape[0], lo + step)
        out[lo:hi].copy_(_reference_rows(raw, qtype, lo, hi))
    return out


def _check_x(x: Tensor, k: int) -> Tensor:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise GGUFKernelError(f"activations must be float32 [M, {k}]; got {x.dtype} {list(x.shape)}")
    return x.contiguous()


def matmul(x: Tensor, raw: Tensor, qtype: GGMLQuantizationType, k: int, out: Tensor | None = None,
           int8_x: bool | None = None) -> Tensor:
    """float32 [M, N] = x @ W^T for x float32 [M, k] and W the N block rows of `raw`; W is never
    held in float beyond one bounded tile of rows. Up to FUSED_MAX_ROWS rows of x go through the
    fused kernel (each block de-quantised in registers and L1 once per 8 rows of x); more rows
    through de-quantised tiles and torch's GEMM.

    int8_x (default `int8_activations()`; block types on the fused path only) quantises x to int8
    and sums exact int32 block products, as llama.cpp and MatMulNBits at accuracy level 4 do:
    several times faster. Q4_K, Q5_K and Q6_K take x as llama.cpp's q8_K (one scale per 256 values, the
    sub-block scales applied in integers): off x @ W^T by at most sum |w| * dx_b / 2 over x's
    256-value blocks b (dx_b = max |x_b| / 127); other types per 32 values, by sum |w_l| * dx_b / 2
    over 32-value blocks (w_l the weight less its per-32 offset); plus float32 summation order
    (tests/model/test_gguf_kernel.py holds it to those bounds)."""
    _check_raw(raw, qtype, k)
    x = _check_x(x, k)
    m, n = x.shape[0], raw.shape[0]
    out = _check_out(out, (m, n))
    lib = _library() if enabled() else None
    if m == 0 or n == 0:
        return out
    if lib is not None and m <= FUSED_MAX_ROWS:
        int8 = (int8_activations() if int8_x is None else int8_x) and GGML_QUANT_SIZES[qtype][0] > 1
        sums = None
        if qtype in _OFFSET_TYPES and not (int8 and qtype in Q8K_TYPES):
            sums = torch.empty((m, k // 32), dtype=torch.float32)
            lib.gg_xsums(x.data_ptr(), m, k, sums.data_ptr())
        xs = None if sums is None else sums.data_ptr()
        _ok(lib.gg_matmul_mt(int(qtype), raw.data_ptr(), n, k, x.data_ptr(), m, xs, int(int8), out.data_ptr(), n,
                             _threads(n, n * k)), qtype)
        return out
    for lo, hi, w in _tiles(raw, qtype, k):
        out[:, lo:hi] = x @ w.T
    return out


def matmul_back(g: Tensor, raw: Tensor, qtype: GGMLQuantizationType, k: int, out: Tensor | None = None) -> Tensor:
    """float32 [M, k] = g @ W for g float32 [M, N] (the gradient of x @ W^T with respect to x), over
    the same bounded tiles as `matmul`."""
    _check_raw(raw, qtype, k)
    n = raw.shape[0]
    if g.dtype != torch.float32 or g.dim() != 2 or g.shape[1] != n:
        raise GGUFKernelError(f"gradients must be float32 [M, {n}]; got {g.dtype} {list(g.shape)}")
    g = g.contiguous()
    out = _check_out(out, (g.shape[0], k))
    out.zero_()
    if n == 0:
        return out
    for lo, hi, w in _tiles(raw, qtype, k):
        out.addmm_(g[:, lo:hi], w)
    return out


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, raw: Tensor, qtype: GGMLQuantizationType, k: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(raw)
        ctx.qtype, ctx.k = qtype, k
        return matmul(x, raw, qtype, k)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (raw,) = ctx.saved_tensors
        gx = matmul_back(grad.float(), raw, ctx.qtype, ctx.k) if ctx.needs_input_grad[0] else None
        return gx, None, None, None


def linear(x: Tensor, raw: Tensor, qtype: GGMLQuantizationType, k: int) -> Tensor:
    """x [..., k] @ W^T -> [..., N] with the gradient flowing to x (the weights stay frozen)."""
    lead = x.shape[:-1]
    y = _Linear.apply(x.reshape(-1, k).float(), raw, qtype, k)
    return y.reshape(*lead, raw.shape[0])


# `group_matmul`'s preparations of x.
PREP_NONE, PREP_NORM, PREP_SILU_MUL = 0, 1, 2


class GroupPlan:
    """The parts of one weight for `group_matmul`: K-quant block rows (each a uint8 [n_p, row bytes]
    view of the file) and, for each row, the model column its output goes to (`cols`, int64 [N]).
    The ctypes arrays are built once; the plan holds the tensors they point into."""

    def __init__(self, parts: list[tuple[Tensor, GGMLQuantizationType]], k: int, cols: Tensor) -> None:
        for raw, qtype in parts:
            if qtype not in Q8K_TYPES:
                raise GGUFKernelError(f"a grouped product takes Q4_K, Q5_K and Q6_K parts; not {qtype.name}")
            _check_raw(raw, qtype, k)
        if k % 256:
            raise GGUFKernelError(f"a grouped product's width is a multiple of 256; {k} is not")
        starts = [0]
        for raw, _ in parts:
            starts.append(starts[-1] + raw.shape[0])
        if cols.dtype != torch.int64 or tuple(cols.shape) != (starts[-1],):
            raise GGUFKernelError(f"cols must be int64 [{starts[-1]}]")
        self.k, self.n, self.nparts = k, starts[-1], len(parts)
        self.raws = [raw for raw, _ in parts]
        self.cols = cols.contiguous()
        self._types = (ctypes.c_int * len(parts))(*[int(q) for _, q in parts])
        self._ptrs = (ctypes.c_void_p * len(parts))(*[raw.data_ptr() for raw in self.raws])
        self._starts = (ctypes.c_int64 * len(starts))(*starts)


def group_matmul(x: Tensor, plan: GroupPlan, prep: int = PREP_NONE, norm: Tensor | None = None, offset: float = 0.0,
                 eps: float = 0.0, keep: bool = False, base: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """(out float32 [M, N], the prepared x float32 [M, k] where `keep`): out[:, cols[i]] = W_i .
    q8_K(prep(x)) (+ base[:, cols[i]]) over every row i of the plan's parts, in one call: x prepared
    (PREP_NORM: rms_norm(x, norm, eps, offset) in float32; PREP_SILU_MUL: silu(x[:, :k]) * x[:, k:],
    x [M, 2k]) and quantised to q8_K once, the products of every part in one job of the pool. Each row
    of out depends on its row of x alone. The prepared row is computed in C and may differ from
    torch's in the last bit (llama.py's rms_norm, F.silu): then its q8_K may differ by one level in a
    few values, and the product by at most sum |w| * dx_b / 2 over x's 256-blocks beyond the bound
    `matmul` states."""
    lib = _library()  # (not `enabled()` again: the caller's plan was made where the kernels serve)
    if lib is None:
        raise GGUFKernelError("grouped products need the compiled kernels")
    width = 2 * plan.k if prep == PREP_SILU_MUL else plan.k
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != width or not x.is_contiguous():
        raise GGUFKernelError(f"x must be contiguous float32 [M, {width}]; got {x.dtype} {list(x.shape)}")
    m = x.shape[0]
    if prep == PREP_NORM and (norm is None or norm.dtype != torch.float32 or tuple(norm.shape) != (plan.k,)
                              or not norm.is_contiguous()):
        raise GGUFKernelError(f"the norm's weight must be contiguous float32 [{plan.k}]")
    out = torch.empty((m, plan.n), dtype=torch.float32)
    if base is not None and (base.dtype != torch.float32 or tuple(base.shape) != (m, plan.n) or not base.is_contiguous()):
        raise GGUFKernelError(f"base must be contiguous float32 [{m}, {plan.n}]")
    xf = torch.empty((m, plan.k), dtype=torch.float32) if keep else None
    if m:
        _ok(lib.gg_group_k8(x.data_ptr(), m, plan.k, width, prep, None if norm is None else norm.data_ptr(), offset, eps,
                            None if xf is None else xf.data_ptr(), plan.nparts, plan._types, plan._ptrs, plan._starts,
                            plan.cols.data_ptr(), out.data_ptr(), plan.n, None if base is None else base.data_ptr(),
                            plan.n, _threads(plan.n, plan.n * plan.k)), Q.Q4_K)
    return out, xf
