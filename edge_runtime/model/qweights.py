"""Linear weights kept as quantised blocks and de-quantised on use: the one copy of a model's
matrices that serving and training both read.

A weight [N, K] (nn.Linear layout) is one or more `Blocks` stacked along N. Each `Blocks` has
one format: per row, blocks of `block` elements along K, each `scale * (level - zero)`, plus a
float `offset` per block where the format has one. That holds llama.cpp's Q4_0, Q4_1, Q4_K
(4-bit levels), Q5_0, Q5_1, Q5_K (5-bit), Q6_K (6-bit) and Q8_0 (8-bit levels) exactly, in
about the file's own bytes: every product of a level and a scale is exact in float32, so the
one rounding left is the offset's add, the same as llama.cpp's own de-quantisation (tests
compare bit for bit).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor, nn

from edge_runtime.model import held_floats, qkernel


@dataclass(frozen=True, eq=False)
class Blocks:
    """Rows of one block format. `levels`: [n, k / block, block] bytes for 8 bits, uint8, or int8
    for signed levels (zero 0: Q8_0 keeps its signed byte, which saves de-quantisation a pass), or
    uint8 [n, k / block, block / 2] for 4, 5 and 6 bits: the low four bits of each level, two to a
    byte with the even element in the low nibble (`MatMulNBits`' packing, so a graph can take
    4-bit levels as they are). 5 and 6 bits: `high`, uint8 [n, k / block, block * (bits - 4) / 8],
    holds the bits above those four, element j's at bit (bits - 4) * j of the block's bytes read
    as one little-endian bit string (Q5_0/Q5_1's own `qh`). `scales`, `offsets`: float16 or
    float32 [n, k / block]; `offsets` None = none (symmetric formats). Factored (K-quants): with
    `scale_steps` (uint8 or int8 [n, k / block]), `scales` is [n, k / block / group], one per
    group of blocks, and block j's scale is `scales[j // group] * scale_steps[j]` (llama.cpp's
    d * sc, exact in float32); the same for `offsets` with `offset_steps`. That keeps a Q4_K
    block in 4.6 bits a weight instead of 6, a Q6_K one in the file's 6.56."""

    levels: Tensor
    scales: Tensor
    offsets: Tensor | None
    zero: int
    bits: int
    scale_steps: Tensor | None = None
    offset_steps: Tensor | None = None
    high: Tensor | None = None

    def __post_init__(self) -> None:
        if self.bits not in (4, 5, 6, 8):
            raise ValueError(f"levels of {self.bits} bits: only 4, 5, 6 (packed) and 8 are stored")
        signed = self.levels.dtype == torch.int8 and self.bits == 8 and self.zero == 0
        if not (self.levels.dtype == torch.uint8 or signed) or self.levels.dim() != 3:
            raise ValueError(f"levels must be uint8 (or, 8-bit with zero 0, int8) [n, blocks, bytes], got "
                             f"{self.levels.dtype} {tuple(self.levels.shape)} of {self.bits} bits, zero {self.zero}")
        if self.bits in (5, 6):
            want = (*self.levels.shape[:2], self.levels.shape[2] * 2 * (self.bits - 4) // 8)
            if self.high is None or self.high.dtype != torch.uint8 or tuple(self.high.shape) != want \
                    or self.levels.shape[2] * 2 * (self.bits - 4) % 8:
                raise ValueError(f"{self.bits}-bit levels need uint8 high bits {want}, got "
                                 f"{None if self.high is None else (self.high.dtype, tuple(self.high.shape))}")
        elif self.high is not None:
            raise ValueError(f"high bits with {self.bits}-bit levels")
        for name, base, steps in (("scales", self.scales, self.scale_steps),
                                  ("offsets", self.offsets, self.offset_steps)):
            if base is None:
                if steps is not None:
                    raise ValueError(f"{name} steps without {name}")
                continue
            shape = tuple(self.levels.shape[:2])
            if steps is not None:
                if tuple(steps.shape) != shape or base.dim() != 2 or base.shape[0] != shape[0] \
                        or base.shape[1] == 0 or shape[1] % base.shape[1]:
                    raise ValueError(f"{name} {tuple(base.shape)} x steps {tuple(steps.shape)} do not match "
                                     f"levels {tuple(self.levels.shape)}")
            elif tuple(base.shape) != shape:
                raise ValueError(f"{name} {tuple(base.shape)} do not match levels {tuple(self.levels.shape)}")

    @property
    def n(self) -> int:
        return self.levels.shape[0]

    @property
    def block(self) -> int:
        return self.levels.shape[2] * (1 if self.bits == 8 else 2)

    @property
    def k(self) -> int:
        return self.levels.shape[1] * self.block

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def fields(self) -> dict[str, Tensor | None]:
        """The tensors by name (None where absent), in the order caches store them."""
        return {name: getattr(self, name) for name in TENSOR_FIELDS}

    def tensors(self) -> list[Tensor]:
        return [t for t in self.fields().values() if t is not None]

    def _layout(self) -> tuple:
        return (self.bits, self.block, self.zero, self.k) + tuple(
            None if t is None else (t.dtype, t.shape[1]) for t in self.fields().values())

    def same_format(self, other: Blocks) -> bool:
        """Whether `other` can be stored in the same tensors (concatenated along N)."""
        return self._layout() == other._layout()

    def _map(self, fn: Callable[[Tensor], Tensor]) -> Blocks:
        """The same blocks with `fn` applied to every tensor (all indexed by row)."""
        return Blocks(**{name: None if t is None else fn(t) for name, t in self.fields().items()},
                      zero=self.zero, bits=self.bits)

    def scale_per_block(self) -> Tensor:
        return _per_block(self.scales, self.scale_steps)

    def offset_per_block(self) -> Tensor | None:
        return None if self.offsets is None else _per_block(self.offsets, self.offset_steps)

    def unpacked(self) -> Tensor:
        """The integer levels, [n, k / block, block] (uint8, or int8 for signed ones)."""
        if self.bits == 8:
            return self.levels
        packed = self.levels
        q = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:2], -1)
        return q if self.high is None else q.bitwise_or_(self._high_levels().mul_(16))

    def _high_levels(self) -> Tensor:
        """uint8 [n, k / block, block]: each element's bits above the low four."""
        hb = self.bits - 4
        shifts = torch.arange(0, 8, hb, dtype=torch.uint8, device=self.high.device)
        return ((self.high.unsqueeze(-1) >> shifts) & ((1 << hb) - 1)).reshape(*self.high.shape[:2], -1)

    def bytewise(self) -> Blocks:
        """These blocks with a byte per level (8 bits: as they are): 5- and 6-bit levels with a
        zero as signed `q - zero` (Q5_0, Q6_K), without one as uint8 (Q5_1, Q5_K). The same
        weights; for readers that take whole bytes (the ONNX graph's 8-bit `MatMulNBits`)."""
        if self.bits == 8:
            return self
        q = self.unpacked()
        zero = self.zero
        if self.bits != 4 and zero and -128 <= -zero and (1 << self.bits) - zero <= 128:
            q, zero = (q.to(torch.int16) - zero).to(torch.int8), 0
        fields = {**self.fields(), "levels": q, "high": None}
        return Blocks(**fields, zero=zero, bits=8)

    def dequantize(self, dtype: torch.dtype = torch.float32, out: Tensor | None = None) -> Tensor:
        """The float weight [n, k], computed in float32 (exact as above) and cast to `dtype`.
        On CPU one pass of the compiled `qkernel` (bit for bit the same as torch's passes, and
        several times faster); on CUDA one Triton kernel writing `dtype` (`qweights_cuda`: the same
        values); else `dequantize_torch`. `out`: a float32 buffer of at least n * k elements the
        CPU kernel may write into (a transient weight then costs no fresh allocation)."""
        n, blocks, width = self.levels.shape
        kernels = gpu_kernels(self.levels)
        if kernels is not None and kernels.supported(self) is None:
            try:
                into = out if out is not None and out.device == self.levels.device and out.dtype == dtype else None
                return kernels.dequantize(self, dtype, out=into)
            except Exception as exc:  # noqa: BLE001 - a compiler's or driver's error of any type: torch serves
                kernels.disable(f"de-quantising {n}x{self.k} {self.bits}-bit blocks: {exc!r}")
        if qkernel.available(self.levels):
            fits = out is not None and out.dtype == torch.float32 and out.numel() >= n * self.k
            q = out.view(-1)[:n * self.k].view(n, blocks, self.block) if fits \
                else torch.empty(n, blocks, self.block, dtype=torch.float32)
            qkernel.dequantize_into(q, self.levels, self.scale_per_block(), self.offset_per_block(), self.zero,
                                    self.bits, self.high)
            w = q.view(n, self.k)
            return w if dtype == torch.float32 else w.to(dtype)
        return self.dequantize_torch(dtype)

    def dequantize_torch(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """`dequantize` in torch's own passes: the reference the compiled kernel must equal, and the
        path on GPUs and wherever the kernel cannot be built. Written in place into one float
        buffer (4x faster than a chain of new tensors here). (`scale * q - scale * zero` would save
        the subtraction's pass and give the same numbers, but +0 where llama.cpp has -0.)"""
        n, blocks, width = self.levels.shape
        if self.bits == 4:
            q = torch.empty(n, blocks, width, 2, dtype=torch.float32, device=self.levels.device)
            q[..., 0] = self.levels & 0x0F
            q[..., 1] = self.levels >> 4
            q = q.view(n, blocks, 2 * width)
        elif self.high is not None:
            q = self.unpacked()
            if self.zero:  # q - zero in the byte (it fits: Q5_0, Q6_K) saves a float pass; same values
                q = q.view(torch.int8).sub_(self.zero)
            q = q.to(torch.float32)
        else:
            q = self.levels.to(torch.float32)
        if self.zero and self.high is None:
            q.sub_(float(self.zero))
        q.mul_(self.scale_per_block().unsqueeze(-1))
        offsets = self.offset_per_block()
        if offsets is not None:
            q.add_(offsets.unsqueeze(-1))
        w = q.view(n, self.k)
        return w if dtype == torch.float32 else w.to(dtype)

    def rows(self, index: Tensor) -> Blocks:
        """Rows `index` of these blocks (a row permutation, or an embedding's gather)."""
        return self._map(lambda t: t[index])

    def slice(self, lo: int, hi: int) -> Blocks:
        """Rows lo..hi-1 (views, no copy)."""
        return self._map(lambda t: t[lo:hi])

    def to(self, device: torch.device | str) -> Blocks:
        return self._map(lambda t: t.to(device))

    @staticmethod
    def cat(parts: Sequence[Blocks]) -> Blocks:
        """Parts of one format stacked along N, in one set of tensors."""
        first = parts[0]
        if not all(first.same_format(p) for p in parts):
            raise ValueError("only blocks of one format concatenate into one Blocks")
        fields = {name: None if t is None else torch.cat([p.fields()[name] for p in parts])
                  for name, t in first.fields().items()}
        return Blocks(**fields, zero=first.zero, bits=first.bits)


def _per_block(base: Tensor, steps: Tensor | None) -> Tensor:
    """float32 [n, blocks] from a per-block tensor, or a per-group one times per-block steps."""
    if steps is None:
        return base.float()
    if steps.dtype in (torch.uint8, torch.int8) and qkernel.available(steps):
        return qkernel.per_block(base, steps)
    n, groups = base.shape
    # Broadcast rather than repeat_interleave: the same products, and no host sync on CUDA (a
    # decode step there is captured in a CUDA graph).
    return (base.float().unsqueeze(-1) * steps.float().view(n, groups, -1)).view(n, -1)


TENSOR_FIELDS = ("levels", "high", "scales", "offsets", "scale_steps", "offset_steps")
# Most float elements one de-quantised piece holds at once (a 128k-row head is read in row chunks):
# 32 MiB of float32, each thread's workspace for good (2^24: 32 MiB more; 2^22: 18% slower, #28).
CHUNK_ELEMENTS = 1 << 23


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
            for name, tensor in part.fields().items():
                self.register_buffer(f"{name}_{i}", tensor)

    @property
    def parts(self) -> list[Blocks]:
        return [Blocks(**{name: getattr(self, f"{name}_{i}") for name in TENSOR_FIELDS}, zero=zero, bits=bits)
                for i, (zero, bits) in enumerate(self._meta)]

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
        if flat.device.type != "cpu" or gpu_kernels(flat) is not None:
            return self._device_embedding(flat, dtype).reshape(*ids.shape, -1)
        out = torch.empty(flat.numel(), self.shape[1], dtype=dtype, device=flat.device)
        start = 0
        for part in self.parts:
            inside = (flat >= start) & (flat < start + part.n)
            where = inside.nonzero().squeeze(-1)
            if where.numel():
                out[where] = part.rows(flat[where] - start).dequantize(dtype)
            start += part.n
        return out.reshape(*ids.shape, -1)

    def _device_embedding(self, flat: Tensor, dtype: torch.dtype) -> Tensor:
        """`embedding` off the CPU with no host sync (capturable in a CUDA graph): each part
        reads every id clamped into its rows, and a `where` keeps the rows that are its own."""
        kernels = gpu_kernels(flat)
        out = None
        start = 0
        for part in self.parts:
            local = (flat - start).clamp_(0, part.n - 1)
            rows = None
            if kernels is not None and kernels.supported(part) is None:
                try:
                    rows = kernels.dequantize(part, dtype, local)
                except Exception as exc:  # noqa: BLE001 - as in `Blocks.dequantize`: torch serves
                    kernels.disable(f"embedding rows of {part.bits}-bit blocks: {exc!r}")
            if rows is None:
                rows = part.rows(local).dequantize_torch(dtype)
            if out is None:
                out = rows
            else:
                inside = ((flat >= start) & (flat < start + part.n)).unsqueeze(-1)
                out = torch.where(inside, rows, out)
            start += part.n
        return out

    @staticmethod
    def cat(weights: Sequence[QuantWeight]) -> QuantWeight:
        return QuantWeight([p for w in weights for p in w.parts])

    # What `quant_linear` and `float_row_chunks` ask of a quantised weight; a sibling kept in
    # another form (`gguf_weight.GgufWeight`: the file's own bytes) answers them its own way.
    def linear_forward(self, x: Tensor, bias: Tensor | None, op: LinearOp) -> Tensor:
        """op(x, W, bias), W de-quantised a row chunk at a time into this thread's workspace. On
        CUDA the plain linear of a few rows reads the blocks in a Triton kernel (`qweights_cuda`)."""
        kernels = gpu_kernels(x)
        if kernels is not None and getattr(op, "__name__", "") in PLAIN_OPS:
            y = kernels.linear(self.parts, x, bias)
            if y is not None:
                return y
        whole = held_floats.whole(self, x)
        if whole is not None:
            return op(x, whole, bias)
        outs = [op(x, part.dequantize(x.dtype, _workspace(part, x.dtype)), None if bias is None else bias[lo:lo + part.n])
                for lo, part in self.row_chunks()]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def input_grad(self, grad: Tensor) -> Tensor:
        """grad @ W (the gradient w.r.t. a linear's input), W read a row chunk at a time."""
        whole = held_floats.whole(self, grad)
        if whole is not None:
            return grad.matmul(whole)
        grad_x = None
        for lo, part in self.row_chunks():
            step = grad[..., lo:lo + part.n].matmul(part.dequantize(grad.dtype, _workspace(part, grad.dtype)))
            grad_x = step if grad_x is None else grad_x.add_(step)
        return grad_x

    def float_chunks(self, dtype: torch.dtype) -> Iterator[tuple[int, Tensor, list[Tensor]]]:
        """(first row, float rows in this thread's workspace, the stored tensors they came from)."""
        for lo, part in self.row_chunks():
            yield lo, part.dequantize(dtype, _workspace(part, dtype)), part.tensors()

    def extra_repr(self) -> str:
        kinds = ", ".join(f"{p.n} rows {p.bits}-bit/{p.block}{'+offset' if p.offsets is not None else ''}"
                          for p in self.parts)
        return f"[{self.shape[0]}, {self.shape[1]}]: {kinds}"


def _linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return torch.nn.functional.linear(x, w, b)


# The ops that are x @ W^T + b and nothing more (llama's `_float_linear`, this `_linear`), which
# the GPU kernel may compute instead; another (the row-invariant tiles) keeps its own GEMM.
PLAIN_OPS = ("_linear", "_float_linear")


def gpu_kernels(t: Tensor) -> ModuleType | None:
    """`qweights_cuda` where `t` is on CUDA and its kernels can run, else None (CPU: `qkernel`)."""
    if t.device.type != "cuda":
        return None
    from edge_runtime.model import qweights_cuda

    why = qweights_cuda.unavailable()
    if why is None:
        return qweights_cuda
    qweights_cuda.disable(why)  # says why once (no Triton here: torch's passes serve)
    return None


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
        grad_x = ctx.weight.input_grad(grad) if ctx.needs_input_grad[0] else None
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_b, None


_WORKSPACES = threading.local()


def _workspace(part: Blocks, dtype: torch.dtype) -> Tensor | None:
    """This thread's float32 buffer for a transient de-quantised weight, grown to the largest
    piece seen (at most CHUNK_ELEMENTS: 32 MiB). A fresh buffer per call cost more than the
    de-quantisation itself on large weights (measured: first-touch page faults of a 64 MiB
    buffer about 100 ms, the kernel's pass into a reused one 47 ms, at load 12). Only the
    callers below use it, and each drops the weight before its next call on this thread.
    On a GPU a buffer in `dtype` the Triton kernel writes into: a fresh piece per call kept two
    alive at once while a reader still held the last (the LM head's log-probs: 64 of a scoring
    stage's 109 MiB at the 1B shape on an H200); none while a CUDA graph is being captured (the
    graph would keep a buffer that may later be replaced)."""
    device = part.levels.device
    if device.type == "cuda":
        if gpu_kernels(part.levels) is None or torch.cuda.is_current_stream_capturing():
            return None
        return _device_workspace(device, dtype, part.n * part.k)
    if device.type != "cpu" or not qkernel.available(part.levels):
        return None
    return thread_workspace(part.n * part.k)


def _device_workspace(device: torch.device, dtype: torch.dtype, need: int) -> Tensor:
    buffers = getattr(_WORKSPACES, "device", None)
    if buffers is None:
        buffers = _WORKSPACES.device = {}
    buf = buffers.get((device, dtype))
    if buf is None or buf.numel() < need:
        buffers.pop((device, dtype), None)  # the old one goes back before the larger is taken
        with torch.inference_mode(False):
            buf = buffers[(device, dtype)] = torch.empty(need, dtype=dtype, device=device)
    return buf


def thread_workspace(need: int) -> Tensor:
    """This thread's float32 workspace (above), at least `need` elements."""
    buf = getattr(_WORKSPACES, "buffer", None)
    if buf is None or buf.numel() < need:
        # A normal tensor even when first taken under inference mode (a served step): an
        # inference tensor could not be written later outside it (training, a test's forward).
        with torch.inference_mode(False):
            buf = _WORKSPACES.buffer = torch.empty(need, dtype=torch.float32)
    return buf


def _forward(x: Tensor, weight: QuantWeight, bias: Tensor | None, op: LinearOp) -> Tensor:
    return weight.linear_forward(x, bias, op)


def float_row_chunks(weight: Tensor | QuantWeight, dtype: torch.dtype,
                     used: Callable[[list[Tensor]], None] | None = None) -> Iterator[tuple[int, Tensor]]:
    """(first row, float rows) of a weight [N, K], at most CHUNK_ELEMENTS elements each, in order:
    a quantised weight's pieces de-quantised into this thread's workspace (so each is valid only
    until the next is taken), a float weight's row slices (views). For readers that reduce over
    N a piece at a time (the LM head's log-probs) and so never need the whole [rows, N] output.
    `used`: called with a quantised piece's tensors once the reader has taken the next piece."""
    if isinstance(weight, QuantWeight):
        for lo, rows, tensors in weight.float_chunks(dtype):
            yield lo, rows
            if used is not None:
                used(tensors)
        return
    step = max(1, CHUNK_ELEMENTS // weight.shape[1])
    for lo in range(0, weight.shape[0], step):
        yield lo, weight[lo:lo + step].to(dtype)


def quant_linear(x: Tensor, weight: QuantWeight, bias: Tensor | None = None, op: LinearOp = _linear) -> Tensor:
    """`op(x, W, bias)` (F.linear by default) over a quantised weight, de-quantised for this call
    only, CHUNK_ELEMENTS of it at a time."""
    if not torch.is_grad_enabled() or not (x.requires_grad or (bias is not None and bias.requires_grad)):
        return _forward(x, weight, bias, op)
    return _QuantLinear.apply(x, weight, bias, op)
