"""Float copies of quantised weights held for one bounded piece of work (a layer's recompute
and backward window by window, where LoRA dropout draws: train/staged.py): a weight read several
times in it is de-quantised once, and every copy goes when the piece ends."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

# Most bytes one `holding` keeps (a layer of Llama-3.2-1B is 243 MiB in float32, of 3B 400 MiB;
# an 8B layer's 872 MiB is held only in part: the weights that fit, in the order they are read).
MAX_BYTES = 512 << 20

_LOCAL = threading.local()


class _Held:
    def __init__(self, max_bytes: int) -> None:
        self.floats: dict[tuple[int, torch.dtype], tuple[object, Tensor]] = {}
        self.left = max_bytes
        self.used = 0  # float32 elements of this thread's `arena` given out


@contextmanager
def holding(max_bytes: int = MAX_BYTES) -> Iterator[None]:
    """Within it, on this thread, `held` keeps each weight's float copy (up to `max_bytes` in
    all) for later reads; on exit they are dropped."""
    outer = getattr(_LOCAL, "held", None)
    _LOCAL.held = _Held(max_bytes)
    try:
        yield
    finally:
        _LOCAL.held = outer


@contextmanager
def arena(nbytes: int) -> Iterator[None]:
    """One float32 buffer of `nbytes` that the holdings inside it (one layer after another) write
    their copies into, taken once: a fresh copy per layer cost its first-touch page faults every
    time (about 100 ms per 64 MiB at load 12), more than the de-quantisation it saved."""
    outer = getattr(_LOCAL, "arena", None)
    with torch.inference_mode(False):  # written outside inference mode as well
        _LOCAL.arena = torch.empty(max(0, nbytes) // 4, dtype=torch.float32)
    try:
        yield
    finally:
        _LOCAL.arena = outer


def held(weight: object, shape: torch.Size, dtype: torch.dtype,
         make: Callable[[Tensor | None], Tensor]) -> Tensor | None:
    """`weight`'s float copy [shape] in `dtype` inside a `holding` on this thread: made by
    `make(out)` on the first read (into `out`, a piece of this thread's `arena`, where one has
    room, else None) and kept while the budget allows; None outside a holding, or past the
    budget (the caller then reads the weight its own bounded way)."""
    state = getattr(_LOCAL, "held", None)
    if state is None:
        return None
    key = (id(weight), dtype)
    entry = state.floats.get(key)
    if entry is not None and entry[0] is weight:
        return entry[1]
    numel = shape.numel()
    if numel * dtype.itemsize > state.left:
        return None
    room = getattr(_LOCAL, "arena", None)
    out = None
    if room is not None and dtype == torch.float32 and state.used + numel <= room.numel():
        out = room[state.used:state.used + numel]
        state.used += numel
    w = make(out)
    state.floats[key] = (weight, w)  # the weight kept beside its copy: its id is not reused meanwhile
    state.left -= numel * dtype.itemsize
    return w


def whole(weight: Any, t: Tensor) -> Tensor | None:
    """A quantised weight's whole float copy in `t`'s dtype where a `holding` on this thread
    keeps it (CPU: a GPU reads its blocks in its own kernels); else None."""
    if t.device.type != "cpu" or getattr(_LOCAL, "held", None) is None:
        return None
    return held(weight, weight.shape, t.dtype, lambda out: _dequantize(weight, t.dtype, out))


def _dequantize(weight: Any, dtype: torch.dtype, out: Tensor | None) -> Tensor:
    """The weight [N, K] de-quantised, into `out` (float32, N * K elements) where given: its
    parts are stacked along N, so each fills the next rows."""
    if out is None:
        return weight.dequantize(dtype)
    n, k = weight.shape
    lo = 0
    for part in weight.parts:
        rows = out[lo * k:(lo + part.n) * k]
        w = part.dequantize(dtype, rows)
        if w.data_ptr() != rows.data_ptr():  # torch's passes (no compiled kernel) made their own
            rows.copy_(w.reshape(-1))
        lo += part.n
    return out.view(n, k)


def layer_bytes(model: Any, quant_weight: type) -> int:
    """The most a holding keeps for one layer of `model`: the float bytes of its largest layer's
    weights kept as blocks (`quant_weight`, qweights' QuantWeight, passed in since it imports
    this module: those read through its own products; a GGUF read in place keeps its kernels),
    at most MAX_BYTES."""
    own = quant_weight.linear_forward
    most = max((sum(m.shape.numel() for m in layer.modules()
                    if isinstance(m, quant_weight) and type(m).linear_forward is own) for layer in model.layers),
               default=0)
    return min(MAX_BYTES, most * model.dtype.itemsize)
