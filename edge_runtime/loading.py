"""Loading a model for the engine: find it (a folder or the model source), pick the device and
the dtype the backend will run, refuse a configured memory budget before reading gigabytes of
weights, and load the weights and the tokenizer. Builds no engine state.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from edge_runtime import paths
from edge_runtime.backends import weights_memo
from edge_runtime.backends.auto import first_candidate
from edge_runtime.config import EngineConfig
from edge_runtime.device import pick_device, pick_dtype
from edge_runtime.model.config import ModelConfig
from edge_runtime.model.gguf_weight import activations_mode, set_activations
from edge_runtime.model.llama import LlamaModel
from edge_runtime.model.model_cache import in_place_source
from edge_runtime.model.tokenizer import Tokenizer
from edge_runtime.model.weights import load_llama
from edge_runtime.sizing import available_memory_bytes, check_memory_budget, stored_weights_bytes

log = logging.getLogger(__name__)


def load_model(config: EngineConfig) -> tuple[LlamaModel, Tokenizer, str]:
    """The model `config.model` names (None = the default), its tokenizer and its name."""
    activations_mode(config.gguf_activations)  # an unknown setting is refused before any loading
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    path, name = resolve(config.model, in_place=reads_in_place(config))
    source = in_place_source(path)  # the GGUF file whose bytes serve, or None
    device = engine_device(config)
    dtype_name = config.dtype
    if dtype_name == "auto" and config.backend == "auto" and device.type == "cpu" \
            and first_candidate(device) != "torch":
        dtype_name = "float32"  # ONNX Runtime's CPU kernels and the dense KV rows are float32
    if dtype_name == "auto" and source is not None:
        # The GGUF kernel's products take and give float32: bfloat16 activations would only add
        # casts and the CPU's slower small bfloat16 GEMMs in attention (1B decode, 2 threads: 4.5 vs
        # 7.4 ms of torch ops a token; the KV budget in bytes holds half the tokens).
        dtype_name = "float32"
    dtype = pick_dtype(dtype_name, device)
    # Refuse before reading gigabytes of weights: against the configured budget, else against
    # what this machine has available now (a model that cannot fit is never loaded to the OOM).
    cfg = ModelConfig.from_dir(path)
    # Read in place, the weights are the GGUF's pages (its header and vocabulary are a few MiB).
    weights = source.stat().st_size if source is not None else stored_weights_bytes(path, cfg, dtype)
    check_memory_budget(config, cfg, dtype, weights, None if config.memory_budget_bytes else available_memory_bytes())
    log.info("loading %s: %.0f MiB of weights", name, weights / 2**20)
    model = load_llama(path, dtype=dtype, device=device)
    set_activations(model, config.gguf_activations)  # a model without GgufWeights has none to set
    # Its digest (graph export key, prefix store) is then hashed once per set of files, not per start.
    weights_memo.attach(model, path, Path(config.onnx_cache_dir) if config.onnx_cache_dir else paths.cache_dir() / "onnx")
    return model, Tokenizer(path), name


# What the re-encoded serving path holds per byte of a GGUF's tensors: ONNX Runtime's pre-packed
# MatMulNBits (docs/onnx.md: 7,224 MiB for the 8B Q4_K_M file's 4,685; the block cache's mapped
# pages come on top while training).
REENCODED_RATIO = 1.55
# The footprint a user of a GGUF file may expect for its weights (issue #28's bar for the whole
# daemon at 8B): a quarter above the file's tensors plus 1 GiB. A re-encoded copy above it is not
# taken by "auto": at 1B-3B the fixed GiB covers the re-encoding (and its faster kernels serve), from
# ~3.4 GiB of tensors (an 8B Q4_K_M) the file's own bytes serve.
FOOTPRINT_RATIO, FOOTPRINT_SLACK = 1.25, 1 << 30


def reencoded_too_big(tensor_bytes: int, budget: int, finetune_bytes: int) -> str | None:
    """Why a re-encoded serving copy of this many GGUF tensor bytes is not taken, or None."""
    copy = REENCODED_RATIO * tensor_bytes
    if copy + finetune_bytes > budget:
        return (f"a re-encoded copy ({copy / 2**20:.0f} MiB) and a training stage ({finetune_bytes / 2**20:.0f} MiB) "
                f"would not fit the memory budget ({budget / 2**20:.0f} MiB)")
    footprint = FOOTPRINT_RATIO * tensor_bytes + FOOTPRINT_SLACK
    if copy > footprint:
        return (f"a re-encoded copy ({copy / 2**20:.0f} MiB) would exceed the file's own footprint "
                f"({FOOTPRINT_RATIO}x its tensors + 1 GiB = {footprint / 2**20:.0f} MiB)")
    return None


# From this many bytes of tensors a GGUF whose matrices the compiled int8 products read is served
# from its own bytes even where a re-encoded copy would fit: at Llama-3.2-1B and 3B's shapes those
# products decode one stream faster than ONNX Runtime's MatMulNBits graph (which reads its packed
# copy, ~1.5x the bytes per token) and the daemon holds one copy of the weights, not two
# (tools/results/bench_scale_gguf_llama-3.2-*: README, "Where #28 stands"). Below it (the default
# 135M model's file is 98 MiB) the graph's one call per step wins over a layer's per-op overhead.
IN_PLACE_FROM_BYTES = 512 << 20


def in_place_is_faster(header: Any, tensors: int) -> str | None:
    """Why the file's own blocks serve faster than a re-encoded graph, or None: the compiled
    kernels are here (`gguf_kernel.available`), every matrix is a block type they take int8 x on,
    and the file is at least IN_PLACE_FROM_BYTES of tensors."""
    if tensors < IN_PLACE_FROM_BYTES:
        return None
    from gguf import GGML_QUANT_SIZES

    from edge_runtime.model import gguf_kernel

    if not gguf_kernel.available():
        return None
    matrices = {t.tensor_type for t in header.tensors.values() if len(t.shape) == 2}
    if not matrices or any(q not in gguf_kernel.SUPPORTED or GGML_QUANT_SIZES[q][0] == 1 for q in matrices):
        return None
    return (f"the compiled int8 products on the file's {', '.join(sorted(q.name for q in matrices))} blocks "
            f"decode faster than a re-encoded graph, and hold one copy of the weights")


def reads_in_place(config: EngineConfig) -> bool:
    """Whether the model's matrices are read in place from its GGUF (`engine.torch_weights`):
    "gguf" always (for a llama GGUF file), "cache" never, "auto" (the default) where the backend is
    auto or torch and a re-encoded serving copy would not fit the memory budget (configured, else
    what this machine has available now) with a training stage, or would exceed the file's own
    footprint (`reencoded_too_big`), or where the compiled kernels serve the file's own blocks
    faster (`in_place_is_faster`), so the one copy taken is the file's own. Never off the CPU."""
    setting = config.torch_weights
    if setting not in ("cache", "gguf", "auto"):
        raise ValueError(f"engine.torch_weights = {setting!r}: use cache, gguf or auto")
    if setting != "cache" and engine_device(config).type != "cpu":
        # The file's bytes are read by CPU kernels; on a GPU the blocks (re-encoded, in the
        # GPU's memory) serve and train instead.
        if setting == "gguf":
            log.warning("engine.torch_weights = gguf reads the file in place on the CPU only: on %s the "
                        "model's blocks are loaded instead", engine_device(config).type)
        return False
    if setting != "auto":
        return setting == "gguf"
    spec = config.model
    if config.backend not in ("auto", "torch") or spec is None or not Path(spec).is_file():
        return False
    with open(spec, "rb") as fh:
        if fh.read(4) != b"GGUF":
            return False
    budget = config.memory_budget_bytes or available_memory_bytes()
    # The file's size first (its tensors and a header of a few MiB): a small model's start does not
    # parse the header (a 128k-token vocabulary takes seconds) to learn what the size already says.
    size = Path(spec).stat().st_size
    if size < IN_PLACE_FROM_BYTES and reencoded_too_big(size, budget, config.finetune_memory_bytes) is None:
        return False
    from edge_runtime.model import gguf_config, gguf_load

    header = gguf_config.read_header(spec)
    if not gguf_load.reads(header):
        return False
    tensors = sum(int(t.n_bytes) for t in header.tensors.values())
    why = reencoded_too_big(tensors, budget, config.finetune_memory_bytes) or in_place_is_faster(header, tensors)
    if why is None:
        return False
    log.info("serving %s in place: %s; the file's own %.0f MiB of tensors serve and train",
             Path(spec).name, why, tensors / 2**20)
    return True


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
