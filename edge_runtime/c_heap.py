"""The C library's heap, where the process's freed memory waits: giving its free pages back
(glibc's `malloc_trim`), pinning the size from which blocks are mapped (`mallopt`), and lowering
that size while a fine-tune stage runs. No-ops on a C library without them (musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# glibc raises its mmap threshold to the size of each mapped block it frees (up to 32 MiB): after
# ONNX Runtime's arena first shrinks, its next regions and torch's tensors up to that size come
# from heaps that give back only their top, and stay. Pinned (which ends the raising), blocks from
# this size up are mapped and unmapped as they come and go (#28; docs/onnx.md measures it).
MMAP_THRESHOLD = 8 << 20
# While a fine-tune stage runs: its activations (1B: [rows, 2048] and [rows, 8192] floats, 1.6 and
# 6.5 MiB at 208 rows) are mapped and unmapped as they come and go instead of cut from the engine
# thread's heaps, where the holes they left between live blocks stayed resident until the stage
# ended (in process at 1B: the heaps' free bytes at the pair's peak 116 -> 37 MiB, the peak -53
# MiB; the pair's time within the noise, #28).
STAGE_MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc's malloc.h)


@functools.cache
def _glibc(function: str) -> Any:
    """The C library's `function`, or None where it has none."""
    name = ctypes.util.find_library("c")
    try:
        return None if name is None else getattr(ctypes.CDLL(name), function, None)
    except OSError:
        return None


def give_heap_back() -> bool:
    """Return the heap's free pages to the OS (`malloc_trim`); False where there is none."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


@functools.lru_cache(maxsize=1)
def pin_mmap_threshold() -> bool:
    """Pin the mmap threshold at `MMAP_THRESHOLD`, once per process; False where the C library
    has no `mallopt` or refuses."""
    return _set_mmap_threshold(MMAP_THRESHOLD)


def _set_mmap_threshold(size: int) -> bool:
    mallopt = _glibc("mallopt")
    return mallopt is not None and mallopt(_M_MMAP_THRESHOLD, size) == 1


def _pinned() -> bool:
    """Whether `pin_mmap_threshold` pinned it in this process (without calling it)."""
    return pin_mmap_threshold.cache_info().currsize == 1 and pin_mmap_threshold()


@contextmanager
def stage_blocks_mapped() -> Iterator[None]:
    """Blocks from `STAGE_MMAP_THRESHOLD` up are mapped while the block runs, then the pinned
    threshold again. Only where the threshold is pinned (an ONNX Runtime session serves): glibc's
    own rising threshold is left alone elsewhere, since setting one ends it for good."""
    lowered = _pinned() and _set_mmap_threshold(STAGE_MMAP_THRESHOLD)
    try:
        yield
    finally:
        if lowered:
            _set_mmap_threshold(MMAP_THRESHOLD)
