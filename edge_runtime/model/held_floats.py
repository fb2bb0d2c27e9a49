"""Float copies of quantised weights held for one bounded piece of work (a layer's recompute
and backward over every window of a pair): a weight read several times in it is de-quantised
once, and every copy goes when the piece ends."""

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


def held(weight: object, shape: torch.Size, dtype: torch.dtype, make: Callable[[], Tensor]) -> Tensor | None:
    """`weight`'s float copy [shape] in `dtype` inside a `holding` on this thread: made by `make`
    on the first read and kept while the budget allows; None outside one, or past the budget
    (the caller then reads the weight its own bounded way)."""
    state = getattr(_LOCAL, "held", None)
    if state is None:
        return None
    key = (id(weight), dtype)
    entry = state.floats.get(key)
    if entry is not None and entry[0] is weight:
        return entry[1]
    nbytes = shape.numel() * dtype.itemsize
    if nbytes > state.left:
        return None
    w = make()
    state.floats[key] = (weight, w)  # the weight kept beside its copy: its id is not reused meanwhile
    state.left -= nbytes
    return w


def whole(weight: Any, t: Tensor) -> Tensor | None:
    """A quantised weight's whole float copy in `t`'s dtype where a `holding` on this thread
    keeps it (CPU: a GPU reads its blocks in its own kernels); else None."""
    if t.device.type != "cpu" or getattr(_LOCAL, "held", None) is None:
        return None
    return held(weight, weight.shape, t.dtype, lambda: weight.dequantize(t.dtype))
