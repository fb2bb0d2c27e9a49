"""TensorRT: the pure parts (shape profiles, engine cache keys, the graph TensorRT parses, checked
through ONNX Runtime on the CPU) run everywhere; building and running engines runs only where
tensorrt and a CUDA GPU exist (skipped with the reason otherwise; tools/trt_selfcheck.py runs
the full check on a Jetson)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("onnxruntime")

from edge_runtime import Engine, SamplingParams  # noqa: E402
from edge_runtime.backends.onnx_export import export_step  # noqa: E402
from edge_runtime.backends.onnx_spec import GraphSpec  # noqa: E402
from edge_runtime.backends.onnxruntime_backend import OnnxRuntimeBackend  # noqa: E402
from edge_runtime.backends.shape_profiles import StepLimits, input_shapes, ort_trt_profile_options  # noqa: E402
from tests.backends.helpers import ort_device  # noqa: E402
from trt_plugins.builder import TensorRTUnavailable, require_tensorrt  # noqa: E402
from trt_plugins.engine_cache import engine_key  # noqa: E402

CONFIG = dict(dtype="float32", kv_cache_bytes=4 << 20, device=ort_device())


def _trt_reason() -> str | None:
    try:
        require_tensorrt()
    except TensorRTUnavailable as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("lora", [False, True])
def test_profile_resolves_every_input_of_the_standard_graph(tiny_model_dir, tmp_path, lora):
    engine = Engine.load(str(tiny_model_dir), **CONFIG)
    path = export_step(engine.model, GraphSpec(flavour="standard", lora=lora), tmp_path)
    limits = StepLimits(max_batch=8, max_tokens=64, max_context=512, cache_rows=1024)
    shapes = input_shapes(path, limits)
    assert ("lora_index" in shapes) == lora
    for name, (lo, opt, hi) in shapes.items():
        assert all(a <= o <= z for a, o, z in zip(lo, opt, hi, strict=True)), name
    assert shapes["cache.0.key"][0] == shapes["cache.0.key"][2] == [1024, engine.model.cfg.head_dim]
    assert shapes["input_ids"][2] == [64]


def test_ort_tensorrt_ep_gets_one_explicit_profile(tiny_model_dir, tmp_path):
    engine = Engine.load(str(tiny_model_dir), **CONFIG)
    path = export_step(engine.model, GraphSpec(), tmp_path)
    options = ort_trt_profile_options(path, StepLimits(cache_rows=64))
    assert "input_ids:1x1" in options["trt_profile_min_shapes"]
    assert "cache.0.value:64x" in options["trt_profile_max_shapes"]


def test_engine_key_changes_with_tensorrt_gpu_and_profile(tmp_path):
    graph = tmp_path / "abc-standard-int4-v4" / "model.onnx"
    base = engine_key(graph, "10.3.0", "Orin-sm87", StepLimits(), True)
    assert base.startswith("abc-standard-int4-v4-trt10.3.0-Orin-sm87-")
    assert engine_key(graph, "10.7.0", "Orin-sm87", StepLimits(), True) != base
    assert engine_key(graph, "10.3.0", "H100-sm90", StepLimits(), True) != base
    assert engine_key(graph, "10.3.0", "Orin-sm87", StepLimits(max_batch=8), True) != base


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_the_graph_tensorrt_parses_runs_quantized_through_onnxruntime(tiny_model_dir, tmp_path, quantization):
    engine = Engine.load(str(tiny_model_dir), **CONFIG)
    ids = engine.tokenizer.hf.encode("Hello, how are you today?")
    full = OnnxRuntimeBackend(engine.model, engine.cache, None, flavour="standard", cache_dir=tmp_path).score(ids)
    quant = OnnxRuntimeBackend(engine.model, engine.cache, None, flavour="standard", quantization=quantization,
                               cache_dir=tmp_path).score(ids)
    assert 0 < (full - quant).abs().max().item() < 0.5


@pytest.mark.gpu
@pytest.mark.skipif(_trt_reason() is not None, reason=str(_trt_reason()))
def test_tensorrt_engine_decodes_like_torch(tiny_model_dir, tmp_path):
    from trt_plugins.backend import TensorRTBackend

    engine = Engine.load(str(tiny_model_dir), device="cuda", dtype="float16", kv_cache_bytes=4 << 20,
                         onnx_cache_dir=str(tmp_path))
    prompts = ["Hello, how are you", "What is the capital of France?", "The quick brown fox"]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    reference = [o.candidates[0].token_ids for o in engine.generate(prompts, params)]
    engine.backend = TensorRTBackend(engine.model, engine.cache, engine.adapters, cache_dir=tmp_path,
                                     max_batch=8, max_tokens=256, max_context=512)
    ours = [o.candidates[0].token_ids for o in engine.generate(prompts, params)]
    assert ours == reference
    assert torch.isfinite(engine.cache.data.float()).all()
