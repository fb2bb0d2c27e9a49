"""The C library's heap, where the process's freed memory waits: giving its free pages back
(glibc's `malloc_trim`) and pinning the size from which blocks are mapped (`mallopt`). Both are
no-ops returning False on a C library without them (musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

# glibc raises its mmap threshold to the size of each mapped block it frees (up to 32 MiB): after
# ONNX Runtime's arena first shrinks, its next regions and torch's tensors up to that size come
# from heaps that give back only their top, and stay. Pinned (which ends the raising), blocks from
# this size up are mapped and unmapped as they come and go (#28; docs/onnx.md measures it).
MMAP_THRESHOLD = 8 << 20
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
    mallopt = _glibc("mallopt")
    return mallopt is not None and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
