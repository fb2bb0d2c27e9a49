"""One copy of a GGUF's weights resident: the block cache's blocks are pages of its file's map;
while ONNX Runtime serves, the engine gives them back and the torch copy is read a layer at a
time (training, the self-check's reference), with the same logits as when resident."""

from __future__ import annotations

import pytest
import torch

from edge_runtime.model import source
from edge_runtime.model.block_cache import BLOCKS_FILE
from edge_runtime.model.dense import dense_logits
from edge_runtime.model.mapped_weights import MappedWeights
from edge_runtime.model.weights import load_llama
from tests.model.quant_helpers import Q4_K_M_LIKE, private_cache, tiny_quant_gguf  # noqa: F401 (autouse fixture)


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    root = tmp_path_factory.mktemp("mapped")
    _, path = tiny_quant_gguf(root, Q4_K_M_LIKE, num_layers=3)
    return source.resolve_model(path, cache_dir=root / "cache", progress=False).path


def mapped_rss(path) -> int:
    """Resident bytes of this process's mappings of `path` (smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                inside = len(head) >= 6 and head[5] == str(path)
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def test_blocks_are_file_pages_given_back_and_read_again_alike(cached):
    model = load_llama(cached)
    mapped = MappedWeights.of(model)
    assert mapped is not None and len(mapped.layers) == 3 and all(mapped.layers)
    file = cached / BLOCKS_FILE
    assert 0 < mapped.nbytes <= file.stat().st_size + 4 * 4096 * (len(mapped.layers) + 1)
    ids = torch.randint(3, 300, (1, 7), generator=torch.Generator().manual_seed(0))
    want = dense_logits(model, ids)
    before = mapped_rss(file)
    assert before >= mapped.nbytes - 2 * 4096 * (len(mapped.layers) + 1)
    mapped.release_all()
    assert mapped_rss(file) <= 4 * 4096  # the header and the float norms' page or two
    assert torch.equal(dense_logits(model, ids), want)  # faulted back from the page cache, bit for bit


def test_per_layer_release_keeps_only_the_rest_resident_after_a_pass(cached):
    model = load_llama(cached)
    mapped = MappedWeights.of(model)
    ids = torch.randint(3, 300, (1, 7), generator=torch.Generator().manual_seed(1))
    want = dense_logits(model, ids)
    mapped.release_all()
    handles = mapped.release_after_each_layer(model)
    try:
        assert torch.equal(dense_logits(model, ids), want)
        rest = sum(hi - lo for lo, hi in mapped.rest)
        # The embedding's rows and the head are read after the layers; each layer went back but
        # for the neighbours the kernel maps around a fault (up to 64 KiB: a tiny model's layer
        # is a few hundred KiB, a real one's a hundred MiB).
        assert mapped_rss(cached / BLOCKS_FILE) <= rest + (mapped.nbytes - rest) / 2
        assert mapped.peak_resident_bytes < mapped.nbytes
    finally:
        for handle in handles:
            handle.remove()


def test_a_float_model_has_no_mapped_blocks(tiny_model_dir):
    assert MappedWeights.of(load_llama(tiny_model_dir)) is None


def test_the_engine_gives_the_pages_back_where_a_graph_serves_and_keeps_them_where_torch_does(cached, tmp_path):
    pytest.importorskip("onnxruntime")
    from edge_runtime import Engine
    from edge_runtime.memory import MemoryKind
    from edge_runtime.sizing import resident_weights_bytes, weights_bytes

    settings = dict(dtype="float32", kv_cache_bytes=4 << 20, block_size=4, max_batched_tokens=8, cost_profile="off")
    onnx = Engine.load(str(cached), backend="onnxruntime", onnx_quantization="q4_1",
                       onnx_cache_dir=str(tmp_path / "onnx"), **settings)
    assert onnx.mapped is not None
    model_entry = onnx.ledger.entries(MemoryKind.WEIGHTS)["model"]
    assert model_entry == resident_weights_bytes(onnx.model, onnx.mapped) < weights_bytes(onnx.model)
    assert all(layer._forward_hooks for layer in onnx.model.layers)
    plain = Engine.load(str(cached), backend="torch", **settings)
    assert plain.mapped is None and not any(layer._forward_hooks for layer in plain.model.layers)
    assert plain.ledger.entries(MemoryKind.WEIGHTS)["model"] == weights_bytes(plain.model)
