"""Matrix products on llama.cpp-format GGUF blocks where they lie (a uint8 view of the mapped file,
never re-encoded): de-quantisation and x @ W^T over bounded row tiles; gguf's numpy de-quantisation
is the reference path wherever the compiled one is unavailable or turned off (MACE_GGUF_KERNEL=off)."""

from __future__ import annotations

import os

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants
from torch import Tensor

Q = GGMLQuantizationType
SUPPORTED = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K})
ENV = "MACE_GGUF_KERNEL"  # "off": the numpy reference path only
# Float32 weights one reference tile holds (4 MiB): a tile is the whole transient cost of a product,
# whatever the weight's size.
TILE_ELEMENTS = 1 << 20


class GGUFKernelError(ValueError):
    """A block tensor that does not fit its declared type and width (wrong dtype, row bytes or
    layout), or a type this module does not handle."""


def enabled() -> bool:
    return os.environ.get(ENV, "on").lower() not in ("off", "0", "false", "no")


def available() -> bool:
    """Whether the compiled kernels serve the calls (else the numpy reference path does)."""
    return False


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


def dequantize(raw: Tensor, qtype: GGMLQuantizationType, k: int, out: Tensor | None = None) -> Tensor:
    """float32 [rows, k]: the block rows `raw` (uint8 [rows, row_bytes(qtype, k)]) de-quantised,
    equal bit for bit to gguf's numpy de-quantisation."""
    _check_raw(raw, qtype, k)
    out = _check_out(out, (raw.shape[0], k))
    step = _tile_rows(k)
    for lo in range(0, raw.shape[0], step):
        hi = min(raw.shape[0], lo + step)
        out[lo:hi].copy_(_reference_rows(raw, qtype, lo, hi))
    return out


def _check_x(x: Tensor, k: int) -> Tensor:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise GGUFKernelError(f"activations must be float32 [M, {k}]; got {x.dtype} {list(x.shape)}")
    return x.contiguous()


def matmul(x: Tensor, raw: Tensor, qtype: GGMLQuantizationType, k: int, out: Tensor | None = None) -> Tensor:
    """float32 [M, N] = x @ W^T for x float32 [M, k] and W the N block rows of `raw`; W is never
    held in float beyond one bounded tile of rows."""
    _check_raw(raw, qtype, k)
    x = _check_x(x, k)
    n = raw.shape[0]
    out = _check_out(out, (x.shape[0], n))
    step = _tile_rows(k)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        out[:, lo:hi] = x @ _reference_rows(raw, qtype, lo, hi).T
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
    step = _tile_rows(k)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        out.addmm_(g[:, lo:hi], _reference_rows(raw, qtype, lo, hi))
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
