"""Reads a GGUF's tensors, one at a time through its memory map, straight into quantised
`Blocks` (edge_runtime.model.qweights), with no float copy of a quantised tensor.

Each llama.cpp block type maps onto a block format exactly: Q4_0, Q4_1 and Q4_K's sub-blocks as
4-bit levels (Q4_K: a per-32 scale d*sc and minimum dmin*m), Q5_0, Q5_1 and Q5_K's as 5-bit and
Q6_K's as 6-bit levels (low nibbles packed, the high bits beside them), Q8_0 as 8-bit levels;
F32, F16 and BF16 tensors come back as float32 tensors.
Owns the byte layouts of those types and llama.cpp's q/k row order; nothing about models.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from edge_runtime.errors import ModelNotAvailable
from edge_runtime.model.qweights import TENSOR_FIELDS, Blocks

QK_K = 256  # elements of a K-quant super-block
ROW_CHUNK = 4096  # rows converted at once: bounds the unpacked temporaries of a large table


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two bytes per entry (last axis) read as float16 (kept so: de-quantisation widens exactly)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def _nibbles(raw: np.ndarray) -> np.ndarray:
    """Bytes [..., m] -> levels [..., 2m]: the low nibbles first, then the high ones (the order
    of llama.cpp's Q4_0/Q4_1/Q5_x blocks and of each 32-byte run of Q4_K/Q5_K/Q6_K)."""
    return np.concatenate((raw & 0x0F, raw >> 4), axis=-1)


def _pack(levels: np.ndarray) -> np.ndarray:
    """4-bit levels [..., 2m] -> [..., m] bytes, the even element in the low nibble."""
    return levels[..., 0::2] | (levels[..., 1::2] << 4)


# Each converter takes raw blocks [rows, blocks, bytes] and returns `Blocks`' fields as numpy
# arrays (levels uint8, or int8 where signed with zero 0) plus "zero" and "bits".
Fields = dict[str, Any]


def _q4_0(raw: np.ndarray) -> Fields:
    # d f16, 16 bytes of levels; w = d * (q - 8)
    return {"levels": _pack(_nibbles(raw[..., 2:])), "scales": _f16(raw[..., :2]), "zero": 8, "bits": 4}


def _q4_1(raw: np.ndarray) -> Fields:
    # d f16, m f16, 16 bytes of levels; w = d * q + m
    return {"levels": _pack(_nibbles(raw[..., 4:])), "scales": _f16(raw[..., :2]), "offsets": _f16(raw[..., 2:4]),
            "zero": 0, "bits": 4}


def _split(q: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Levels of 5 or 6 bits [..., block] -> (low nibbles packed [..., block / 2], the bits above
    them [..., block * (bits - 4) / 8], element j's at bit (bits - 4) * j), `Blocks`' layout."""
    h = q >> 4
    if bits == 5:
        high = np.packbits(h, axis=-1, bitorder="little")
    else:  # (numpy's bitwise_or.reduce over the last axis: 3x slower than these strided ORs)
        high = h[..., 0::4] | (h[..., 1::4] << 2) | (h[..., 2::4] << 4) | (h[..., 3::4] << 6)
    return _pack(q & 0x0F), high


def _q5_0(raw: np.ndarray) -> Fields:
    # d f16, qh u32, 16 bytes of low nibbles; w = d * (q - 16). qh (bit j: element j's fifth bit)
    # is already the high-bit string `Blocks` keeps.
    return {"levels": _pack(_nibbles(raw[..., 6:])), "high": raw[..., 2:6], "scales": _f16(raw[..., :2]),
            "zero": 16, "bits": 5}


def _q5_1(raw: np.ndarray) -> Fields:
    # d f16, m f16, qh u32, 16 bytes of low nibbles; w = d * q + m
    return {"levels": _pack(_nibbles(raw[..., 8:])), "high": raw[..., 4:8], "scales": _f16(raw[..., :2]),
            "offsets": _f16(raw[..., 2:4]), "zero": 0, "bits": 5}


def _q8_0(raw: np.ndarray) -> Fields:
    # d f16, 32 int8; w = d * q
    return {"levels": np.ascontiguousarray(raw[..., 2:]).view(np.int8), "scales": _f16(raw[..., :2]),
            "zero": 0, "bits": 8}


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's twelve bytes -> eight 6-bit scales and eight 6-bit minimums. Bytes 0-3 hold
    scales 0-3 (low 6 bits) and the top bits of scales 4-7; bytes 4-7 the same for the minimums;
    bytes 8-11 the low 4 bits of scale (low nibble) and minimum (high nibble) 4-7."""
    lo_s, lo_m, mix = raw[..., 0:4], raw[..., 4:8], raw[..., 8:12]
    scales = np.concatenate((lo_s & 0x3F, (mix & 0x0F) | ((lo_s >> 6) << 4)), axis=-1)
    mins = np.concatenate((lo_m & 0x3F, (mix >> 4) | ((lo_m >> 6) << 4)), axis=-1)
    return scales, mins


def _k_runs(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes of low nibbles -> [..., 8, 32]: sub-blocks 2c and 2c+1 are the low
    and high nibbles of bytes 32c..32c+31."""
    runs = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack((runs & 0x0F, runs >> 4), axis=-2).reshape(*qs.shape[:-1], 8, 32)


def _k_fields(raw: np.ndarray, levels: np.ndarray, bits: int) -> Fields:
    """Q4_K/Q5_K: per 32, scale d * sc and offset -dmin * m, kept factored (d, -dmin per
    super-block in float16; sc, m per sub-block in a byte). `levels` [rows, supers, 8, 32]."""
    sc, mn = _k_scales(raw[..., 4:16])
    fields = {"scales": _f16(raw[..., :2]), "scale_steps": _flat_sub(sc), "offsets": -_f16(raw[..., 2:4]),
              "offset_steps": _flat_sub(mn), "zero": 0, "bits": bits}
    if bits == 4:
        return {**fields, "levels": _flat_sub(_pack(levels))}
    low, high = _split(levels, bits)
    return {**fields, "levels": _flat_sub(low), "high": _flat_sub(high)}


def _q4_k(raw: np.ndarray) -> Fields:
    # d f16, dmin f16, 12 bytes of scales/mins, 128 bytes of levels; w = d*sc * q - dmin*m per 32
    return _k_fields(raw, _k_runs(raw[..., 16:]), 4)


def _q5_k(raw: np.ndarray) -> Fields:
    # as Q4_K, with 32 bytes of fifth bits: bit s of byte j is element j of sub-block s
    high = np.unpackbits(raw[..., 16:48][..., None], axis=-1, bitorder="little")  # [..., 32, 8]
    return _k_fields(raw, _k_runs(raw[..., 48:]) | (np.swapaxes(high, -1, -2) << 4), 5)


def _q6_k(raw: np.ndarray) -> Fields:
    # 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d f16; w = d*sc * (q - 32) per 16.
    # Each half of 128 elements: 64 low-nibble bytes (elements 0-63 low, 64-127 high nibbles)
    # and 32 high-bit bytes (bits 2i..2i+1 of byte j for element 32i + j). Put in `Blocks`'
    # order without joining the two (5 passes fewer than `_split` of whole levels).
    rows = raw.shape[0]
    ql = raw[..., :128].reshape(*raw.shape[:-1], 2, 64)
    qh = raw[..., 128:192].reshape(*raw.shape[:-1], 2, 1, 32)
    low = np.concatenate((ql & 0x0F, ql >> 4), axis=-1)  # [..., 2, 128]
    h = ((qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 0x03).reshape(*raw.shape[:-1], 2, 128)
    high = h[..., 0::4] | (h[..., 1::4] << 2) | (h[..., 2::4] << 4) | (h[..., 3::4] << 6)
    return {"levels": _pack(low).reshape(rows, -1, 8), "high": high.reshape(rows, -1, 4),
            "scales": _f16(raw[..., 208:210]),
            "scale_steps": np.ascontiguousarray(raw[..., 192:208]).view(np.int8).reshape(rows, -1),
            "zero": 32, "bits": 6}


def _flat_sub(x: np.ndarray) -> np.ndarray:
    """[rows, super-blocks, sub-blocks, ...] -> [rows, super-blocks * sub-blocks, ...]."""
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


# Type name -> (elements per block, bytes per block, converter).
BLOCK_TYPES: dict[str, tuple[int, int, Callable[[np.ndarray], Fields]]] = {
    "Q4_0": (32, 18, _q4_0), "Q4_1": (32, 20, _q4_1), "Q5_0": (32, 22, _q5_0), "Q5_1": (32, 24, _q5_1),
    "Q8_0": (32, 34, _q8_0), "Q4_K": (QK_K, 144, _q4_k), "Q5_K": (QK_K, 176, _q5_k), "Q6_K": (QK_K, 210, _q6_k),
}
FLOAT_TYPES = ("F32", "F16", "BF16")


def tensor_type(tensor: Any) -> str:
    return tensor.tensor_type.name


def gguf_shape(tensor: Any) -> tuple[int, ...]:
    """A GGUF tensor's shape in torch order (GGUF lists the fastest axis first)."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def read_blocks(tensor: Any) -> Blocks:
    """A 2-D quantised GGUF tensor [N, K] (a gguf `ReaderTensor`, data memory-mapped) as Blocks,
    converted ROW_CHUNK rows at a time."""
    kind = tensor_type(tensor)
    if kind not in BLOCK_TYPES:
        raise ModelNotAvailable(f"GGUF tensor {tensor.name} is {kind}; block types read are "
                                f"{', '.join(BLOCK_TYPES)} (and {', '.join(FLOAT_TYPES)} as floats)")
    shape = gguf_shape(tensor)
    if len(shape) != 2:
        raise ModelNotAvailable(f"GGUF tensor {tensor.name} of shape {shape} is not a matrix")
    n, k = shape
    elems, size, convert = BLOCK_TYPES[kind]
    raw = np.asarray(tensor.data).reshape(n, k // elems, size)
    first = convert(raw[:ROW_CHUNK])
    # Each field is written into its final array chunk by chunk: joining the chunks at the end
    # would hold the tensor twice (a large head's levels: hundreds of MiB more at the peak).
    arrays = {name: np.empty((n, *first[name].shape[1:]), first[name].dtype)
              for name in TENSOR_FIELDS if name in first}
    for lo in range(0, n, ROW_CHUNK):
        chunk = first if lo == 0 else convert(raw[lo:lo + ROW_CHUNK])
        for name, array in arrays.items():
            array[lo:lo + ROW_CHUNK] = chunk[name]
        del chunk
    fields = {name: torch.from_numpy(arrays[name]) if name in arrays else None for name in TENSOR_FIELDS}
    return Blocks(**fields, zero=first["zero"], bits=first["bits"])


def read_float(tensor: Any) -> Tensor:
    """An F32/F16/BF16 GGUF tensor as a float32 torch tensor of its shape (a copy: small
    tensors, norms and the like, or an unquantised table)."""
    kind, shape = tensor_type(tensor), gguf_shape(tensor)
    data = np.asarray(tensor.data)
    if kind == "F32":
        values = data.astype(np.float32)
    elif kind == "F16":
        values = data.astype(np.float32)
    elif kind == "BF16":
        values = (np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        raise ModelNotAvailable(f"GGUF tensor {tensor.name} is {kind}, not a float type")
    return torch.from_numpy(np.ascontiguousarray(values.reshape(shape)))


def release_pages(tensor: Any) -> None:
    """Drop the pages of `tensor`'s bytes from this process's mapping once they are read: a
    mapped file's touched pages count as resident until unmapped, so reading a whole GGUF would
    otherwise add the file's size to the peak. (The kernel keeps them in its page cache.)"""
    import mmap

    base = tensor.data
    while base is not None and not hasattr(base, "_mmap"):
        base = getattr(base, "base", None)
    mapping = getattr(base, "_mmap", None)
    if mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = int(tensor.data_offset) - int(getattr(base, "offset", 0))
    lo = start - start % mmap.PAGESIZE
    hi = start + int(tensor.n_bytes)
    hi = min(len(mapping), hi + (-hi % mmap.PAGESIZE))
    if hi > lo:
        mapping.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def head_order(rows: int, heads: int) -> Tensor:
    """The row order that undoes llama.cpp's converter on a q or k projection of `heads` heads:
    it stores each head's rotary pairs interleaved (rows i, i + d/2 of HF order next to each
    other), for its own RoPE; HF order has the halves. Row h*d + j*d/2 + i of HF order is row
    h*d + 2i + j of the file's. (transformers' GGUF loader reverses it the same way.)"""
    half = rows // heads // 2
    index = torch.arange(rows).reshape(heads, half, 2)
    return index.transpose(1, 2).reshape(-1)


class GgufBlockReader:
    """A GGUF file's tensors by name, each read on request (the file stays memory-mapped).
    `tensors`: those of a header already parsed (`gguf_config.read_header`: parsing a file's
    metadata takes seconds where its vocabulary is large)."""

    def __init__(self, path: str | Path, tensors: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        if tensors is None:
            from gguf import GGUFReader

            try:
                tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
            except (ValueError, OSError) as exc:
                raise ModelNotAvailable(f"{path} is not a readable GGUF file: {exc}") from exc
        self.tensors = tensors

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def _tensor(self, name: str) -> Any:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelNotAvailable(f"{self.path.name} has no tensor {name}") from None

    def is_float(self, name: str) -> bool:
        return tensor_type(self._tensor(name)) in FLOAT_TYPES

    def shape(self, name: str) -> tuple[int, ...]:
        return gguf_shape(self._tensor(name))

    def blocks(self, name: str, heads: int | None = None) -> Blocks:
        """Tensor `name` as Blocks; `heads`: a q/k projection of that many heads, put back in HF
        row order (`head_order`)."""
        tensor = self._tensor(name)
        out = read_blocks(tensor)
        release_pages(tensor)
        return out if heads is None else out.rows(head_order(out.n, heads))

    def float(self, name: str, heads: int | None = None) -> Tensor:
        out = read_float(self._tensor(name))
        return out if heads is None else out[head_order(out.shape[0], heads)]
