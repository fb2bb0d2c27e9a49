"""The KV cache tensors: one slab per layer, addressed by flat slot = block * block_size + offset.

Sized from a byte budget; the memory ledger accounts for the slab as one entry.
"""

from __future__ import annotations

import torch

from edge_runtime.model.config import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class KVCache:
    def __init__(
        self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str | torch.device
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        slots = num_blocks * block_size
        # [layer, k/v, slot, kv_head, head_dim]: a token's K (or V) for one layer is contiguous.
        self.data = torch.zeros(cfg.num_layers, 2, slots, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index, 0], self.data[index, 1]
