"""Linear weights kept as quantised blocks and de-quantised on use: the one copy of a model's
matrices that serving and training both read.

A weight [N, K] (nn.Linear layout) is one or more `Blocks` stacked along N. Each `Blocks` has
one format: per row, blocks of `block` elements along K, each `scale * (level - zero)`, plus a
float `offset` per block where the format has one. That holds llama.cpp's Q4_0, Q4_1, Q4_K
(4-bit levels), Q5_K (5-bit levels in bytes), Q6_K and Q8_0 (8-bit levels) exactly: every product
of a level and a scale is exact in float32, so the one rounding left is the offset's add, the
same as llama.cpp's own de-quantisation (tests compare bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True, eq=False)
class Blocks:
    """Rows of one block format. `levels`: [n, k / block, block] bytes for 8 bits, uint8, or int8
    for signed levels (zero 0: Q8_0, Q6_K and Q5_0 keep `q - zero` in a signed byte, which saves
    de-quantisation a pass), or uint8 [n, k / block, block / 2] for 4 bits, two to a byte with
    the even element in the low nibble (`MatMulNBits`' packing, so a graph can take them as they
    are). `scales`, `offsets`: float32 [n, k / block]; `offsets` None = none (symmetric formats)."""

    levels: Tensor
    scales: Tensor
    offsets: Tensor | None
    zero: int
    bits: int

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"levels of {self.bits} bits: only 4 (packed) and 8 are stored")
        signed = self.levels.dtype == torch.int8 and self.bits == 8 and self.zero == 0
        if not (self.levels.dtype == torch.uint8 or signed) or self.levels.dim() != 3:
            raise ValueError(f"levels must be uint8 (or, 8-bit with zero 0, int8) [n, blocks, bytes], got "
                             f"{self.levels.dtype} {tuple(self.levels.shape)} of {self.bits} bits, zero {self.zero}")
        if tuple(self.scales.shape) != tuple(self.levels.shape[:2]):
            raise ValueError(f"scales {tuple(self.scales.shape)} do not match levels {tuple(self.levels.shape)}")
        if self.offsets is not None and tuple(self.offsets.shape) != tuple(self.scales.shape):
            raise ValueError(f"offsets {tuple(self.offsets.shape)} do not match scales {tuple(self.scales.shape)}")

    @property
    def n(self) -> int:
        return self.levels.shape[0]

    @property
    def block(self) -> int:
        return self.levels.shape[2] * (2 if self.bits == 4 else 1)

    @property
    def k(self) -> int:
        return self.levels.shape[1] * self.block

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[Tensor]:
        return [self.levels, self.scales] + ([] if self.offsets is None else [self.offsets])

    def same_format(self, other: Blocks) -> bool:
        """Whether `other` can be stored in the same tensors (concatenated along N)."""
        return (self.bits, self.block, self.zero, self.offsets is None, self.k, self.levels.dtype) == \
            (other.bits, other.block, other.zero, other.offsets is None, other.k, other.levels.dtype)

    def unpacked(self) -> Tensor:
        """The integer levels, [n, k / block, block] (uint8, or int8 for signed ones)."""
        if self.bits == 8:
            return self.levels
        packed = self.levels
        return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:2], -1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The float weight [n, k], computed in float32 (exact as above) and cast to `dtype`.
        Written in place into one float buffer (4x faster than a chain of new tensors here).
        (`scale * q - scale * zero` would save the subtraction's pass and give the same numbers,
        but +0 where llama.cpp has -0.)"""
        n, blocks, width = self.levels.shape
        if self.bits == 4:
            q = torch.empty(n, blocks, width, 2, dtype=torch.float32, device=self.levels.device)
            q[..., 0] = self.levels & 0x0F
            q[..., 1] = self.levels >> 4
            q = q.view(n, blocks, 2 * width)
        else:
            q = self.levels.to(torch.float32)
        if self.zero:
            q.sub_(float(self.zero))
        q.mul_(self.scales.unsqueeze(-1))
        if self.offsets is not None:
            q.add_(self.offsets.unsqueeze(-1))
        w = q.view(n, self.k)
        return w if dtype == torch.float32 else w.to(dtype)

    def rows(self, index: Tensor) -> Blocks:
        """Rows `index` of these blocks (a row permutation, or an embedding's gather)."""
        return Blocks(self.levels[index], self.scales[index],
                      None if self.offsets is None else self.offsets[index], self.zero, self.bits)

    def slice(self, lo: int, hi: int) -> Blocks:
        """Rows lo..hi-1 (views, no copy)."""
        return Blocks(self.levels[lo:hi], self.scales[lo:hi],
                      None if self.offsets is None else self.offsets[lo:hi], self.zero, self.bits)

    def to(self, device: torch.device | str) -> Blocks:
        return Blocks(self.levels.to(device), self.scales.to(device),
                      None if self.offsets is None else self.offsets.to(device), self.zero, self.bits)

    @staticmethod
    def cat(parts: Sequence[Blocks]) -> Blocks:
        """Parts of one format stacked along N, in one set of tensors."""
        first = parts[0]
        if not all(first.same_format(p) for p in parts):
            raise ValueError("only blocks of one format concatenate into one Blocks")
        offsets = None if first.offsets is None else torch.cat([p.offsets for p in parts])
        return Blocks(torch.cat([p.levels for p in parts]), torch.cat([p.scales for p in parts]), offsets,
                      first.zero, first.bits)


_FIELDS = ("levels", "scales", "offsets")
# Most float elements one de-quantised piece of a weight holds at once (64 MiB in float32): a
# large table (an LM head of 128k rows) is read in row chunks instead of whole.
CHUNK_ELEMENTS = 1 << 24


class QuantWeight(nn.Module):
    """A weight [N, K] as `Blocks` stacked along N (q|k|v of a layer may mix formats: Q4_K_M
    files keep some `attn_v` in Q6_K). Its tensors are buffers, so `.to()`, `state_dict()` and
    the engine's byte count see them; it has no parameters (base weights are frozen)."""

    def __init__(self, parts: Sequence[Blocks]) -> None:
        super().__init__()
        if not parts:
            raise ValueError("a quantised weight needs at least one part")
        merged: list[Blocks] = []
        for part in parts:  # adjacent parts of one format share tensors: fewer, larger kernels
            if merged and merged[-1].same_format(part):
                merged[-1] = Blocks.cat([merged[-1], part])
            else:
                merged.append(part)
        ks = {p.k for p in merged}
        if len(ks) != 1:
            raise ValueError(f"parts of one weight must share K, got {sorted(ks)}")
        self._meta = [(p.zero, p.bits) for p in merged]
        for i, part in enumerate(merged):
            for name in _FIELDS:
                self.register_buffer(f"{name}_{i}", getattr(part, name))

    @property
    def parts(self) -> list[Blocks]:
        return [Blocks(getattr(self, f"levels_{i}"), getattr(self, f"scales_{i}"), getattr(self, f"offsets_{i}"),
                       zero, bits) for i, (zero, bits) in enumerate(self._meta)]

    @property
    def formats(self) -> list[tuple[int, int]]:
        """(zero, bits) of each part, in order: what, besides the tensors, a cache must keep."""
        return list(self._meta)

    @property
    def shape(self) -> torch.Size:
        parts = self.parts
        return torch.Size((sum(p.n for p in parts), parts[0].k))

    @property
    def device(self) -> torch.device:
        return self.scales_0.device

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        parts = self.parts
        if len(parts) == 1:
            return parts[0].dequantize(dtype)
        return torch.cat([p.dequantize(dtype) for p in parts])

    def row_chunks(self) -> Iterator[tuple[int, Blocks]]:
        """(first row, rows) pieces of at most CHUNK_ELEMENTS elements, in order (views)."""
        start = 0
        for part in self.parts:
            step = max(1, CHUNK_ELEMENTS // part.k)
            for lo in range(0, part.n, step):
                yield start + lo, part.slice(lo, min(part.n, lo + step))
            start += part.n

    def embedding(self, ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """Rows `ids` (any shape) de-quantised: an embedding table read one token at a time."""
        flat = ids.reshape(-1)
        out = torch.empty(flat.numel(), self.shape[1], dtype=dtype, device=flat.device)
        start = 0
        for part in self.parts:
            inside = (flat >= start) & (flat < start + part.n)
            where = inside.nonzero().squeeze(-1)
            if where.numel():
                out[where] = part.rows(flat[where] - start).dequantize(dtype)
            start += part.n
        return out.reshape(*ids.shape, -1)

    @staticmethod
    def cat(weights: Sequence[QuantWeight]) -> QuantWeight:
        return QuantWeight([p for w in weights for p in w.parts])

    def extra_repr(self) -> str:
        kinds = ", ".join(f"{p.n} rows {p.bits}-bit/{p.block}{'+offset' if p.offsets is not None else ''}"
                          for p in self.parts)
        return f"[{self.shape[0]}, {self.shape[1]}]: {kinds}"


def _linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return torch.nn.functional.linear(x, w, b)


LinearOp = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]


class _QuantLinear(torch.autograd.Function):
    """x @ W^T + b with W de-quantised in the forward and once more in the backward, a chunk of
    rows at a time, so autograd keeps no float copy of W between them (it saves nothing: W is
    frozen, so the gradient w.r.t. x needs only W, and none w.r.t. W is taken)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: QuantWeight, bias: Tensor | None, op: LinearOp) -> Tensor:  # noqa: ANN001
        ctx.weight = weight
        ctx.has_bias = bias is not None
        return _forward(x, weight, bias, op)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, Tensor | None, None]:  # noqa: ANN001
        grad_x = None
        if ctx.needs_input_grad[0]:
            for lo, part in ctx.weight.row_chunks():
                step = grad[..., lo:lo + part.n].matmul(part.dequantize(grad.dtype))
                grad_x = step if grad_x is None else grad_x.add_(step)
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_b, None


def _forward(x: Tensor, weight: QuantWeight, bias: Tensor | None, op: LinearOp) -> Tensor:
    outs = [op(x, part.dequantize(x.dtype), None if bias is None else bias[lo:lo + part.n])
            for lo, part in weight.row_chunks()]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def quant_linear(x: Tensor, weight: QuantWeight, bias: Tensor | None = None, op: LinearOp = _linear) -> Tensor:
    """`op(x, W, bias)` (F.linear by default) over a quantised weight, de-quantised for this call
    only, CHUNK_ELEMENTS of it at a time."""
    if not torch.is_grad_enabled() or not (x.requires_grad or (bias is not None and bias.requires_grad)):
        return _forward(x, weight, bias, op)
    return _QuantLinear.apply(x, weight, bias, op)
