"""Giving back a mapped file's pages (what the ONNX Runtime backend does with its graph's data
file after the session opens, issue #28): the pages leave this process's resident memory, a
later read gets the same bytes, and a privately written page is never lost."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import pytest

from edge_runtime.model.mapped_weights import page_out_file, resident_bytes

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")


def _resident(path: Path) -> int:
    """Resident bytes of this process's mappings of `path` (smaps)."""
    target, total, current = os.path.realpath(path), 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(None, 5)
        if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:
            current = len(head) == 6 and head[5] == target
        elif current and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def test_a_mapped_files_pages_are_given_back_and_read_again_unchanged(tmp_path):
    path = tmp_path / "model.onnx.data"
    data = os.urandom(8 << 20)
    path.write_bytes(data)
    with open(path, "rb") as fh:
        view = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ | mmap.PROT_WRITE, flags=mmap.MAP_PRIVATE)
    try:
        assert view[:] == data  # every page read, as pre-packing reads them
        view[:4] = b"mine"  # one page now a private copy, which must survive
        assert _resident(path) > 4 << 20  # most of it (the kernel may reclaim some meanwhile)
        assert sum(resident_bytes()) > 0
        assert page_out_file(path) == len(view)
        if _resident(path) > 1 << 20:
            pytest.skip("this kernel ignores MADV_PAGEOUT (Linux < 5.4)")
        assert view[:4] == b"mine" and view[4:] == data[4:]
        assert page_out_file(tmp_path / "not-mapped") == 0
    finally:
        view.close()


def test_the_digest_and_the_export_give_a_block_caches_pages_back(tmp_path, monkeypatch):
    """What the export key's digest and the export read of a block cache leaves resident memory
    before ONNX Runtime packs its own copy (the 8B start had held all of it beside the session)."""
    from edge_runtime.backends.onnx_export import export_step, model_hash
    from edge_runtime.backends.onnx_spec import GraphSpec, weight_format
    from edge_runtime.model import source
    from edge_runtime.model.block_cache import BLOCKS_FILE
    from edge_runtime.model.weights import load_llama
    from tests.model.quant_helpers import Q4_K_M_LIKE, tiny_quant_gguf

    monkeypatch.setenv("MACE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv(source.BLOCKS_ENV, raising=False)
    _, gguf = tiny_quant_gguf(tmp_path, Q4_K_M_LIKE, num_layers=2)
    cached = source.resolve_model(gguf, cache_dir=tmp_path / "cache", progress=False).path
    model = load_llama(cached)
    blocks = cached / BLOCKS_FILE
    digest = model_hash(model)
    assert _resident(blocks) <= 4 * 4096  # the header and the float norms' page or two
    export_step(model, GraphSpec(**weight_format("q4_1")), tmp_path / "onnx", digest)
    assert _resident(blocks) <= 4 * 4096


def test_pages_are_given_back_while_a_block_reads_the_file(tmp_path):
    """`paging_out` (around an ONNX Runtime session open): while the block reads the whole file,
    its resident pages stay well below the file's size, every byte reads right, and none is
    left resident after."""
    from edge_runtime.model.mapped_weights import paging_out

    path = tmp_path / "model.onnx.data"
    size, chunk = 32 << 20, 1 << 20
    data = os.urandom(size)
    path.write_bytes(data)
    with open(path, "rb") as fh:
        view = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
    try:
        assert view[:chunk] == data[:chunk]
        page_out_file(path)
        if _resident(path) > chunk // 2:
            pytest.skip("this kernel ignores MADV_PAGEOUT (Linux < 5.4)")
        with paging_out(path, period_s=0.001):
            for lo in range(0, size, chunk):
                assert view[lo:lo + chunk] == data[lo:lo + chunk]
                # Wait on the state (the thread has given back what was read), never on a time.
                deadline = time.monotonic() + 30
                while _resident(path) > 4 * chunk and time.monotonic() < deadline:
                    time.sleep(0.001)
                assert _resident(path) <= 4 * chunk, f"{_resident(path)} bytes still resident after {lo + chunk} read"
        assert _resident(path) <= 1 << 20
        assert view[:] == data
    finally:
        view.close()


def test_a_used_piece_of_the_head_gives_its_pages_back_only_where_a_graph_serves(tmp_path):
    """`give_back_after_use` (the DPO log-probs call it per head piece): where the model's pages
    are given back after use, a piece's file pages leave this process and read back the same;
    where they are the serving copy (no registration), nothing goes; memory outside the model's
    mapped spans (anonymous) is never dropped."""
    import torch
    from torch import nn

    from edge_runtime.model import mapped_weights
    from edge_runtime.model.mapped_weights import MappedWeights, give_back_after_use

    path = tmp_path / "model.blocks.safetensors"
    data = os.urandom(8 << 20)
    path.write_bytes(data)
    with open(path, "rb") as fh:
        view = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ | mmap.PROT_WRITE, flags=mmap.MAP_PRIVATE)
    try:
        table = torch.frombuffer(view, dtype=torch.uint8)  # the file-mapped "head"
        lo = table.data_ptr()
        mapped = MappedWeights([], [(lo, lo + len(data))])
        model = nn.Linear(1, 1)
        anonymous = torch.arange(1 << 20, dtype=torch.uint8)
        piece = table[2 << 20:6 << 20]
        assert bytes(table.numpy()) == data
        give_back_after_use(model, [piece])  # not registered: the serving copy stays
        assert _resident(path) > 6 << 20
        page_out_file(path)
        if _resident(path) > 1 << 20:
            pytest.skip("this kernel ignores MADV_PAGEOUT (Linux < 5.4)")
        assert bytes(table.numpy()) == data
        mapped_weights._GIVEN_BACK[model] = mapped
        give_back_after_use(model, [piece, anonymous])
        assert _resident(path) <= (4 << 20) + 2 * 4096 and _resident(path) >= (3 << 20)
        assert torch.equal(anonymous, torch.arange(1 << 20, dtype=torch.uint8))
        assert bytes(piece.numpy()) == data[2 << 20:6 << 20]
        del table, piece
    finally:
        view.close()


def test_row_chunks_report_each_quantised_piece_once_its_reader_moved_on(monkeypatch):
    import torch

    from edge_runtime.model import qweights
    from edge_runtime.model.qweights import Blocks, QuantWeight, float_row_chunks

    blocks = Blocks(levels=torch.randint(0, 255, (10, 2, 16), dtype=torch.uint8),
                    scales=torch.rand(10, 2), offsets=None, zero=8, bits=4)
    monkeypatch.setattr(qweights, "CHUNK_ELEMENTS", 3 * blocks.k)
    seen: list[str] = []
    for lo, rows in float_row_chunks(QuantWeight([blocks]), torch.float32,
                                     lambda ts: seen.append(f"used {ts[0].shape[0]}")):
        seen.append(f"read {lo} {rows.shape[0]}")
    assert seen == ["read 0 3", "used 3", "read 3 3", "used 3", "read 6 3", "used 3", "read 9 1", "used 1"]
