"""Block-wise weight-only quantisation of linear weights (int8, int4) for the ONNX graphs.

Two packings of the same numbers: ONNX Runtime's `MatMulNBits` (com.microsoft, uint8 blobs with
explicit zero points) and the standard `DequantizeLinear` with block-wise INT4/INT8 (opset 21),
which TensorRT reads as weight-only quantisation. A third, `pack_q4_offsets`, is llama.cpp's Q4_1
grid (a float minimum per block) as symmetric `MatMulNBits` blocks plus one float offset per
block, which the graph adds as a block-sum product. Owns only numpy arithmetic; no graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QUANTIZATIONS = ("none", "int8", "int4")
BLOCK_SIZE = 32  # along K; the block size of llama.cpp's Q4_0/Q4_1, so the error is comparable


def bits_of(quantization: str) -> int:
    if quantization not in ("int8", "int4"):
        raise ValueError(f"unknown weight quantisation {quantization!r}; use one of {QUANTIZATIONS}")
    return 8 if quantization == "int8" else 4


@dataclass
class NBitsWeight:
    """A weight [N, K] (nn.Linear layout) as `MatMulNBits` inputs and attributes."""

    packed: np.ndarray  # uint8 [N, K / block, block * bits / 8]
    scales: np.ndarray  # float32 [N * K / block]
    zero_points: np.ndarray | None  # uint8 [N * ceil(K / block * bits / 8)]; None = 2^(bits-1)
    n: int
    k: int
    bits: int
    block_size: int


def _blocks(weight: np.ndarray, block_size: int) -> np.ndarray:
    n, k = weight.shape
    if k % block_size:
        raise ValueError(f"K={k} is not a multiple of the quantisation block {block_size}")
    return weight.reshape(n, k // block_size, block_size).astype(np.float32)


def quantize_asymmetric(weight: np.ndarray, bits: int, block_size: int = BLOCK_SIZE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-block min/max quantisation with an integer zero point: q in [0, 2^bits - 1],
    w ~ (q - zero) * scale, the range widened to hold 0 exactly. (Float zero points would give
    llama.cpp's Q4_1 grid exactly, but ONNX Runtime then dequantises on every call: 3 tok/s
    instead of 55 measured.) Returns (q uint8 [N, blocks, block], scale [N, blocks], zero uint8)."""
    blocks = _blocks(weight, block_size)
    qmax = (1 << bits) - 1
    lo = np.minimum(blocks.min(axis=-1), 0.0)
    hi = np.maximum(blocks.max(axis=-1), 0.0)
    scale = (hi - lo) / qmax
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    zero = np.clip(np.round(-lo / scale), 0, qmax)
    q = np.clip(np.round(blocks / scale[..., None] + zero[..., None]), 0, qmax)
    return q.astype(np.uint8), scale, zero.astype(np.uint8)


def quantize_symmetric(weight: np.ndarray, bits: int, block_size: int = BLOCK_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """Per-block abs-max quantisation: q in [-(2^(bits-1) - 1), 2^(bits-1) - 1], w ~ q * scale.
    Returns (q int8 [N, blocks, block], scale [N, blocks])."""
    blocks = _blocks(weight, block_size)
    qmax = (1 << (bits - 1)) - 1
    scale = np.abs(blocks).max(axis=-1) / qmax
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.round(blocks / scale[..., None]), -qmax, qmax)
    return q.astype(np.int8), scale


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """4-bit values [..., 2m] two per byte, the even element in the low nibble."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def nbits_levels(w: NBitsWeight) -> np.ndarray:
    """The stored integer levels of `w`, uint8 [N, K / block, block] (4-bit ones unpacked)."""
    if w.bits != 4:
        return w.packed
    q = np.empty((w.n, w.k // w.block_size, w.block_size), np.uint8)
    q[..., 0::2] = w.packed & 0x0F
    q[..., 1::2] = w.packed >> 4
    return q


def pack_nbits(weight: np.ndarray, bits: int, block_size: int = BLOCK_SIZE, symmetric: bool = False) -> NBitsWeight:
    """Quantise `weight` [N, K] and lay it out as `MatMulNBits` expects: per output row, blocks
    of K; for 4 bits two values per byte, the even element in the low nibble. Symmetric blocks
    carry no zero points (the op's default, 2^(bits-1), applies)."""
    n, k = weight.shape
    blocks = k // block_size
    if symmetric:
        qs, scale = quantize_symmetric(weight, bits, block_size)
        q = (qs.astype(np.int16) + (1 << (bits - 1))).astype(np.uint8)
        zero = np.full((n, blocks), 1 << (bits - 1), np.uint8)
    else:
        q, scale, zero = quantize_asymmetric(weight, bits, block_size)
    if bits == 4:
        packed = _pack_nibbles(q)
        if blocks % 2:
            zero = np.concatenate([zero, np.zeros((n, 1), np.uint8)], axis=1)
        zero_packed = _pack_nibbles(zero)
    else:
        packed, zero_packed = q, zero
    zero_points = None if symmetric else zero_packed.reshape(-1)
    return NBitsWeight(packed, scale.reshape(-1), zero_points, n, k, bits, block_size)


def dequantize_nbits(w: NBitsWeight) -> np.ndarray:
    """The float weight [N, K] that `MatMulNBits` computes with (tests and error reports)."""
    blocks = w.k // w.block_size
    q = nbits_levels(w)
    if w.zero_points is None:
        zero = np.full((w.n, blocks), 1 << (w.bits - 1), np.uint8)
    elif w.bits == 4:
        zp = w.zero_points.reshape(w.n, -1)
        zero = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(w.n, -1)[:, :blocks]
    else:
        zero = w.zero_points.reshape(w.n, blocks)
    scale = w.scales.reshape(w.n, blocks)
    return ((q.astype(np.float32) - zero[..., None].astype(np.float32)) * scale[..., None]).reshape(w.n, w.k)


@dataclass
class OffsetNBitsWeight:
    """A weight [N, K] as 4-bit `MatMulNBits` blocks without zero points (the op's default 8)
    plus a float offset per block: w = scale * (q - 8) + offset."""

    nbits: NBitsWeight
    offsets: np.ndarray  # float32 [N, K / block]


def pack_q4_offsets(weight: np.ndarray, block_size: int = BLOCK_SIZE) -> OffsetNBitsWeight:
    """Per-block min/max 4-bit quantisation with a float minimum, the grid of llama.cpp's Q4_1:
    scale = (max - min) / 15, q = round((w - min) / scale) in [0, 15], w ~ scale * q + min.

    MatMulNBits takes only integer zero points on its fast path (float ones make ONNX Runtime
    dequantise the whole weight on every call: 12 ms instead of 0.2 ms for a 576x3072 row,
    measured with onnxruntime 1.32), so the minimum cannot ride in the op. Written as
    scale * (q - 8) + (min + 8 * scale), the first term is a plain symmetric MatMulNBits and the
    second, constant over each block, adds sum(x over the block) * offset to the output. A weight
    that came from a Q4_1 GGUF (de-quantised, as the default model is) lies on this grid, so its
    blocks are recovered exactly: the block's extremes are q = 0 and q = 15 by Q4_1's construction."""
    blocks = _blocks(weight, block_size)
    lo, hi = blocks.min(axis=-1), blocks.max(axis=-1)
    scale = ((hi - lo) / 15).astype(np.float32)
    scale = np.where(scale == 0, np.float32(1.0), scale).astype(np.float32)
    q = np.clip(np.round((blocks - lo[..., None]) / scale[..., None]), 0, 15).astype(np.uint8)
    nbits = NBitsWeight(_pack_nibbles(q), scale.reshape(-1), None, *weight.shape, 4, block_size)
    offsets = (lo + 8 * scale).astype(np.float32)
    return OffsetNBitsWeight(nbits, offsets)


def dequantize_q4_offsets(w: OffsetNBitsWeight) -> np.ndarray:
    """The float weight [N, K] the offset form computes with (tests and error reports)."""
    base = dequantize_nbits(w.nbits).reshape(w.nbits.n, -1, w.nbits.block_size)
    return (base + w.offsets[..., None]).reshape(w.nbits.n, w.nbits.k)
