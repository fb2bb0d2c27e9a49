"""A llama GGUF given as the model is cached as its quantised blocks (no float32 conversion at any
point), reloads as the same blocks, and serves through `Engine.load(file.gguf)` what the float
path serves; ${MACE_GGUF_BLOCKS} and the architecture choose the path."""

from __future__ import annotations

import json

import pytest
import torch

from edge_runtime import Engine
from edge_runtime.model import source
from edge_runtime.model.block_cache import BLOCKS_FILE
from edge_runtime.model.dense import dense_logits
from edge_runtime.model.gguf_load import load_llama_gguf
from edge_runtime.model.qweights import QuantWeight
from edge_runtime.model.testing import make_tiny_gguf, make_tiny_model_dir
from edge_runtime.model.weights import load_llama
from tests.engine.helpers import engine_logits_for
from tests.model.quant_helpers import Q4_K_M_LIKE, private_cache, tiny_quant_gguf  # noqa: F401 (autouse fixture)


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    return tiny_quant_gguf(tmp_path_factory.mktemp("q4km"), Q4_K_M_LIKE)


def _no_conversion(*_args, **_kwargs):
    raise AssertionError("a llama GGUF must not be converted to float32")


def test_llama_gguf_is_cached_as_blocks_and_reloads_as_them(q4km, tmp_path, monkeypatch):
    _, path = q4km
    monkeypatch.setattr(source, "convert_gguf", _no_conversion)
    resolved = source.resolve_model(path, cache_dir=tmp_path / "c", progress=False)
    manifest = json.loads((resolved.path / source.MANIFEST_NAME).read_text())
    assert manifest["format"] == source.BLOCKS_FORMAT == 4 and manifest["weights"] == "blocks"
    assert BLOCKS_FILE in manifest["files"] and "model.safetensors" not in manifest["files"]
    cached = load_llama(resolved.path)
    direct = load_llama_gguf(path)
    assert isinstance(cached.layers[0].qkv_weight, QuantWeight) and cached.quantized
    want = direct.state_dict()
    got = cached.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    ids = torch.randint(3, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    assert torch.equal(dense_logits(cached, ids), dense_logits(direct, ids))
    # The cache holds what is served: about the blocks' bytes, far below a float32 copy.
    blocks_bytes = (resolved.path / BLOCKS_FILE).stat().st_size
    float_bytes = 4 * sum(p.numel() for p in load_llama_gguf(path).parameters()) + 4 * sum(
        m.shape.numel() for m in direct.modules() if isinstance(m, QuantWeight))
    assert blocks_bytes < 0.3 * float_bytes
    # A second resolve uses the cache as it is.
    again = source.resolve_model(path, cache_dir=tmp_path / "c", progress=False, verify=True)
    assert again.path == resolved.path and not again.converted


def test_a_cache_of_the_byte_per_level_layout_is_rebuilt_not_misread(q4km, tmp_path, monkeypatch):
    from safetensors import safe_open

    _, path = q4km
    resolved = source.resolve_model(path, cache_dir=tmp_path / "c", progress=False)
    manifest_path = resolved.path / source.MANIFEST_NAME
    with safe_open(str(resolved.path / BLOCKS_FILE), framework="pt") as f:
        assert f.metadata()["format"] == "mace-blocks-3"
        assert any(key.startswith("layers.0.qkv_weight.high_") for key in f.keys())  # Q6_K attn_v, packed
    manifest = json.loads(manifest_path.read_text())
    manifest["format"] = 3  # what the release before packed 5/6-bit levels wrote
    manifest_path.write_text(json.dumps(manifest))
    again = source.resolve_model(path, cache_dir=tmp_path / "c", progress=False)
    assert again.converted and json.loads(manifest_path.read_text())["format"] == source.BLOCKS_FORMAT


def test_engine_serves_the_blocks_as_the_float_path_serves_the_same_file(q4km, tmp_path, monkeypatch):
    _, path = q4km
    settings = dict(dtype="float32", kv_cache_bytes=4 << 20, block_size=4, max_batched_tokens=8)
    engine = Engine.load(str(path), **settings)
    assert engine.model.quantized
    monkeypatch.setenv(source.BLOCKS_ENV, "off")
    monkeypatch.setenv("MACE_CACHE_DIR", str(tmp_path / "float-cache"))
    floats = Engine.load(str(path), **settings)
    assert not floats.model.quantized
    prompt = torch.randint(3, 300, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    ours, ours_ids = engine_logits_for(engine, prompt, steps=5)
    want, want_ids = engine_logits_for(floats, prompt, steps=5)
    assert ours_ids == want_ids
    torch.testing.assert_close(ours, want, rtol=0, atol=1e-5)


def test_setting_and_architecture_choose_the_path(tmp_path, monkeypatch):
    llama = make_tiny_model_dir(tmp_path / "llama")
    qwen = make_tiny_model_dir(tmp_path / "qwen", model_type="qwen2")
    (tmp_path / "g").mkdir()
    llama_gguf = make_tiny_gguf(llama, tmp_path / "g" / "llama.gguf")
    qwen_gguf = make_tiny_gguf(qwen, tmp_path / "g" / "qwen.gguf")

    def weights(gguf, cache):
        resolved = source.resolve_model(gguf, cache_dir=tmp_path / cache, progress=False)
        return json.loads((resolved.path / source.MANIFEST_NAME).read_text())["weights"]

    assert weights(qwen_gguf, "a") == "float32"  # other architectures keep the converting path
    assert weights(llama_gguf, "a") == "blocks"
    monkeypatch.setenv(source.BLOCKS_ENV, "off")
    assert weights(llama_gguf, "b") == "float32"
    monkeypatch.setenv(source.BLOCKS_ENV, "sometimes")
    with pytest.raises(source.ModelNotAvailable, match="auto, all or off"):
        weights(llama_gguf, "c")


def test_the_default_model_keeps_its_float_cache_unless_asked(tmp_path, monkeypatch):
    header_reads = []
    monkeypatch.setattr(source.gguf_config, "read_header", lambda p: header_reads.append(p))
    assert source._keeps_blocks(tmp_path / "x.gguf", source.DEFAULT_NAME) is None and not header_reads


def test_onnx_export_reads_the_blocks(q4km, tmp_path):
    pytest.importorskip("onnxruntime")
    _, path = q4km
    settings = dict(dtype="float32", kv_cache_bytes=4 << 20, block_size=4, max_batched_tokens=8)
    torch_engine = Engine.load(str(path), **settings)
    onnx_engine = Engine.load(str(path), backend="onnxruntime", onnx_quantization="none",
                              onnx_cache_dir=str(tmp_path / "onnx"), **settings)
    assert onnx_engine.model.quantized and onnx_engine.backend.name == "onnxruntime"
    prompt = torch.randint(3, 300, (7,), generator=torch.Generator().manual_seed(4)).tolist()
    ours, ours_ids = engine_logits_for(onnx_engine, prompt, steps=4)
    want, want_ids = engine_logits_for(torch_engine, prompt, steps=4)
    assert ours_ids == want_ids
    torch.testing.assert_close(ours, want, rtol=0, atol=1e-3)
