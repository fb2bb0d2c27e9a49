"""The engine's memory arithmetic before and at start-up: bytes of the weights, the KV cache's
share of free memory, the ledger budget derived from what the engine holds, and the check of a
configured budget against what serving needs. Sizes only; the ledger (memory.py) tracks use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from edge_runtime.config import EngineConfig
from edge_runtime.errors import InsufficientMemory
from edge_runtime.kv.cache import bytes_per_block
from edge_runtime.model.config import ModelConfig
from edge_runtime.sched.cost_model import CostModel, activation_sizes

if TYPE_CHECKING:
    from edge_runtime.backends.base import Backend
    from edge_runtime.kv.cache import KVCache
    from edge_runtime.lora.registry import AdapterRegistry
    from edge_runtime.model.llama import LlamaModel


def weights_bytes(model: LlamaModel, dtype: torch.dtype | None = None) -> int:
    """Bytes of the parameters and buffers; `dtype`: of the parameters once converted to it
    (for a shell built on the meta device before loading)."""
    params = sum(p.numel() * (p.element_size() if dtype is None else torch.empty((), dtype=dtype).element_size())
                 for p in model.parameters())
    return params + sum(b.numel() * b.element_size() for b in model.buffers())


def memory_needs(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, weights_bytes: int) -> dict[str, int]:
    """What serving needs at the least, in bytes: the weights, KV blocks for one full prompt
    chunk (`max_batched_tokens`), and one such iteration's activations and logits."""
    per_token, per_row = activation_sizes(cfg, dtype)
    chunk_blocks = -(-config.max_batched_tokens // config.block_size)
    return {
        "weights": weights_bytes,
        "kv_minimum": chunk_blocks * bytes_per_block(cfg, config.block_size, dtype),
        "activations": config.max_batched_tokens * per_token + config.max_num_seqs * per_row,
    }


def check_memory_budget(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, weights_bytes: int) -> None:
    """Raise `InsufficientMemory` when a configured budget (`memory_budget_bytes`) is below
    `memory_needs`: the engine would hold more than its budget before serving anything."""
    budget = config.memory_budget_bytes
    if not budget:
        return  # derived from what the engine holds: fits by construction
    needs = memory_needs(config, cfg, dtype, weights_bytes)
    total = sum(needs.values())
    if budget < total:
        mib = 2**20
        raise InsufficientMemory(
            f"the memory budget ({budget / mib:.0f} MiB, engine.memory_budget_bytes) is below what serving this "
            f"model needs: {total / mib:.0f} MiB = weights {needs['weights'] / mib:.0f} MiB "
            f"({str(dtype).removeprefix('torch.')}) + KV cache minimum {needs['kv_minimum'] / mib:.1f} MiB (one "
            f"{config.max_batched_tokens}-token chunk) + one iteration's activations {needs['activations'] / mib:.1f} "
            f"MiB; raise the budget, or lower the dtype, max_batched_tokens or max_num_seqs")


def kv_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    """Bytes for the paged KV cache: as configured, else a share of the memory free now."""
    if config.kv_cache_bytes:
        return config.kv_cache_bytes
    import psutil

    available = psutil.virtual_memory().available
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        available = min(available, free)  # on Jetson both views share one DRAM
    return int(min(config.kv_cache_max_bytes, available * config.kv_cache_fraction))


def max_context(config: EngineConfig, cfg: ModelConfig, num_blocks: int) -> int:
    """Tokens one sequence may hold: the model's limit, the KV cache's, and the configured one."""
    limit = min(cfg.max_position_embeddings, num_blocks * config.block_size)
    return min(limit, config.max_context) if config.max_context else limit


def ledger_budget_bytes(config: EngineConfig, model: LlamaModel, cache: KVCache, adapters: AdapterRegistry,
                        costs: CostModel, backend: Backend) -> int:
    """The ledger's budget until telemetry sets one: what the engine holds by construction
    (weights, the KV cache, the adapter cache, what the backend may hold), one full iteration's
    activations, and the configured room for fine-tuning."""
    if config.memory_budget_bytes:
        return config.memory_budget_bytes
    forward = (costs.inference_bytes(config.max_batched_tokens, False)
               + config.max_num_seqs * costs.logits_bytes_per_row)
    return (weights_bytes(model) + cache.nbytes + adapters.cache.capacity_bytes
            + forward + config.finetune_memory_bytes + backend.reserved_bytes)
