"""A loaded model's weights digest (the ONNX export key) is hashed once per set of files and
dtype, then remembered: a cached start reads no weight to find its graph (#28)."""

from __future__ import annotations

import os

import pytest

from edge_runtime.backends import onnx_export
from edge_runtime.config import EngineConfig
from edge_runtime.loading import load_model


@pytest.fixture()
def hashed(monkeypatch) -> list[str]:
    """Each time the weights are actually read and hashed, by dtype."""
    calls: list[str] = []
    real = onnx_export._hash_weights

    def counting(model):
        calls.append(str(model.dtype))
        return real(model)

    monkeypatch.setattr(onnx_export, "_hash_weights", counting)
    return calls


def load(model_dir, tmp_path, dtype="float32"):
    config = EngineConfig(model=str(model_dir), dtype=dtype, device="cpu", backend="torch",
                          onnx_cache_dir=str(tmp_path))
    return load_model(config)[0]


def test_the_digest_is_hashed_once_then_remembered(tiny_model_dir, tmp_path, hashed):
    first = onnx_export.model_hash(load(tiny_model_dir, tmp_path))
    again = onnx_export.model_hash(load(tiny_model_dir, tmp_path))
    assert first == again and hashed == ["torch.float32"]
    unattached = load(tiny_model_dir, tmp_path)
    del unattached.digest_memo  # a model no loader vouches for is hashed every time
    assert onnx_export.model_hash(unattached) == first and len(hashed) == 2


def test_a_rewritten_file_or_another_dtype_is_hashed_again(tiny_model_dir, tmp_path, hashed):
    float32 = onnx_export.model_hash(load(tiny_model_dir, tmp_path))
    bfloat16 = onnx_export.model_hash(load(tiny_model_dir, tmp_path, dtype="bfloat16"))
    assert bfloat16 != float32 and hashed == ["torch.float32", "torch.bfloat16"]
    weights = next(tiny_model_dir.glob("*.safetensors"))
    st = weights.stat()
    try:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # as a rewrite would
        assert onnx_export.model_hash(load(tiny_model_dir, tmp_path)) == float32
        assert hashed == ["torch.float32", "torch.bfloat16", "torch.float32"]
    finally:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_the_same_model_in_two_cache_directories_has_one_digest(tiny_model_dir, tmp_path, hashed):
    """The digest is the weights' and config's content, not where they were read from (the
    config's `_name_or_path` is the folder: the same model in another cache re-exported its graph)."""
    import shutil

    from edge_runtime.model.gguf_load import load_llama_gguf
    from tests.model.quant_helpers import Q4_K_M_LIKE, tiny_quant_gguf

    copies = [shutil.copytree(tiny_model_dir, tmp_path / name) for name in ("a", "b")]
    digests = {onnx_export.model_hash(load(folder, tmp_path / f"onnx-{folder.name}")) for folder in copies}
    assert len(digests) == 1 and len(hashed) == 2  # each folder's files hashed once, to one digest
    _, gguf = tiny_quant_gguf(tmp_path / "gguf", Q4_K_M_LIKE)
    other = shutil.copy(gguf, tmp_path / "elsewhere.gguf")
    assert onnx_export.model_hash(load_llama_gguf(gguf)) == onnx_export.model_hash(load_llama_gguf(other))
