"""The engine's memory arithmetic before and at start-up: bytes of the weights, the KV cache's
share of free memory, the ledger budget derived from what the engine holds, and the check of a
configured budget against what serving needs. Sizes only; the ledger (memory.py) tracks use.
"""

from __future__ import annotations

from pathlib import Path
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
    from edge_runtime.model.mapped_weights import MappedWeights


def weights_bytes(model: LlamaModel, dtype: torch.dtype | None = None) -> int:
    """Bytes of the parameters and buffers; `dtype`: of the parameters once converted to it
    (for a shell built on the meta device before loading)."""
    params = sum(p.numel() * (p.element_size() if dtype is None else torch.empty((), dtype=dtype).element_size())
                 for p in model.parameters())
    return params + sum(b.numel() * b.element_size() for b in model.buffers())


def parameter_count(model: LlamaModel) -> int:
    """Weights of the model, counted as numbers: float parameters and quantised blocks' weights."""
    from edge_runtime.model.qweights import QuantWeight

    blocks = sum(m.shape.numel() for m in model.modules() if isinstance(m, QuantWeight))
    return blocks + sum(p.numel() for p in model.parameters())


def resident_weights_bytes(model: LlamaModel, mapped: MappedWeights | None) -> int:
    """Bytes of the model's weights this process holds: all of them, less the mapped blocks it
    reads a layer at a time and gives back (`edge_runtime.model.mapped_weights`), of which the
    most a pass keeps resident."""
    held = weights_bytes(model)
    return held if mapped is None else held - mapped.nbytes + mapped.peak_resident_bytes


def stored_weights_bytes(path: Path, cfg: ModelConfig, dtype: torch.dtype) -> int:
    """The weights' bytes before reading them: a block cache's tensor file as it is (4-bit blocks
    stay blocks), else the parameters of a shell of the model in `dtype`."""
    from edge_runtime.model.block_cache import BLOCKS_FILE

    blocks = Path(path) / BLOCKS_FILE
    if blocks.is_file():
        return blocks.stat().st_size
    from edge_runtime.model.llama import LlamaModel

    with torch.device("meta"):
        shell = LlamaModel(cfg)
    return weights_bytes(shell, dtype)


def memory_needs(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, weights_bytes: int) -> dict[str, int]:
    """What serving and training need at the least, in bytes: the weights, KV blocks for one
    full prompt chunk (`max_batched_tokens`), one such iteration's activations and logits, and
    the room for one training stage (`finetune_memory_bytes`)."""
    per_token, per_row = activation_sizes(cfg, dtype)
    chunk_blocks = -(-config.max_batched_tokens // config.block_size)
    return {
        "weights": weights_bytes,
        "kv_minimum": chunk_blocks * bytes_per_block(cfg, config.block_size, dtype),
        "activations": config.max_batched_tokens * per_token + config.max_num_seqs * per_row,
        "training_stage": config.finetune_memory_bytes,
    }


def check_memory_budget(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, weights_bytes: int,
                        available_bytes: int | None = None) -> None:
    """Raise `InsufficientMemory` when the budget is below `memory_needs`: the configured one
    (`memory_budget_bytes`), else, before any weight is read, `available_bytes` (the memory
    the system has free now); a model that cannot fit is refused with the figures instead of
    being loaded until the kernel kills the process."""
    budget, what = config.memory_budget_bytes, "the memory budget ({} MiB, engine.memory_budget_bytes)"
    if not budget:
        if available_bytes is None:
            return  # derived from what the engine holds: fits by construction
        budget, what = available_bytes, "the memory this machine has available ({} MiB, MemAvailable)"
    needs = memory_needs(config, cfg, dtype, weights_bytes)
    total = sum(needs.values())
    if budget < total:
        mib = 2**20
        raise InsufficientMemory(
            f"{what.format(f'{budget / mib:.0f}')} is below what serving this "
            f"model needs: {total / mib:.0f} MiB = weights {needs['weights'] / mib:.0f} MiB "
            f"({str(dtype).removeprefix('torch.')}) + KV cache minimum {needs['kv_minimum'] / mib:.1f} MiB (one "
            f"{config.max_batched_tokens}-token chunk) + one iteration's activations {needs['activations'] / mib:.1f} "
            f"MiB + one training stage {needs['training_stage'] / mib:.0f} MiB (finetune_memory_bytes); raise the "
            f"budget, or lower the dtype, max_batched_tokens, max_num_seqs or finetune_memory_bytes")


def available_memory_bytes() -> int:
    """Memory the system can give this process now (MemAvailable: free plus reclaimable)."""
    import psutil

    return int(psutil.virtual_memory().available)


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
                        costs: CostModel, backend: Backend, mapped: MappedWeights | None = None) -> int:
    """The ledger's budget until telemetry sets one: what the engine holds by construction
    (weights, the KV cache, the adapter cache, what the backend may hold), one full iteration's
    activations, and the configured room for fine-tuning."""
    if config.memory_budget_bytes:
        return config.memory_budget_bytes
    forward = (costs.inference_bytes(config.max_batched_tokens, False)
               + config.max_num_seqs * costs.logits_bytes_per_row)
    return (resident_weights_bytes(model, mapped) + cache.nbytes + adapters.cache.capacity_bytes
            + forward + config.finetune_memory_bytes + backend.reserved_bytes)
