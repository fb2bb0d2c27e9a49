"""Builds a TensorRT engine from the exported step graph ("standard" flavour): one optimisation
profile from the engine's limits, FP16 allowed, weight-only INT4/INT8 read from the graph's
block-wise DequantizeLinear; cached per graph, TensorRT version, GPU and profile."""

from __future__ import annotations

import logging
from pathlib import Path

from edge_runtime import durable
from edge_runtime.backends.shape_profiles import StepLimits, input_shapes
from trt_plugins.engine_cache import engine_key, engine_path, gpu_name

log = logging.getLogger(__name__)


class TensorRTUnavailable(RuntimeError):
    """tensorrt or a CUDA GPU is missing; the message says which."""


def require_tensorrt():
    """The tensorrt module, or TensorRTUnavailable with the reason."""
    try:
        import tensorrt
    except ImportError as exc:
        raise TensorRTUnavailable(f"the tensorrt Python module is not installed ({exc}); on Jetson it comes "
                                  "with JetPack (python3-libnvinfer)") from exc
    import torch

    if not torch.cuda.is_available():
        raise TensorRTUnavailable("TensorRT needs a CUDA GPU and torch sees none")
    return tensorrt


def build_engine(onnx_path: str | Path, limits: StepLimits, cache_dir: str | Path, fp16: bool = True) -> Path:
    """Path of the serialized engine for this graph and profile, building it on a cache miss."""
    trt = require_tensorrt()
    key = engine_key(onnx_path, trt.__version__, gpu_name(), limits, fp16)
    path = engine_path(cache_dir, key)
    if path.exists():
        return path
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    # parse_from_file resolves the external weights file beside the graph.
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    shapes = input_shapes(onnx_path, limits)
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        lo, opt, hi = shapes[tensor.name]
        if tensor.is_shape_tensor:
            profile.set_shape_input(tensor.name, lo, opt, hi)
        else:
            profile.set_shape(tensor.name, lo, opt, hi)
    config.add_optimization_profile(profile)
    log.info("building TensorRT engine %s (minutes on a Jetson)", key)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path}; see its log above")
    path.parent.mkdir(parents=True, exist_ok=True)
    durable.write_bytes(path, bytes(serialized))
    return path
