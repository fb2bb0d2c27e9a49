"""The KV cache tensors: one slab per layer, addressed by flat slot = block * block_size + offset.

Sized from a byte budget. On CPU the slab's pages become resident only when a block is first
written and are given back when the pool says a block holds nothing (`release_blocks`), so
resident memory follows the ledger's KV and prefix-cache entries (blocks in use or caching a
prefix), not the slab's size.
"""

from __future__ import annotations

import math
import mmap

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
        # On a GPU one block past the pool's, owned by no sequence: rows that pad a replayed CUDA
        # graph's batch write and read there (edge_runtime.backends.cuda_graphs).
        self.scratch_block = num_blocks if torch.device(device).type != "cpu" else None
        slots = (num_blocks + (self.scratch_block is not None)) * block_size
        # [layer, k/v, slot, kv_head, head_dim]: a token's K (or V) for one layer is contiguous.
        shape = (cfg.num_layers, 2, slots, cfg.num_kv_heads, cfg.head_dim)
        self._pages: mmap.mmap | None = None
        if torch.device(device).type == "cpu":
            # Anonymous memory reads as zeros and costs nothing until written (torch.zeros
            # would make every page resident at once: measured 256 MiB held by an idle engine
            # whose ledger counted none of it).
            elem = torch.empty((), dtype=dtype).element_size()
            self._pages = mmap.mmap(-1, max(1, math.prod(shape) * elem), flags=mmap.MAP_PRIVATE)
            self.data = torch.frombuffer(self._pages, dtype=dtype, count=math.prod(shape)).view(shape)
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=device)
        # Every layer's K and V views made once: a forward asks for them in every layer.
        self._layers = [(self.data[i, 0], self.data[i, 1]) for i in range(cfg.num_layers)]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def release_blocks(self, blocks: list[int]) -> None:
        """Give the pages of blocks that hold nothing back to the OS; they read as zeros again
        (as at start) and become resident when next written. Pages a block shares with a
        neighbour stay. No-op off CPU."""
        if self._pages is None:
            return
        page = mmap.PAGESIZE
        layers, kinds, slots = self.data.shape[:3]
        slot_bytes = self.data[0, 0, 0].numel() * self.data.element_size()
        span = self.block_size * slot_bytes
        for block in blocks:
            for plane in range(layers * kinds):
                start = (plane * slots + block * self.block_size) * slot_bytes
                lo, hi = -(-start // page) * page, (start + span) // page * page
                if hi > lo:
                    self._pages.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def copy_rows(self, src: int, dst: int, rows: int) -> None:
        """Copy the first `rows` slots of block `src` into block `dst`, every layer's K and V (a
        prompt reusing part of a cached block writes its next rows into a copy, never the donor)."""
        s, d = src * self.block_size, dst * self.block_size
        self.data[:, :, d : d + rows] = self.data[:, :, s : s + rows]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[index]
