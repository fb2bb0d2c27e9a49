"""Backends run one scheduled batch and return the sampling rows' logits: torch (the reference),
onnxruntime (the exported step graph on TensorRT EP / CUDA EP / CPU) and tensorrt (native
engines from the same graph, `trt_plugins`). `make_backend` picks one from the engine config."""

from __future__ import annotations

from typing import TYPE_CHECKING

from edge_runtime.backends.base import Backend

if TYPE_CHECKING:
    from edge_runtime.backends.cuda_graphs import DecodeGraphs
    from edge_runtime.config import EngineConfig
    from edge_runtime.kv.cache import KVCache
    from edge_runtime.lora.registry import AdapterRegistry
    from edge_runtime.model.llama import LlamaModel

__all__ = ["BACKENDS", "Backend", "make_backend"]

BACKENDS = ("torch", "onnxruntime", "tensorrt", "auto")


def make_backend(config: EngineConfig, model: LlamaModel, cache: KVCache, adapters: AdapterRegistry | None) -> Backend:
    """The backend `config.backend` names, built over the engine's model, KV cache and adapters
    ("auto" is resolved by `auto.choose_backend`, which calls this with a concrete name)."""
    name = config.backend
    if name == "torch":
        from edge_runtime.backends.torch_backend import TorchBackend

        return TorchBackend(model, cache, adapters, row_invariant=config.deterministic,
                            graphs=decode_graphs(config, model, cache))
    if name == "onnxruntime":
        from edge_runtime.backends.onnxruntime_backend import OnnxRuntimeBackend

        return OnnxRuntimeBackend(
            model, cache, adapters, quantization=config.onnx_quantization,
            cache_dir=config.onnx_cache_dir or None, num_threads=config.num_threads,
            max_batch=config.max_num_seqs, max_tokens=config.max_batched_tokens, max_context=config.max_context,
            kv_layout=config.onnx_kv_layout, dense_kv_bytes=config.onnx_dense_kv_bytes,
            row_invariant=config.deterministic,
        )
    if name == "tensorrt":
        from trt_plugins.backend import TensorRTBackend

        return TensorRTBackend(
            model, cache, adapters, quantization=config.onnx_quantization, cache_dir=config.onnx_cache_dir or None,
            max_batch=config.max_num_seqs, max_tokens=config.max_batched_tokens, max_context=config.max_context,
        )
    raise ValueError(f"unknown backend {name!r}; use one of {', '.join(BACKENDS)}")


def decode_graphs(config: EngineConfig, model: LlamaModel, cache: KVCache) -> DecodeGraphs | None:
    """The torch backend's CUDA graphs (`engine.cuda_graphs`, on a GPU, not with
    `engine.deterministic`, whose row tiles are checked eagerly on the CPU only), every batch
    size captured now at the narrowest width; else None."""
    if not config.cuda_graphs or model.device.type != "cuda" or config.deterministic \
            or getattr(cache, "scratch_block", None) is None:
        return None
    from edge_runtime.backends.cuda_graphs import DecodeGraphs

    max_context = config.max_context or model.cfg.max_position_embeddings
    graphs = DecodeGraphs(model, cache, config.max_num_seqs, min(max_context, cache.num_blocks * cache.block_size),
                          compile_step=config.cuda_graphs_compile)
    graphs.warm()
    return graphs
