"""Where native TensorRT engines are kept: `<cache>/trt/<key>.engine`, the key made of the
exported graph's key (model hash + spec + graph version), the TensorRT version, the GPU and
the optimisation profile, so an engine is reused only where it was built for exactly that."""

from __future__ import annotations

import hashlib
from pathlib import Path

from edge_runtime.backends.shape_profiles import StepLimits


def gpu_name() -> str:
    import torch

    if not torch.cuda.is_available():
        return "no-gpu"
    props = torch.cuda.get_device_properties(0)
    return f"{props.name}-sm{props.major}{props.minor}"


def engine_key(onnx_path: str | Path, trt_version: str, gpu: str, limits: StepLimits, fp16: bool) -> str:
    graph_key = Path(onnx_path).parent.name
    profile = hashlib.blake2b(f"{limits.key()}-fp16{int(fp16)}".encode(), digest_size=6).hexdigest()
    safe_gpu = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in gpu)
    return f"{graph_key}-trt{trt_version}-{safe_gpu}-{profile}"


def engine_path(cache_dir: str | Path, key: str) -> Path:
    return Path(cache_dir) / "trt" / f"{key}.engine"

