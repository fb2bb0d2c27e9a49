"""While a fine-tune stage runs, glibc maps blocks from 1 MiB up (its activations), then the
pinned 8 MiB threshold again; where nothing pinned it, the threshold is never touched (#28)."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from edge_runtime import c_heap
from edge_runtime.train import staged
from tests.fresh_process import in_fresh_process


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mapped_bytes_of_a_malloc(size: int) -> int:
    """How much glibc's mapped total grows while a block of `size` is held."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(size)
    try:
        return libc.mallinfo2().hblkhd - before
    finally:
        libc.free(ctypes.c_void_p(block))


def check_a_stage_maps_its_large_blocks() -> None:
    """In a fresh interpreter (the threshold is the process's): pinned, a 2 MiB block comes from
    the heap; inside a stage it is mapped; after the stage, from the heap again."""
    assert c_heap.pin_mmap_threshold()
    size = 2 << 20
    assert _mapped_bytes_of_a_malloc(size) == 0
    seen: list[int] = []
    stage = staged.Stage(staged.StageKind.FORWARD, "s", lambda: None, lambda: seen.append(_mapped_bytes_of_a_malloc(size)))
    stage.run()
    assert seen and seen[0] >= size
    assert _mapped_bytes_of_a_malloc(size) == 0


def test_a_stage_maps_its_large_blocks_where_the_threshold_is_pinned() -> None:
    if c_heap._glibc("mallopt") is None or c_heap._glibc("mallinfo2") is None:
        pytest.skip("no glibc mallopt/mallinfo2 here")
    in_fresh_process("tests.train.test_stage_blocks_mapped", "check_a_stage_maps_its_large_blocks")


def test_nothing_pinned_leaves_the_threshold_alone(monkeypatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(c_heap, "_set_mmap_threshold", lambda size: calls.append(size) or True)
    monkeypatch.setattr(c_heap, "_pinned", lambda: False)
    with c_heap.stage_blocks_mapped():
        pass
    assert calls == []
    monkeypatch.setattr(c_heap, "_pinned", lambda: True)
    with pytest.raises(RuntimeError), c_heap.stage_blocks_mapped():
        raise RuntimeError("a failed stage")
    assert calls == [c_heap.STAGE_MMAP_THRESHOLD, c_heap.MMAP_THRESHOLD]  # restored even so
