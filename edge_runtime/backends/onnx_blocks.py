"""A GGUF's quantised blocks (`QuantWeight`, model/qweights.py) as the q4_1 format's graph inputs,
taken as they are: no de-quantise / re-quantise round trip. Owns only numpy arithmetic; the
writers (onnx_step.py and its flavours) place the nodes.

Every block format is `scale * (level - zero) (+ offset)` per block of 16 or 32 along K, with
exact float32 scales, which is what `MatMulNBits` computes (4- or 8-bit levels, explicit integer
zero points, blocks of 16 or 32, all on its fast path in onnxruntime 1.32) plus the q4_1
format's float offset per block: Q4_0 (zero 8, the op's default), Q8_0, Q6_K and Q5_0 (signed
8-bit levels, shifted by the op's default zero 128), Q5_1 and Q5_K (5-bit levels in bytes, zero
0 and an offset): all exact. Q4_1 and Q4_K (4-bit levels from 0 and an offset) are centred:
`scale * (q - 8) + (offset + 8 * scale)`, levels and scales as they are and the offset rounded
once in float32. Centred levels halve the error of MatMulNBits' int8 activations (accuracy
level 4) against zero 0, whose products all lean one way and cancel against the offsets: on a
test model's Q4_K blocks 0.13 of the logits' spread against 0.18.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from edge_runtime.backends.quantize import NBitsWeight
from edge_runtime.model.qweights import Blocks, QuantWeight


@dataclass
class BlockPart:
    """One format's rows of a weight: w = scale * (q - zero) + offset per block, where `nbits`
    holds q (MatMulNBits' packing), the scales and the zero points (None: the op's default
    2^(bits-1), which then equals `zero`)."""

    nbits: NBitsWeight
    zero: int
    offsets: np.ndarray | None  # float32 [n, K / block]

    @property
    def blocks(self) -> int:
        return self.nbits.k // self.nbits.block_size


def _zero_points(zero: int, n: int, blocks: int, bits: int) -> np.ndarray | None:
    """MatMulNBits' zero points for one zero per block, or None where the op's default is it."""
    if zero == 1 << (bits - 1):
        return None
    if bits == 8:
        return np.full(n * blocks, zero, np.uint8)
    return np.full(n * ((blocks + 1) // 2), zero | (zero << 4), np.uint8)  # two 4-bit zeros a byte


def block_part(blocks: Blocks, centre: bool = True) -> BlockPart:
    """`blocks` as MatMulNBits inputs: levels bit for bit, float32 scales and offsets as
    `Blocks.dequantize` forms them; `centre`d where that applies (offsets then rounded once)."""
    levels, zero, bits = byte_levels(blocks)
    n, count = levels.shape[:2]
    scales = blocks.scale_per_block().cpu().numpy()
    offsets = blocks.offset_per_block()
    nbits = NBitsWeight(np.ascontiguousarray(levels), scales.reshape(-1),
                        _zero_points(zero, n, count, bits), n, blocks.k, bits, blocks.block)
    part = BlockPart(nbits, zero, None if offsets is None else offsets.cpu().numpy())
    return centred(part) if centre else part


# Rows of a table whose levels are converted at once (5/6-bit ones to bytes, signed 8-bit ones
# shifted): converting a whole table held ~6x its levels' bytes in temporaries (1.5 GB for
# Llama-3.2-1B's tied Q6_K embedding, at every export: the LoRA graph's is exported while the
# daemon serves and trains); a chunk's temporaries are a few MiB.
LEVEL_ROWS = 4096


def byte_levels(blocks: Blocks) -> tuple[np.ndarray, int, int]:
    """(levels [n, K / block, width] as MatMulNBits reads them, their zero, their bits): 4-bit
    and unsigned 8-bit levels as they are (a view, no copy), 5- and 6-bit levels a byte each and
    signed 8-bit ones as q + 128 with zero 128, written `LEVEL_ROWS` rows at a time into one array."""
    if blocks.bits == 4 or (blocks.bits == 8 and blocks.levels.dtype == torch.uint8):
        return blocks.levels.cpu().numpy(), blocks.zero, blocks.bits
    out: np.ndarray | None = None
    zero = blocks.zero
    for lo in range(0, blocks.n, LEVEL_ROWS):
        rows = blocks.slice(lo, lo + LEVEL_ROWS).bytewise()  # 8-bit ones as they are
        q, zero = rows.levels.cpu().numpy(), rows.zero
        if q.dtype == np.int8:  # signed levels, zero 0: q + 128 with zero 128
            q, zero = q.view(np.uint8) ^ np.uint8(0x80), 128
        if out is None:
            out = np.empty((blocks.n, *q.shape[1:]), np.uint8)
        out[lo:lo + len(q)] = q
    assert out is not None
    return out, zero, 8


def centred(part: BlockPart) -> BlockPart:
    """A 4-bit part with zero 0 and offsets as `scale * (q - 8) + (offset + 8 * scale)` (the
    module's docstring says why); any other part as it is. Levels and scales are shared."""
    nb = part.nbits
    if nb.bits != 4 or part.zero != 0 or part.offsets is None:
        return part
    offsets = part.offsets + np.float32(8) * nb.scales.reshape(nb.n, -1)
    return BlockPart(NBitsWeight(nb.packed, nb.scales, None, nb.n, nb.k, nb.bits, nb.block_size), 8, offsets)


def block_parts(weight: QuantWeight, centre: bool = True) -> list[BlockPart]:
    """Each part of `weight` (stacked along N) as MatMulNBits inputs."""
    return [block_part(p, centre) for p in weight.parts]


def unpacked_levels(part: BlockPart) -> np.ndarray:
    """The integer levels q, uint8 [n, K / block, block]."""
    q = part.nbits.packed
    if part.nbits.bits == 8:
        return q
    out = np.empty((*q.shape[:2], 2 * q.shape[2]), np.uint8)
    out[..., 0::2] = q & 0x0F
    out[..., 1::2] = q >> 4
    return out


def signed_levels(part: BlockPart) -> tuple[np.ndarray, np.ndarray | None]:
    """(signed levels s [n, K] for a zero-point-free block-wise DequantizeLinear, the offsets
    that go with them) such that w = scale * s + offset: s = q - zero where that fits the signed
    range (exact: Q4_0, Q8_0, Q6_K, Q5_x), else q - 2^(bits-1) with the offset moved by
    (2^(bits-1) - zero) * scale, one float32 rounding (Q4_1 and Q4_K's 4-bit levels from 0)."""
    nb = part.nbits
    q = unpacked_levels(part).astype(np.int16)
    half = 1 << (nb.bits - 1)
    lo, hi = int(q.min(initial=part.zero)), int(q.max(initial=part.zero))
    if -half <= lo - part.zero and hi - part.zero < half:
        return (q - part.zero).astype(np.int8).reshape(nb.n, nb.k), part.offsets
    shift = np.float32(half - part.zero) * nb.scales.reshape(nb.n, -1)
    offsets = shift if part.offsets is None else (part.offsets + shift).astype(np.float32)
    return (q - half).astype(np.int8).reshape(nb.n, nb.k), offsets
