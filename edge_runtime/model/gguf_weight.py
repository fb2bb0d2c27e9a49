"""A GGUF matrix kept as the file's own bytes: uint8 [rows, row bytes] views of its memory map
(page-cache pages, shared, clean, never re-encoded), multiplied and de-quantised a bounded row
chunk at a time. The in-place sibling of `QuantWeight`'s re-encoded blocks (`qweights`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from edge_runtime.errors import ModelNotAvailable
from edge_runtime.model import qweights
from edge_runtime.model.gguf_blocks import (
    BLOCK_TYPES,
    FLOAT_TYPES,
    gguf_shape,
    head_order,
    tensor_type,
)
from edge_runtime.model.qweights import TENSOR_FIELDS, Blocks, LinearOp, QuantWeight

_FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
# engine.gguf_activations: how the kernel's products take x. "auto": as llama.cpp's int8 (q8_K for
# the K-quants; gguf_kernel.matmul states the bound) in the serving backends' steps (run under
# torch.inference_mode), float32 elsewhere (training's forward and backward, reference log-probs,
# evaluation); "int8": int8 everywhere; "float": float32 everywhere.
ACTIVATIONS = ("auto", "int8", "float")
_ENV_MODES = {"int8": "int8", "f32": "float", "float": "float", "auto": "auto"}
ACTIVATIONS_ENV = "MACE_GGUF_ACTIVATIONS"  # overrides the setting where set (`activations_mode`)


@cache
def _kernel_module() -> ModuleType | None:
    try:
        return importlib.import_module("edge_runtime.model.gguf_kernel")
    except ImportError:
        return None


def kernel() -> ModuleType | None:
    """`gguf_kernel` where its compiled kernels serve (products read straight from the blocks);
    None otherwise: rows are then de-quantised through `gguf_blocks`' converters and `qkernel`'s
    compiled pass (faster than the kernel module's numpy reference, and bit for bit the same)."""
    module = _kernel_module()
    return module if module is not None and module.available() else None  # available(): enabled and built


def _qtype(name: str) -> Any:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[name]


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of `k` elements in type `qtype`."""
    if qtype in _FLOAT_BYTES:
        return _FLOAT_BYTES[qtype] * k
    elems, size, _ = BLOCK_TYPES[qtype]
    if k % elems:
        raise ModelNotAvailable(f"rows of {k} elements do not split into {qtype} blocks of {elems}")
    return k // elems * size


@dataclass(frozen=True, eq=False)
class RawRows:
    """Rows [n, k] of one GGUF tensor as its bytes: `data` uint8 [n, row_bytes] (a view of the
    file's map, or gathered rows of one). `order`: where the file's row order is not the model's
    (llama.cpp interleaves each q/k head's rotary halves), model row r is file row order[r]."""

    data: Tensor
    qtype: str
    k: int
    order: Tensor | None = None

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_TYPES and self.qtype not in FLOAT_TYPES:
            raise ModelNotAvailable(f"GGUF type {self.qtype} is not read in place "
                                    f"(types read: {', '.join([*BLOCK_TYPES, *FLOAT_TYPES])})")
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or \
                self.data.shape[1] != row_bytes(self.qtype, self.k):
            raise ValueError(f"{self.qtype} rows of {self.k} need uint8 [n, {row_bytes(self.qtype, self.k)}], "
                             f"got {self.data.dtype} {tuple(self.data.shape)}")

    @property
    def n(self) -> int:
        return self.data.shape[0]

    def file_rows(self, lo: int, hi: int) -> RawRows:
        """File rows lo..hi-1 (a view), in the file's order."""
        return RawRows(self.data[lo:hi], self.qtype, self.k)

    def model_rows(self, index: Tensor) -> RawRows:
        """Model rows `index` (their bytes gathered: a copy of that many rows only)."""
        rows = index if self.order is None else self.order[index]
        return RawRows(self.data[rows], self.qtype, self.k)

    def blocks(self) -> Blocks:
        """These rows (file order) re-encoded as `Blocks` (for readers of that format: a graph
        export; serving and training never call it)."""
        elems, size, convert = BLOCK_TYPES[self.qtype]
        fields = convert(self.data.numpy().reshape(self.n, self.k // elems, size))
        return Blocks(**{name: torch.from_numpy(np.ascontiguousarray(fields[name])) if name in fields else None
                         for name in TENSOR_FIELDS}, zero=fields["zero"], bits=fields["bits"])

    def dequantize(self, dtype: torch.dtype = torch.float32, out: Tensor | None = None) -> Tensor:
        """The float rows [n, k] in file order, computed in float32 (into `out`, a float32 buffer
        of at least n * k elements, where given) and cast to `dtype`."""
        n, k = self.n, self.k
        fits = out is not None and out.dtype == torch.float32 and out.numel() >= n * k
        target = out.view(-1)[:n * k].view(n, k) if fits else torch.empty(n, k, dtype=torch.float32)
        if self.qtype in FLOAT_TYPES:
            raw = self.data.view(-1)
            if self.qtype == "F32":
                target.copy_(raw.view(torch.float32).view(n, k))
            elif self.qtype == "F16":
                target.copy_(raw.view(torch.float16).view(n, k))
            else:
                target.copy_(raw.view(torch.bfloat16).view(n, k))
        elif kernel() is not None:
            kernel().dequantize(self.data, _qtype(self.qtype), k, out=target)
        else:
            target = self.blocks().dequantize(torch.float32, target)
        return target if dtype == torch.float32 else target.to(dtype)

    def matmul(self, x: Tensor, int8_x: bool = False) -> Tensor:
        """x @ W^T for x [..., k] -> [..., n] in file row order, in float32: the kernel reads the
        blocks where it is built (with `int8_x`, x quantised to int8 row by row, every row through
        its fused path); else W is de-quantised a row chunk at a time."""
        flat = x.reshape(-1, self.k).float().contiguous()
        lib = kernel()
        if lib is not None and self.qtype in BLOCK_TYPES:
            qtype, step = _qtype(self.qtype), lib.FUSED_MAX_ROWS
            if int8_x and flat.shape[0] > step:
                # A prefill chunk with int8 x: the fused kernel a slab of rows at a time, each row's
                # value that of the same row alone (1B Q4_K 8192x2048, 64 rows, 2 threads, load 5:
                # 9.2 ms against 54 ms for de-quantised tiles and torch's float GEMM).
                out = torch.empty(flat.shape[0], self.n, dtype=torch.float32)
                for lo in range(0, flat.shape[0], step):
                    lib.matmul(flat[lo:lo + step], self.data, qtype, self.k, out=out[lo:lo + step], int8_x=True)
            else:
                out = lib.matmul(flat, self.data, qtype, self.k, int8_x=int8_x)
        else:
            out = torch.cat([torch.nn.functional.linear(flat, rows) for _, rows in self.chunks(torch.float32)], dim=-1)
        return out.view(*x.shape[:-1], self.n)

    def chunks(self, dtype: torch.dtype) -> Iterator[tuple[int, Tensor]]:
        """(first file row, float rows in this thread's workspace) at most CHUNK_ELEMENTS each."""
        step = max(1, qweights.CHUNK_ELEMENTS // self.k)
        for lo in range(0, self.n, step):
            part = self.file_rows(lo, min(self.n, lo + step))
            yield lo, part.dequantize(dtype, qweights.thread_workspace(part.n * self.k))


def activations_mode(setting: str) -> str:
    """The mode in force: MACE_GGUF_ACTIVATIONS (int8, f32/float or auto) where set, else `setting`."""
    if setting not in ACTIVATIONS:
        raise ValueError(f"engine.gguf_activations = {setting!r}: use {', '.join(ACTIVATIONS)}")
    env = os.environ.get(ACTIVATIONS_ENV, "").lower()
    return _ENV_MODES.get(env, setting)


def set_activations(model: nn.Module, setting: str) -> int:
    """Gives every `GgufWeight` of `model` the `engine.gguf_activations` setting; returns how many."""
    activations_mode(setting)  # refuses an unknown setting
    weights = [m for m in model.modules() if isinstance(m, GgufWeight)]
    for weight in weights:
        weight.activations = setting
    return len(weights)


class GgufWeight(QuantWeight):
    """A weight [N, K] as `RawRows` stacked along N (q|k|v of a layer: three tensors of the file,
    perhaps of different types). Its bytes are buffers, so the engine's byte count and the mapped
    pages' bookkeeping (`mapped_weights`) see them; it has no parameters. `activations`: its
    products' `engine.gguf_activations` (set by `set_activations`)."""

    activations = "auto"

    def __init__(self, parts: Sequence[RawRows]) -> None:
        nn.Module.__init__(self)
        if not parts:
            raise ValueError("a GGUF weight needs at least one part")
        if len({p.k for p in parts}) != 1:
            raise ValueError(f"parts of one weight must share K, got {sorted({p.k for p in parts})}")
        self._raw_meta = [(p.qtype, p.k) for p in parts]
        self._names = [(f"raw_{i}", f"order_{i}") for i in range(len(parts))]
        self._cached: tuple[list[Tensor | None], list[RawRows]] | None = None
        for i, part in enumerate(parts):
            self.register_buffer(f"raw_{i}", part.data)
            self.register_buffer(f"order_{i}", part.order)

    @property
    def raw_parts(self) -> list[RawRows]:
        """The parts over the current buffers (built once while the buffers stay the same tensors:
        a decode step asks ~65 times)."""
        buffers = self._buffers
        now = [buffers[name] for pair in self._names for name in pair]
        cached = self._cached
        if cached is None or len(cached[0]) != len(now) or any(a is not b for a, b in zip(cached[0], now, strict=True)):
            parts = [RawRows(now[2 * i], qtype, k, now[2 * i + 1]) for i, (qtype, k) in enumerate(self._raw_meta)]
            self._cached = cached = (now, parts)
        return cached[1]

    def group_plan(self) -> Any:
        """`gguf_kernel.GroupPlan` of this weight (every part's output row at its model column), or
        None where a grouped product does not take it (a part not Q4_K/Q5_K/Q6_K, a width not a
        multiple of 256, no compiled kernels). Built once while the buffers stay the same."""
        parts = self.raw_parts
        cached = self.__dict__.get("_plan")
        if cached is not None and cached[0] is parts:
            return cached[1]
        lib = kernel()
        if lib is None:
            return None
        plan = None
        if parts[0].k % 256 == 0 and all(p.qtype in ("Q4_K", "Q5_K", "Q6_K") for p in parts):
            cols, start = [], 0
            for part in parts:
                where = torch.arange(start, start + part.n)
                cols.append(where if part.order is None else where[torch.argsort(part.order)])
                start += part.n
            plan = lib.GroupPlan([(p.data, _qtype(p.qtype)) for p in parts], parts[0].k, torch.cat(cols))
        self._plan = (parts, plan)
        return plan

    @property
    def parts(self) -> list[Blocks]:
        """The rows re-encoded as `Blocks`, model order (a graph export's reading; a copy)."""
        out = []
        for part in self.raw_parts:
            blocks = part.blocks()
            out.append(blocks if part.order is None else blocks.rows(part.order))
        return out

    @property
    def formats(self) -> list[tuple[int, int]]:
        return [(p.zero, p.bits) for p in self.parts]

    @property
    def qtypes(self) -> list[str]:
        return [qtype for qtype, _ in self._raw_meta]

    @property
    def shape(self) -> torch.Size:
        parts = self.raw_parts
        return torch.Size((sum(p.n for p in parts), parts[0].k))

    @property
    def device(self) -> torch.device:
        return self.raw_0.device

    @property
    def nbytes(self) -> int:
        return sum(p.data.numel() for p in self.raw_parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        rows = []
        for part in self.raw_parts:
            w = part.dequantize(dtype)
            rows.append(w if part.order is None else w[part.order])
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def row_chunks(self) -> Iterator[tuple[int, Blocks]]:
        """(first row, rows as `Blocks`) pieces, model order (re-encoded: readers of `Blocks`)."""
        start = 0
        for part in self.raw_parts:
            step = max(1, qweights.CHUNK_ELEMENTS // part.k)
            for lo in range(0, part.n, step):
                index = torch.arange(lo, min(part.n, lo + step))
                yield start + lo, part.model_rows(index).blocks()
            start += part.n

    def embedding(self, ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """Rows `ids` (any shape) de-quantised from their gathered bytes."""
        flat = ids.reshape(-1)
        out = torch.empty(flat.numel(), self.shape[1], dtype=dtype, device=flat.device)
        start = 0
        for part in self.raw_parts:
            where = ((flat >= start) & (flat < start + part.n)).nonzero().squeeze(-1)
            if where.numel():
                out[where] = part.model_rows(flat[where] - start).dequantize(dtype)
            start += part.n
        return out.reshape(*ids.shape, -1)

    @staticmethod
    def cat(weights: Sequence[QuantWeight]) -> GgufWeight:
        return GgufWeight([p for w in weights for p in w.raw_parts])  # type: ignore[attr-defined]

    def linear_forward(self, x: Tensor, bias: Tensor | None, op: LinearOp) -> Tensor:
        """op(x, W) + bias. The plain linear goes to `RawRows.matmul` (the kernel on the blocks);
        another op (the row-invariant tiles of `engine.deterministic`) gets float row chunks."""
        outs = []
        plain = getattr(op, "__name__", "") in ("_linear", "_float_linear")
        mode = activations_mode(self.activations) if plain else "float"
        int8_x = mode == "int8" or (mode == "auto" and torch.is_inference_mode_enabled())
        for part in self.raw_parts:
            if plain:
                y = part.matmul(x, int8_x).to(x.dtype)
            else:
                pieces = [op(x, rows, None) for _, rows in part.chunks(x.dtype)]
                y = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
            outs.append(y if part.order is None else y.index_select(-1, part.order))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y if bias is None else y + bias

    def input_grad(self, grad: Tensor) -> Tensor:
        """grad @ W, W de-quantised a row chunk at a time into this thread's workspace (the
        gradient's columns put in the file's row order first)."""
        grad_x = None
        start = 0
        for part in self.raw_parts:
            g = grad[..., start:start + part.n]
            if part.order is not None:
                g = g.index_select(-1, torch.argsort(part.order))
            if kernel() is not None and part.qtype in BLOCK_TYPES:
                flat = g.reshape(-1, part.n).float()
                step = kernel().matmul_back(flat, part.data, _qtype(part.qtype), part.k)
                step = step.view(*g.shape[:-1], part.k).to(grad.dtype)
                grad_x = step if grad_x is None else grad_x.add_(step)
            else:
                for lo, rows in part.chunks(grad.dtype):
                    step = g[..., lo:lo + rows.shape[0]].matmul(rows)
                    grad_x = step if grad_x is None else grad_x.add_(step)
            start += part.n
        return grad_x

    def float_chunks(self, dtype: torch.dtype) -> Iterator[tuple[int, Tensor, list[Tensor]]]:
        start = 0
        for part in self.raw_parts:
            step = max(1, qweights.CHUNK_ELEMENTS // part.k)
            for lo in range(0, part.n, step):
                hi = min(part.n, lo + step)
                rows = part.file_rows(lo, hi) if part.order is None else part.model_rows(torch.arange(lo, hi))
                yield start + lo, rows.dequantize(dtype, qweights.thread_workspace(rows.n * part.k)), [rows.data]
            start += part.n

    def extra_repr(self) -> str:
        kinds = ", ".join(f"{p.n} rows {p.qtype}" for p in self.raw_parts)
        return f"[{self.shape[0]}, {self.shape[1]}] in place: {kinds}"


class FileMap:
    """One copy-on-write map of a GGUF file (nothing writes it, so its pages stay the page
    cache's), cut into each tensor's rows."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.data = np.memmap(self.path, dtype=np.uint8, mode="c")

    def rows(self, tensor: Any, heads: int | None = None) -> RawRows:
        """A 2-D GGUF tensor (a gguf `ReaderTensor`) as rows of its bytes; `heads`: a q/k
        projection of that many heads, whose rows the model reads in HF order (`head_order`)."""
        qtype, shape = tensor_type(tensor), gguf_shape(tensor)
        if len(shape) != 2:
            raise ModelNotAvailable(f"GGUF tensor {tensor.name} of shape {shape} is not a matrix")
        n, k = shape
        width = row_bytes(qtype, k)
        start = int(tensor.data_offset)
        view = torch.from_numpy(self.data[start:start + n * width].reshape(n, width))
        return RawRows(view, qtype, k, None if heads is None else head_order(n, heads))
