"""ONNX Runtime's side of the ONNX backends: which execution providers this build has and how
they are configured, one session of an exported graph with its IO binding, and tensors bound to
it by pointer. Knows nothing of batches or the KV layouts that fill the bindings.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge_runtime.backends import ort_prefetch
from edge_runtime.backends.onnx_export import DATA_FILE
from edge_runtime.backends.onnx_spec import KV_DTYPES, TORCH_KV_DTYPES
from edge_runtime.c_heap import pin_mmap_threshold

log = logging.getLogger(__name__)

PROVIDER_ORDER = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")


def onnxruntime_has_gpu() -> bool:
    """Whether this onnxruntime build can run a graph on an NVIDIA GPU (the plain `onnxruntime`
    wheel cannot: it has the CPU provider alone, whatever torch sees)."""
    import onnxruntime as ort

    return any(name in GPU_PROVIDERS for name in ort.get_available_providers())


def pick_providers(trt_cache_dir: Path | None = None, device: torch.device | None = None) -> list:
    """The providers this onnxruntime build has, best first; TensorRT EP gets fp16 and an
    engine cache directory so its engines are built once per shape profile and GPU."""
    import onnxruntime as ort

    available = set(ort.get_available_providers())
    on_gpu = device is not None and device.type == "cuda"
    chosen: list = []
    for name in PROVIDER_ORDER:
        if name not in available or (name != "CPUExecutionProvider" and not on_gpu):
            continue
        if name == "TensorrtExecutionProvider":
            options = {"trt_fp16_enable": True, "trt_engine_cache_enable": True}
            if trt_cache_dir is not None:
                trt_cache_dir.mkdir(parents=True, exist_ok=True)
                options["trt_engine_cache_path"] = str(trt_cache_dir)
            chosen.append((name, options))
        elif name == "CUDAExecutionProvider":
            chosen.append((name, {"device_id": device.index or 0}))
        else:
            chosen.append(name)
    return chosen


@dataclass
class OrtSession:
    """One ONNX Runtime session with its bindings (the KV cache bound once, by pointer)."""

    path: Path
    inference: Any
    binding: Any
    has_lora_inputs: bool
    weights_bytes: int = 0  # the graph's external weight data
    bound_stack: tuple[Hashable, ...] | None = None
    dense_key: tuple | None = None  # what the dense layout's past/present are bound to
    inputs_key: tuple | None = None  # which preallocated decode inputs are bound (None: a plan's)
    prefetched: bool = False  # opened by `ort_prefetch`'s thread, which measured `weights_bytes`


# ONNX Runtime's kernels pre-pack constant weights into buffers of their own (MatMulNBits into
# its tiled int4/int8 layout) and free the originals: docs/onnx.md ("ORT's own copy") measures it.
PREPACK = True

# ONNX Runtime's CPU arena grows by powers of two to the largest run's intermediates (the
# self-check's, calibration's and prefill chunks' shapes) and keeps that high-water mark for the
# session's life; without it a run's tensors come from malloc and go back when it ends.
# docs/onnx.md ("Where a block model's bytes go while it trains") measures both.
CPU_ARENA = True

# A run over more tokens than this (prefill chunks, the self-check, calibration shapes, scoring)
# gives the arena's regions it grew back when it ends (`memory.enable_memory_arena_shrinkage`):
# kept, a daemon carried its largest runs' intermediates (~300 MiB at 1B) through serving and
# training. Decode steps (a few rows) stay below and reuse the arena as it is.
SHRINK_ABOVE_TOKENS = 32


def run_options(tokens: int) -> Any:
    """The RunOptions of a run over `tokens` tokens: with the CPU arena's shrinkage above
    `SHRINK_ABOVE_TOKENS` (where the arena is on), else None (ONNX Runtime's defaults)."""
    return _shrinking_run() if CPU_ARENA and tokens > SHRINK_ABOVE_TOKENS else None


@functools.lru_cache(maxsize=1)
def _shrinking_run() -> Any:
    import onnxruntime as ort

    options = ort.RunOptions()
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return options


def open_session(path: Path, providers: list, num_threads: int = 0, has_lora_inputs: bool = True,
                 prepack: bool | None = None) -> OrtSession:
    """A session of the exported graph at `path` with every graph optimisation, on `providers`
    (`num_threads` intra-op threads; 0: ONNX Runtime's choice); `prepack`: whether kernels may
    copy their weights into layouts of their own (None: `PREPACK`). `maced` may have opened it
    already (`ort_prefetch`): taken when graph and options are identical, else dropped first."""
    if CPU_ARENA:
        pin_mmap_threshold()
    key = ort_prefetch.options_key(providers, num_threads, has_lora_inputs,
                                   PREPACK if prepack is None else prepack, CPU_ARENA)
    prefetch = ort_prefetch.current()
    taken = prefetch.take(path, key) if prefetch is not None else None
    inference, grown = taken or ort_prefetch.create_inference(path, key, DATA_FILE)
    if prefetch is not None:
        prefetch.remember(path, key, DATA_FILE, write=taken is None)
    log.info("onnxruntime backend: %s on %s%s", path.parent.name, inference.get_providers(),
             " (prefetched)" if taken else "")
    data = path.parent / DATA_FILE
    # A prefetched session's thread measured what opening it added (`ort_graphs` measures the others).
    return OrtSession(path, inference, inference.io_binding(), has_lora_inputs=has_lora_inputs,
                      weights_bytes=grown or (data.stat().st_size if data.exists() else 0),
                      prefetched=taken is not None)


def bind_cpu_inputs(session: OrtSession, inputs: dict[str, np.ndarray]) -> None:
    """Bind a plan's arrays; the decode step's preallocated inputs are then no longer bound."""
    for name, array in inputs.items():
        session.binding.bind_cpu_input(name, array)
    session.inputs_key = None


def onnx_type(dtype: torch.dtype) -> int:
    return KV_DTYPES[TORCH_KV_DTYPES[dtype]]
