"""The native TensorRT backend: the same exported step ("standard" flavour) compiled into an
engine per graph (base model / with LoRA inputs), run on the CUDA KV cache by pointer.

Same contract and batch handling as `OnnxRuntimeBackend`; adapters stay inputs, so a new
adapter version never rebuilds or refits an engine. Needs tensorrt and a CUDA device.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge_runtime.backends.base import Backend
from edge_runtime.backends.lora_stack import LoraStackCache
from edge_runtime.backends.onnx_export import default_cache_dir, export_step, model_hash
from edge_runtime.backends.onnx_spec import TORCH_KV_DTYPES, GraphSpec, weight_format
from edge_runtime.backends.onnxruntime_backend import write_new_kv
from edge_runtime.backends.shape_profiles import StepLimits
from edge_runtime.backends.step_inputs import StepItem, plan_step, split_groups
from edge_runtime.kv.cache import KVCache
from edge_runtime.lora.registry import AdapterRegistry
from edge_runtime.model.llama import LlamaModel, LoraApplier
from trt_plugins.builder import TensorRTUnavailable, build_engine, require_tensorrt


class TensorRTBackend(Backend):
    name = "tensorrt"
    runs_onnx_weights = True

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        adapters: AdapterRegistry | None = None,
        *,
        quantization: str = "none",
        cache_dir: str | Path | None = None,
        max_batch: int = 32,
        max_tokens: int = 256,
        max_context: int = 0,
        max_lora_rank: int = 64,
        fp16: bool = True,
    ) -> None:
        self.trt = require_tensorrt()
        if cache.data.device.type != "cuda":
            raise TensorRTUnavailable("the tensorrt backend needs the engine on a CUDA device (device = cuda)")
        self.model, self.cfg, self.cache, self.adapters = model, model.cfg, cache, adapters
        self.device = cache.data.device
        self.spec = GraphSpec(**weight_format(quantization), flavour="standard",  # type: ignore[arg-type]
                              kv_dtype=TORCH_KV_DTYPES[cache.data.dtype])
        cfg = self.cfg
        self.limits = StepLimits(max_batch, max_tokens, max_context or cfg.max_position_embeddings, max_lora_rank,
                                 cache_rows=cache.data.shape[2] * cfg.num_kv_heads)
        self.root = Path(cache_dir) if cache_dir else default_cache_dir()
        self.fp16 = fp16
        self.digest = model_hash(model)
        self.stacks = LoraStackCache(cfg)
        self.stream = torch.cuda.Stream(self.device)
        self._contexts: dict[bool, Any] = {}
        self._context(lora=False)

    def _context(self, lora: bool):
        context = self._contexts.get(lora)
        if context is None:
            trt = self.trt
            onnx_path = export_step(self.model, replace(self.spec, lora=lora), self.root, digest=self.digest)
            engine_file = build_engine(onnx_path, self.limits, self.root, self.fp16)
            runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
            engine = runtime.deserialize_cuda_engine(engine_file.read_bytes())
            context = engine.create_execution_context()
            context.engine_ref = engine  # the context must not outlive its engine
            d = self.cfg.head_dim
            for layer in range(self.cfg.num_layers):
                for kv, kind in enumerate(("key", "value")):
                    slab = self.cache.data[layer, kv]
                    context.set_input_shape(f"cache.{layer}.{kind}", (slab.numel() // d, d))
                    context.set_tensor_address(f"cache.{layer}.{kind}", slab.data_ptr())
            self._contexts[lora] = context
        return context

    @torch.inference_mode()
    def execute(self, batch, lora: LoraApplier | None = None) -> torch.Tensor:
        if lora is not None:
            raise ValueError("the tensorrt backend applies each row's pinned adapter from the registry; an explicit "
                             "LoRA applier is a torch-backend argument")
        refs = [item.seq.request.served if self.adapters is not None else None for item in batch.items]
        out: list[torch.Tensor | None] = [None] * len(batch.items)
        for group in split_groups([item.num_tokens for item in batch.items]):
            rows = self._run_items([batch.items[i] for i in group], [refs[i] for i in group])
            for pos, i in enumerate(j for j in group if batch.items[j].samples):
                out[i] = rows[pos]
        sampled = [t for t in out if t is not None]
        return torch.stack(sampled).float() if sampled else torch.empty(0, self.cfg.vocab_size)

    def _run_items(self, items: list, refs: list) -> torch.Tensor:
        slots: dict[Hashable, int] = {}
        for ref in refs:
            if ref is not None and ref not in slots:
                slots[ref] = len(slots)
        steps = [StepItem(it.seq.token_ids[it.seq.num_computed : it.seq.num_computed + it.num_tokens],
                          it.seq.num_computed, it.seq.block_table, it.samples, -1 if r is None else slots[r],
                          self.model.rope.offset(it.seq.num_tokens))
                 for it, r in zip(items, refs, strict=True)]
        cfg = self.cfg
        plan = plan_step(steps, self.cache.block_size, cfg.num_heads, cfg.num_kv_heads, cfg.layer_windows, False)
        key = tuple(slots)
        context = self._context(lora=bool(key))
        feeds: dict[str, np.ndarray] = dict(plan.inputs)
        if key:
            feeds.update(self.stacks.get(key, [self.adapters.served_weights(r) for r in key]))
        else:
            feeds.pop("lora_index")
        rows = len(plan.sampling_items)
        if rows == 0:
            feeds["logit_rows"] = np.zeros(1, np.int64)  # the profile's minimum; discarded
        keep = []  # device copies must live until the run completes
        for name, array in feeds.items():
            tensor = torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)
            keep.append(tensor)
            context.set_input_shape(name, tuple(tensor.shape))
            context.set_tensor_address(name, tensor.data_ptr())
        logits = torch.empty(max(rows, 1), cfg.vocab_size, dtype=torch.float32, device=self.device)
        new_kv = torch.empty(cfg.num_layers, plan.num_tokens, 2 * cfg.kv_size, dtype=self.cache.data.dtype,
                             device=self.device)
        context.set_tensor_address("logits", logits.data_ptr())
        context.set_tensor_address("new_kv", new_kv.data_ptr())
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if not context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed; see its log")
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        write_new_kv(self.cache, new_kv[:, : plan.real_tokens], plan.slot_mapping[: plan.real_tokens])
        return logits[:rows]
