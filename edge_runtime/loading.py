"""Loading a model for the engine: find it (a folder or the model source), pick the device and
the dtype the backend will run, refuse a configured memory budget before reading gigabytes of
weights, and load the weights and the tokenizer. Builds no engine state.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from edge_runtime import paths
from edge_runtime.backends import weights_memo
from edge_runtime.backends.auto import first_candidate
from edge_runtime.config import EngineConfig
from edge_runtime.device import pick_device, pick_dtype
from edge_runtime.model.config import ModelConfig
from edge_runtime.model.llama import LlamaModel
from edge_runtime.model.model_cache import in_place_source
from edge_runtime.model.tokenizer import Tokenizer
from edge_runtime.model.weights import load_llama
from edge_runtime.sizing import available_memory_bytes, check_memory_budget, stored_weights_bytes

log = logging.getLogger(__name__)


def load_model(config: EngineConfig) -> tuple[LlamaModel, Tokenizer, str]:
    """The model `config.model` names (None = the default), its tokenizer and its name."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    if config.torch_weights not in ("cache", "gguf"):
        raise ValueError(f"engine.torch_weights = {config.torch_weights!r}: use cache or gguf")
    path, name = resolve(config.model, in_place=config.torch_weights == "gguf")
    device = engine_device(config)
    dtype_name = config.dtype
    if dtype_name == "auto" and config.backend == "auto" and device.type == "cpu" \
            and first_candidate(device) != "torch":
        dtype_name = "float32"  # ONNX Runtime's CPU kernels and the dense KV rows are float32
    dtype = pick_dtype(dtype_name, device)
    # Refuse before reading gigabytes of weights: against the configured budget, else against
    # what this machine has available now (a model that cannot fit is never loaded to the OOM).
    cfg = ModelConfig.from_dir(path)
    source = in_place_source(path)
    # Read in place, the weights are the GGUF's pages (its header and vocabulary are a few MiB).
    weights = source.stat().st_size if source is not None else stored_weights_bytes(path, cfg, dtype)
    check_memory_budget(config, cfg, dtype, weights, None if config.memory_budget_bytes else available_memory_bytes())
    log.info("loading %s: %.0f MiB of weights", name, weights / 2**20)
    model = load_llama(path, dtype=dtype, device=device)
    # Its digest (graph export key, prefix store) is then hashed once per set of files, not per start.
    weights_memo.attach(model, path, Path(config.onnx_cache_dir) if config.onnx_cache_dir else paths.cache_dir() / "onnx")
    return model, Tokenizer(path), name


def engine_device(config: EngineConfig) -> torch.device:
    """Where the weights and the KV cache live. `device = "auto"` means CUDA when torch sees a
    GPU, except for the onnxruntime backend on a build without a GPU provider: its graphs run on
    the CPU and read the cache there, so the engine stays on the CPU too."""
    device = pick_device(config.device)
    if device.type == "cuda" and config.device == "auto" and config.backend == "onnxruntime":
        from edge_runtime.backends.ort_session import onnxruntime_has_gpu

        if not onnxruntime_has_gpu():
            log.warning("this onnxruntime build has no GPU provider: the onnxruntime backend runs on "
                        "the CPU (install onnxruntime-gpu to run it on the GPU)")
            return torch.device("cpu")
    return device


def resolve(spec: str | None, in_place: bool = False) -> tuple[Path, str]:
    """A model folder and its name, from a path or a name the model source knows. `in_place`: a
    llama GGUF file is served from its own bytes (engine.torch_weights = "gguf")."""
    if spec is not None and Path(spec).is_dir():
        return Path(spec), Path(spec).name
    from edge_runtime.model.source import resolve_model

    resolved = resolve_model(spec, in_place=in_place)
    return Path(resolved.path), resolved.name
