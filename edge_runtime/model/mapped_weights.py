"""The memory-mapped pages under a model's quantised blocks (a block cache is read through its
file's map, so its blocks are page-cache pages, not memory of the process's own), and giving them
back: while another backend serves, the torch copy is read a layer at a time and dropped after.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from edge_runtime.model.qweights import QuantWeight

if TYPE_CHECKING:
    from torch import nn

    from edge_runtime.model.llama import LlamaModel

log = logging.getLogger(__name__)

_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class Mapping:
    """One read-only file mapping of /proc/self/maps: [start, end) and the file."""

    start: int
    end: int
    path: str


def file_mappings() -> list[Mapping]:
    """The process's mappings of regular files (none where /proc is not there)."""
    out = []
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                parts = line.split(None, 5)
                if len(parts) < 6 or not parts[5].startswith("/"):
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append(Mapping(lo, hi, parts[5].strip()))
    except OSError:
        return []
    return out


def _ranges(tensors: list[torch.Tensor], maps: list[Mapping]) -> list[tuple[int, int]]:
    """Page-aligned [start, end) of each tensor that lies inside a file mapping, merged."""
    spans = []
    for t in tensors:
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        if hi > lo and any(m.start <= lo and hi <= m.end for m in maps):
            spans.append((lo - lo % _PAGE, hi + (-hi % _PAGE)))
    spans.sort()
    merged: list[tuple[int, int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


def _block_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [b for m in module.modules() if isinstance(m, QuantWeight) for b in m.buffers()]


class MappedWeights:
    """The file-mapped pages of a model's blocks, per layer and the rest (embedding, head).
    `release_*` drops them from this process (madvise DONTNEED): clean pages of a file, so the
    next read faults them back from the page cache (or the disk, if the kernel evicted them).
    Nothing writes the base weights, so no page of theirs is ever a private copy to lose."""

    def __init__(self, layers: list[list[tuple[int, int]]], rest: list[tuple[int, int]]) -> None:
        self.layers = layers
        self.rest = rest
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.releases = 0

    @classmethod
    def of(cls, model: LlamaModel) -> MappedWeights | None:
        """The model's mapped block pages; None when no block lies in a file mapping (a float
        model, blocks read into memory, or no /proc)."""
        if os.name != "posix":
            return None
        maps = file_mappings()
        if not maps:
            return None
        layers = [_ranges(_block_tensors(layer), maps) for layer in model.layers]
        in_layers = {id(b) for layer in model.layers for b in _block_tensors(layer)}
        rest = _ranges([b for b in _block_tensors(model) if id(b) not in in_layers], maps)
        if not rest and not any(layers):
            return None
        return cls(layers, rest)

    @property
    def nbytes(self) -> int:
        """Bytes of the mapped pages (what a full pass reads back)."""
        return sum(hi - lo for span in [*self.layers, self.rest] for lo, hi in span)

    @property
    def peak_resident_bytes(self) -> int:
        """The most a pass that releases each layer after use keeps resident: the largest layer,
        the one after it, and the embedding and head."""
        sizes = sorted((sum(hi - lo for lo, hi in span) for span in self.layers), reverse=True)
        return sum(sizes[:2]) + sum(hi - lo for lo, hi in self.rest)

    def _drop(self, spans: list[tuple[int, int]]) -> None:
        for lo, hi in spans:
            if self._libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED) != 0:
                err = ctypes.get_errno()
                log.debug("madvise(DONTNEED) of %d bytes failed: %s", hi - lo, os.strerror(err))

    def release_layer(self, index: int) -> None:
        self._drop(self.layers[index])

    def release_all(self) -> None:
        for spans in self.layers:
            self._drop(spans)
        self._drop(self.rest)
        self.releases += 1

    def release_after_each_layer(self, model: LlamaModel) -> list:
        """Hooks that drop each layer's pages once its forward has run, and, in training, once
        its backward has (when the gradient of its input arrives). Returns the handles."""
        handles = []
        for i, layer in enumerate(model.layers):
            def after_forward(module: nn.Module, args: tuple, output: object, i: int = i) -> None:
                self.release_layer(i)

            def before_forward(module: nn.Module, args: tuple, i: int = i) -> None:
                x = args[0] if args else None
                if isinstance(x, torch.Tensor) and x.requires_grad:
                    x.register_hook(lambda grad, i=i: self._after_backward(i, grad))

            handles.append(layer.register_forward_hook(after_forward))
            handles.append(layer.register_forward_pre_hook(before_forward))
        return handles

    def _after_backward(self, index: int, grad: torch.Tensor) -> None:
        self.release_layer(index)


# Models whose mapped block pages are given back after use (read a layer at a time), and theirs.
_GIVEN_BACK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def give_back_after_use(model: LlamaModel, tensors: list[torch.Tensor]) -> None:
    """Drops the pages of `tensors` (views of the model's blocks outside its layers: a piece of
    the embedding table or the head) where the model's pages are given back after use; nothing
    where they are its serving copy (torch serves) or not mapped at all. Only pages inside the
    model's own file-mapped spans are dropped (never anonymous memory)."""
    mapped = _GIVEN_BACK.get(model)
    if mapped is None:
        return
    spans = []
    for t in tensors:
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        lo, hi = lo - lo % _PAGE, hi + (-hi % _PAGE)
        if hi > lo and any(a <= lo and hi <= b for a, b in mapped.rest):
            spans.append((lo, hi))
    mapped._drop(spans)


def read_per_layer(model: LlamaModel) -> tuple[MappedWeights, list] | None:
    """Before a backend is chosen: the self-check's torch reference reads the mapped blocks a
    layer at a time, so they never sit resident beside a graph's own copy. Returns the pages
    and the hooks (for `serving_elsewhere`), None when no block is mapped."""
    mapped = MappedWeights.of(model)
    if mapped is None:
        return None
    mapped.release_all()
    _GIVEN_BACK[model] = mapped
    return mapped, mapped.release_after_each_layer(model)


def serving_elsewhere(per_layer: tuple[MappedWeights, list] | None, runs_onnx_weights: bool) -> MappedWeights | None:
    """Where a backend with weights of its own serves (ONNX Runtime's pre-packed graph), the
    model's mapped blocks are read only by training and the publish guard: their pages stay
    given back and are read a layer at a time. Where torch serves, they are its only copy: the
    hooks go and the pages stay. None: nothing is given back."""
    if per_layer is None:
        return None
    mapped, hooks = per_layer
    if not runs_onnx_weights:
        for hook in hooks:
            hook.remove()
        for model in [m for m, v in _GIVEN_BACK.items() if v is mapped]:
            del _GIVEN_BACK[model]
        return None
    mapped.release_all()
    log.info("the torch copy of the weights (%.0f MiB of mapped blocks) is read a layer at a time while "
             "the graph serves: at most %.0f MiB of it resident", mapped.nbytes / 2**20,
             mapped.peak_resident_bytes / 2**20)
    return mapped


def resident_bytes() -> tuple[int, int]:
    """This process's resident memory now, (RssAnon, RssFile) in bytes; zeros where /proc cannot say."""
    try:
        with open("/proc/self/status") as fh:
            fields = dict(line.split(":", 1) for line in fh if line.startswith(("RssAnon", "RssFile")))
    except OSError:
        return 0, 0
    return tuple(int(fields.get(k, "0 kB").split()[0]) * 1024 for k in ("RssAnon", "RssFile"))  # type: ignore[return-value]


_MADV_PAGEOUT = 21  # Linux 5.4+: reclaim now; a private page it cannot write back is left alone


def page_out_file(path: str | os.PathLike) -> int:
    """Gives back this process's resident pages of every mapping of `path` (ONNX Runtime maps a
    graph's external data and reads all of it to pre-pack the weights; the pages its kernels no
    longer read stay resident beside the packed copy until reclaimed). PAGEOUT rather than
    DONTNEED: a page another library wrote privately is never dropped, only clean file pages,
    which a later read faults back. Returns the bytes advised (0 where nothing is mapped or the
    kernel refuses the advice)."""
    target = os.path.realpath(path)
    libc = ctypes.CDLL(None, use_errno=True)
    advised = 0
    for m in file_mappings():
        if m.path == target and libc.madvise(ctypes.c_void_p(m.start), ctypes.c_size_t(m.end - m.start),
                                             _MADV_PAGEOUT) == 0:
            advised += m.end - m.start
    return advised


@contextmanager
def paging_out(path: str | os.PathLike, period_s: float = 0.05) -> Iterator[None]:
    """While the block runs, `page_out_file(path)` every `period_s` on a thread, and once more at
    the end. ONNX Runtime reads a graph's whole data file while it pre-packs the weights at a
    session open: given back only afterwards, the file's pages peak at its size (1.1 GB at 1B)
    beside the packed copy being built; given back as it reads, they stay near what one period
    reads. Only clean file pages go, so a page the open still needs faults back in."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(period_s):
            page_out_file(path)

    thread = threading.Thread(target=run, name="page-out", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        page_out_file(path)
