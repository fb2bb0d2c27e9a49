"""Triton kernels over `Blocks` (model/qweights.py) in GPU memory: y = x @ W^T for a few rows read
straight from the stored levels and scales, and de-quantisation into a float buffer (prefill,
training's backward, embedding rows). Imported only where a quantised weight sits on CUDA.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import Tensor

try:  # Triton ships with CUDA builds of torch; elsewhere the torch path serves
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - depends on the installation
    triton = tl = None
    _IMPORT_ERROR: str | None = f"triton is not importable ({exc})"
else:
    _IMPORT_ERROR = None

log = logging.getLogger(__name__)

# Rows of x up to which the matmul kernel reads the blocks itself. Below it a step is bound by
# the weight's bytes (a row-at-a-time GEMM reads the 4-bit blocks once, where de-quantising
# first writes and reads a float copy 4-8x their size); above it the tensor-core GEMM's compute
# on a de-quantised chunk wins. 16 is also the kernel's tile of rows (one `tl.dot` M tile), so
# every decode batch up to 16 streams is a single pass over the weight. (The kernel computes any
# number of rows, a 16-row tile per program row of its grid: the threshold is this constant.)
MAX_ROWS = 16

_broken: str | None = None  # why the kernels were switched off after a failure, once logged


def unavailable() -> str | None:
    """Why the kernels cannot run here (None = they can)."""
    return _IMPORT_ERROR or _broken


def disable(why: str) -> None:
    """Turn the kernels off for this process (the torch path serves), saying why once."""
    global _broken
    if _broken is None:
        log.warning("quantised-weight GPU kernels off, de-quantising with torch instead: %s", why)
        _broken = why


def supported(part: Any) -> str | None:
    """Why these kernels cannot read `part` (a `Blocks`), or None."""
    block = part.block
    if block & (block - 1) or not 4 <= block <= 256:
        return f"block of {block} elements (a power of two from 4 to 256 is read)"
    for name, t in part.fields().items():
        if t is not None and t.dim() > 1 and not _rows_contiguous(t):
            return f"{name} is not contiguous within its rows"
    return None


def _rows_contiguous(t: Tensor) -> bool:
    """Each row's elements lie together in order (a row slice or gather of a contiguous tensor)."""
    expected = 1
    for size, stride in reversed(list(zip(t.shape[1:], t.stride()[1:], strict=True))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


if triton is not None:

    @triton.jit
    def _per_block(base_ptr, steps_ptr, rows, blks, mask, s_base, s_steps,
                   GROUP: tl.constexpr, HAS_STEPS: tl.constexpr):
        """float32 [R, NB]: a per-block scale (or offset), times its step for factored formats
        (the same float32 product as `qweights._per_block`)."""
        v = tl.load(base_ptr + rows[:, None] * s_base + blks[None, :] // GROUP, mask=mask, other=0).to(tl.float32)
        if HAS_STEPS:
            v = v * tl.load(steps_ptr + rows[:, None] * s_steps + blks[None, :], mask=mask, other=0).to(tl.float32)
        return v

    @triton.jit
    def _level(low, high_ptr, rows, blks, i, mask, s_high,
               PARITY: tl.constexpr, BITS: tl.constexpr, HW: tl.constexpr):
        """int32 [R, NB, W]: the 4 low bits `low` of elements 2i + PARITY of each block, with
        their bits above four read from `high` (element j's at bit (BITS - 4) * j of the block)."""
        if BITS > 4:
            bit = (2 * i + PARITY) * (BITS - 4)
            h = tl.load(high_ptr + rows[:, None, None] * s_high + blks[None, :, None] * HW + bit // 8,
                        mask=mask, other=0).to(tl.int32)
            low = low | (((h >> (bit % 8)) & ((1 << (BITS - 4)) - 1)) << 4)
        return low

    @triton.jit
    def _tile(lev_ptr, high_ptr, sc_ptr, scs_ptr, off_ptr, offs_ptr, rows, blks, rmask, bmask,
              s_lev, s_high, s_sc, s_scs, s_off, s_offs,
              BITS: tl.constexpr, W: tl.constexpr, HW: tl.constexpr, ZERO: tl.constexpr,
              SC_GROUP: tl.constexpr, HAS_SCS: tl.constexpr, HAS_OFF: tl.constexpr,
              OFF_GROUP: tl.constexpr, HAS_OFFS: tl.constexpr):
        """The de-quantised values of rows x blocks, float32 [R, NB, W] twice: elements 2i and
        2i + 1 of each block (8 bits: element i, the same tile twice). Each value is
        (level - zero) * scale + offset in float32, as `Blocks.dequantize_torch` computes it."""
        mask2 = rmask[:, None] & bmask[None, :]
        mask3 = mask2[:, :, None]
        i = tl.arange(0, W)[None, None, :]
        raw = tl.load(lev_ptr + rows[:, None, None] * s_lev + blks[None, :, None] * W + i,
                      mask=mask3, other=0).to(tl.int32)
        scale = _per_block(sc_ptr, scs_ptr, rows, blks, mask2, s_sc, s_scs, SC_GROUP, HAS_SCS)[:, :, None]
        if BITS == 8:
            v0 = (raw - ZERO).to(tl.float32) * scale
            if HAS_OFF:
                v0 = v0 + _per_block(off_ptr, offs_ptr, rows, blks, mask2, s_off, s_offs, OFF_GROUP,
                                     HAS_OFFS)[:, :, None]
            v1 = v0
        else:
            q0 = _level(raw & 15, high_ptr, rows, blks, i, mask3, s_high, 0, BITS, HW)
            q1 = _level(raw >> 4, high_ptr, rows, blks, i, mask3, s_high, 1, BITS, HW)
            v0 = (q0 - ZERO).to(tl.float32) * scale
            v1 = (q1 - ZERO).to(tl.float32) * scale
            if HAS_OFF:
                offset = _per_block(off_ptr, offs_ptr, rows, blks, mask2, s_off, s_offs, OFF_GROUP,
                                    HAS_OFFS)[:, :, None]
                v0 = v0 + offset
                v1 = v1 + offset
        return v0, v1

    @triton.jit
    def _dot(acc, x, w, F32_DOT: tl.constexpr, EMULATE_HALF_DOT: tl.constexpr):
        """acc + x @ w^T: float32 rows in float32; half-precision rows on the tensor cores with w's
        float32 values rounded to x's dtype (or that rounding, then a float32 dot: the interpreter)."""
        if F32_DOT:
            acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
        elif EMULATE_HALF_DOT:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(x.dtype).to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        return acc

    # M (rows) is not specialised: every decode batch of 1 to 16 rows runs one compiled kernel, so a
    # CUDA-graph capture at a new batch size never compiles (Triton would otherwise build M == 1
    # and M % 16 == 0 apart).
    @triton.jit(do_not_specialize=["M", "N"])
    def _matmul_kernel(x_ptr, out_ptr, bias_ptr, lev_ptr, high_ptr, sc_ptr, scs_ptr, off_ptr, offs_ptr,
                       M, N, s_xm, s_om, s_lev, s_high, s_sc, s_scs, s_off, s_offs,
                       NB: tl.constexpr, SPLIT_BLOCKS: tl.constexpr, PARTIAL: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr, HW: tl.constexpr, ZERO: tl.constexpr,
                       SC_GROUP: tl.constexpr, HAS_SCS: tl.constexpr, HAS_OFF: tl.constexpr,
                       OFF_GROUP: tl.constexpr, HAS_OFFS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NBT: tl.constexpr,
                       F32_DOT: tl.constexpr, EMULATE_HALF_DOT: tl.constexpr):
        """out[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]) for BLOCK_N rows of W per program,
        walking its SPLIT_BLOCKS of K's NB blocks (program_id(2) says which) NBT at a time; float32
        sums. PARTIAL: K is split over programs, each writes its float32 sums to out[split]
        (`_sum_kernel` adds them in order: no atomics, the same result every run). NB and
        SPLIT_BLOCKS are constants: one compilation per K of a model (a handful), and loop bounds
        the interpreter can read. BLOCK_M == 1: a GEMV in float32 on the CUDA cores; else one `tl.dot` per tile in x's dtype (W's values rounded to it, as the
        de-quantise-then-GEMM path rounds them). EMULATE_HALF_DOT: the same roundings, summed by a
        float32 dot (Triton's interpreter multiplies bfloat16 tiles' bit patterns as integers)."""
        PER: tl.constexpr = 1 if BITS == 8 else 2
        BLOCK: tl.constexpr = W * PER
        rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        rmask = rows < N
        m0 = tl.program_id(1) * BLOCK_M
        if BLOCK_M == 1:
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            ms = m0 + tl.arange(0, BLOCK_M)
            t = tl.arange(0, NBT * W)
        for j in range(0, SPLIT_BLOCKS, NBT):
            blk0 = tl.program_id(2) * SPLIT_BLOCKS + j
            blks = blk0 + tl.arange(0, NBT)
            bmask = blks < NB
            v0, v1 = _tile(lev_ptr, high_ptr, sc_ptr, scs_ptr, off_ptr, offs_ptr, rows, blks, rmask, bmask,
                           s_lev, s_high, s_sc, s_scs, s_off, s_offs, BITS, W, HW, ZERO,
                           SC_GROUP, HAS_SCS, HAS_OFF, OFF_GROUP, HAS_OFFS)
            if BLOCK_M == 1:
                k = blks[:, None] * BLOCK + PER * tl.arange(0, W)[None, :]
                x0 = tl.load(x_ptr + m0 * s_xm + k, mask=bmask[:, None], other=0).to(tl.float32)
                acc += tl.sum(tl.sum(v0 * x0[None, :, :], axis=2), axis=1)
                if PER == 2:
                    x1 = tl.load(x_ptr + m0 * s_xm + k + 1, mask=bmask[:, None], other=0).to(tl.float32)
                    acc += tl.sum(tl.sum(v1 * x1[None, :, :], axis=2), axis=1)
            else:
                k = (blk0 + t // W) * BLOCK + PER * (t % W)
                xmask = (ms[:, None] < M) & ((blk0 + t // W) < NB)[None, :]
                x0 = tl.load(x_ptr + ms[:, None] * s_xm + k[None, :], mask=xmask, other=0)
                w0 = tl.reshape(v0, (BLOCK_N, NBT * W))
                acc = _dot(acc, x0, w0, F32_DOT, EMULATE_HALF_DOT)
                if PER == 2:
                    x1 = tl.load(x_ptr + ms[:, None] * s_xm + k[None, :] + 1, mask=xmask, other=0)
                    w1 = tl.reshape(v1, (BLOCK_N, NBT * W))
                    acc = _dot(acc, x1, w1, F32_DOT, EMULATE_HALF_DOT)
        if PARTIAL:
            out_ptr += tl.program_id(2).to(tl.int64) * M * s_om
        elif HAS_BIAS:
            b = tl.load(bias_ptr + rows, mask=rmask, other=0).to(tl.float32)
            if BLOCK_M == 1:
                acc += b
            else:
                acc += b[None, :]
        if BLOCK_M == 1:
            tl.store(out_ptr + m0 * s_om + rows, acc.to(out_ptr.dtype.element_ty), mask=rmask)
        else:
            omask = (ms[:, None] < M) & rmask[None, :]
            tl.store(out_ptr + ms[:, None] * s_om + rows[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)

    @triton.jit(do_not_specialize=["M", "N"])
    def _sum_kernel(part_ptr, out_ptr, bias_ptr, M, N, s_om, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK: tl.constexpr):
        """out[m, n] = sum over s of part[s, m, n] in order of s (+ bias[n]), in out's dtype."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < M * N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc += tl.load(part_ptr + s * M * N + i, mask=mask, other=0)
        n = i % N
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=mask, other=0).to(tl.float32)
        tl.store(out_ptr + (i // N) * s_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _dequant_kernel(out_ptr, index_ptr, lev_ptr, high_ptr, sc_ptr, scs_ptr, off_ptr, offs_ptr,
                        R, NB, s_out, s_lev, s_high, s_sc, s_scs, s_off, s_offs,
                        BITS: tl.constexpr, W: tl.constexpr, HW: tl.constexpr, ZERO: tl.constexpr,
                        SC_GROUP: tl.constexpr, HAS_SCS: tl.constexpr, HAS_OFF: tl.constexpr,
                        OFF_GROUP: tl.constexpr, HAS_OFFS: tl.constexpr, HAS_INDEX: tl.constexpr,
                        BLOCK_R: tl.constexpr, NBT: tl.constexpr):
        """out[r] = the de-quantised row r of the blocks (row index[r] where an index is given),
        in out's dtype: BLOCK_R rows x NBT blocks per program."""
        PER: tl.constexpr = 1 if BITS == 8 else 2
        BLOCK: tl.constexpr = W * PER
        r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        rmask = r < R
        if HAS_INDEX:
            rows = tl.load(index_ptr + r, mask=rmask, other=0).to(tl.int64)
        else:
            rows = r
        blks = tl.program_id(1) * NBT + tl.arange(0, NBT)
        bmask = blks < NB
        v0, v1 = _tile(lev_ptr, high_ptr, sc_ptr, scs_ptr, off_ptr, offs_ptr, rows, blks, rmask, bmask,
                       s_lev, s_high, s_sc, s_scs, s_off, s_offs, BITS, W, HW, ZERO,
                       SC_GROUP, HAS_SCS, HAS_OFF, OFF_GROUP, HAS_OFFS)
        k = blks[None, :, None] * BLOCK + PER * tl.arange(0, W)[None, None, :]
        where = out_ptr + r[:, None, None] * s_out + k
        mask = rmask[:, None, None] & bmask[None, :, None]
        tl.store(where, v0.to(out_ptr.dtype.element_ty), mask=mask)
        if PER == 2:
            tl.store(where + 1, v1.to(out_ptr.dtype.element_ty), mask=mask)


def _format_args(part: Any) -> tuple[list[Any], list[int], dict[str, Any]]:
    """The stored tensors (absent ones replaced by the levels: never read), their row strides and
    the format's constexprs, as both kernels take them."""
    levels = part.levels
    tensors = [levels, part.high, part.scales, part.scale_steps, part.offsets, part.offset_steps]
    ptrs = [levels if t is None else t for t in tensors]
    strides = [t.stride(0) for t in ptrs]
    blocks = levels.shape[1]
    meta = dict(BITS=part.bits, W=levels.shape[2], HW=1 if part.high is None else part.high.shape[2],
                ZERO=part.zero, SC_GROUP=blocks // part.scales.shape[1], HAS_SCS=part.scale_steps is not None,
                HAS_OFF=part.offsets is not None,
                OFF_GROUP=1 if part.offsets is None else blocks // part.offsets.shape[1],
                HAS_OFFS=part.offset_steps is not None)
    return ptrs, strides, meta


def _blocks_per_tile(part: Any, elements: int) -> int:
    """Whole blocks per K tile: `elements` of K (a power of two), at least one block."""
    return max(1, elements // part.block)


# A kernel launch: the kernel, its grid, its runtime arguments (in the kernel's order, before its
# constants) and its constants. Built apart from running so a test can compile exactly what would
# run for a GPU target on a machine with none (`triton.compile`).
Launch = tuple[Any, tuple[int, ...], tuple[Any, ...], dict[str, Any]]
NUM_WARPS = 4


def matmul_into(x: Tensor, part: Any, out: Tensor, bias: Tensor | None = None, split: int | None = None,
                gemv: bool | None = None) -> None:
    """out[m, :] = x[m] @ W^T (+ bias) for a `Blocks` part W [n, k] and x [M, k] (M <= MAX_ROWS,
    rows contiguous), out [M, n] with unit column stride (a column slice of a wider output).
    `split`: K split over that many programs per output tile (None: by the shape, `_split`).
    `gemv`: a single row through the float32 GEMV rather than the `tl.dot` tile (None: float32
    rows only; a half-precision row then rounds differently alone than among others)."""
    for kernel, grid, args, consts in matmul_launches(x, part, out, bias, split, gemv=gemv):
        kernel[grid](*args, **consts, num_warps=NUM_WARPS)


def matmul_launches(x: Tensor, part: Any, out: Tensor, bias: Tensor | None = None, split: int | None = None,
                    interpreted: bool | None = None, gemv: bool | None = None) -> list[Launch]:
    """What `matmul_into` launches (allocating the partial sums' buffer of a split K).
    `interpreted`: tiles for Triton's interpreter (default: x on the CPU)."""
    n, blocks = part.levels.shape[:2]
    rows = x.shape[0]
    interpreted = x.device.type == "cpu" if interpreted is None else interpreted
    gemv = rows == 1 and (x.dtype == torch.float32 if gemv is None else gemv)
    ptrs, strides, meta = _format_args(part)
    if interpreted:  # Triton's interpreter (tests): few, large programs run fastest
        block_m, block_n, tile = (1 if gemv else 16), 64, 256
    elif gemv:
        # A GEMV: enough programs to keep every SM's memory pipe busy (small N: 8 rows each).
        block_m, block_n, tile = 1, 8 if n <= 4096 else 16, 256
    else:
        block_m, block_n, tile = 16, 16 if n <= 8192 else 32, 128
    nbt = _blocks_per_tile(part, tile)
    tiles = triton.cdiv(n, block_n) * triton.cdiv(rows, block_m)
    k_tiles = triton.cdiv(blocks, nbt)
    split = min(k_tiles, split or _split(tiles, k_tiles, x.device))
    split_blocks = triton.cdiv(k_tiles, split) * nbt
    split = triton.cdiv(blocks, split_blocks)  # no split left without blocks
    # The partial sums of a split K: [split, rows, n] float32, added in order by `_sum_kernel`.
    target = out if split == 1 else torch.empty(split, rows, n, dtype=torch.float32, device=x.device)
    dummy = out if bias is None else bias
    launches: list[Launch] = [(
        _matmul_kernel, (triton.cdiv(n, block_n), triton.cdiv(rows, block_m), split),
        (x, target, dummy, *ptrs, rows, n, x.stride(0), target.stride(-2), *strides),
        dict(NB=blocks, SPLIT_BLOCKS=split_blocks, PARTIAL=split > 1, **meta, HAS_BIAS=bias is not None,
             BLOCK_M=block_m, BLOCK_N=block_n, NBT=nbt, F32_DOT=x.dtype == torch.float32,
             EMULATE_HALF_DOT=interpreted))]
    if split > 1:
        launches.append((_sum_kernel, (triton.cdiv(rows * n, 1024),), (target, out, dummy, rows, n, out.stride(0)),
                         dict(SPLIT=split, HAS_BIAS=bias is not None, BLOCK=1024)))
    return launches


# Programs per SM a matmul aims for: a decode GEMM is bound by the weight's bytes, and each
# program keeps only a few K tiles of loads in flight, so small N splits K to fill the GPU.
PROGRAMS_PER_SM = 4


def _split(tiles: int, k_tiles: int, device: torch.device) -> int:
    """How many programs share each output tile's K: doubled while the grid is short of
    PROGRAMS_PER_SM per SM and each program keeps at least two K tiles."""
    if device.type != "cuda":
        return 1
    want = PROGRAMS_PER_SM * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    split = 1
    while tiles * split < want and k_tiles >= 4 * split:
        split *= 2
    return split


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def dequantize(part: Any, dtype: torch.dtype, index: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """The float rows [R, k] of a `Blocks` part in `dtype` (all rows, or rows `index`: a 1-D
    integer tensor on the part's device, each in range), the same values as `Blocks.dequantize`;
    written into `out` (a buffer of `dtype` with enough elements) where given."""
    count = part.n if index is None else index.numel()
    if out is not None and out.dtype == dtype and out.numel() >= count * part.k:
        out = out.view(-1)[: count * part.k].view(count, part.k)
    else:
        out = torch.empty(count, part.k, dtype=dtype, device=part.levels.device)
    if count == 0:
        return out
    kernel, grid, args, consts = dequantize_launch(part, out, index)
    kernel[grid](*args, **consts, num_warps=NUM_WARPS)
    return out


def dequantize_launch(part: Any, out: Tensor, index: Tensor | None = None, interpreted: bool | None = None) -> Launch:
    """What `dequantize` launches to fill `out` [R, k] (R = the part's rows, or index's)."""
    blocks = part.levels.shape[1]
    interpreted = out.device.type == "cpu" if interpreted is None else interpreted
    ptrs, strides, meta = _format_args(part)
    block_r, nbt = (64, _blocks_per_tile(part, 1024)) if interpreted else (16, _blocks_per_tile(part, 256))
    grid = (triton.cdiv(out.shape[0], block_r), triton.cdiv(blocks, nbt))
    return (_dequant_kernel, grid, (out, out if index is None else index, *ptrs, out.shape[0], blocks, out.stride(0),
                                    *strides),
            dict(**meta, HAS_INDEX=index is not None, BLOCK_R=block_r, NBT=nbt))


def linear(parts: list[Any], x: Tensor, bias: Tensor | None) -> Tensor | None:
    """x @ W^T (+ bias) for W the `Blocks` parts stacked along N, x [..., k] of at most MAX_ROWS
    rows; None where these kernels do not compute it (more rows, a format or dtype they do not
    read, a failure: said once), and the caller de-quantises instead. Half-precision rows all
    take the `tl.dot` tile, so a row's value does not depend on how many rows share the call."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not 0 < rows <= MAX_ROWS or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    why = next((w for w in map(supported, parts) if w is not None), None)
    if why is not None:
        _say_once(f"a weight the kernels do not read ({why}): de-quantised per call instead")
        return None
    x2 = x.reshape(rows, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = sum(p.n for p in parts)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if bias is not None:
        bias = bias.contiguous()
    try:
        lo = 0
        for part in parts:
            matmul_into(x2, part, out[:, lo:lo + part.n], None if bias is None else bias[lo:lo + part.n])
            lo += part.n
    except Exception as exc:  # noqa: BLE001 - a compiler's or driver's error of any type: torch serves
        disable(f"the matmul over {n}x{k} blocks: {exc!r}")
        return None
    return out.view(*x.shape[:-1], n)


_said: set[str] = set()


def _say_once(what: str) -> None:
    if what not in _said:
        _said.add(what)
        log.info("%s", what)

