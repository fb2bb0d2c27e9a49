"""Per-sequence contiguous K/V rows for the ONNX Runtime backend's dense KV layout.

ONNX Runtime's GroupQueryAttention reads a past of shape [rows, kv_heads, capacity, head_dim] and
writes its present there too when both are the same buffer (only this step's keys/values are
stored, at each row's position; nothing is copied). The paged cache cannot be that buffer (its
layout is token-major and a sequence's blocks are scattered), so this module keeps one row per
running sequence in a float32 buffer owned by the backend, beside the paged cache:

* The paged cache stays the source of truth: every run's new keys/values are still written to
  their slots, so the prefix cache, preemption and the torch backend see what they always did.
* A row's positions [0, valid) hold the sequence's keys/values. Before a run, positions
  [valid, start) are copied from the paged cache (a prefix-cache hit, a row that missed steps);
  after it, valid = start + new tokens. A row whose sequence is no longer running is freed and
  the last row moves into the hole, so the rows in use are always [0, n).
* The buffer grows geometrically (rows and capacity) and never beyond `limit_bytes`; a run that
  would need more uses a scratch buffer filled from the paged cache for that run only.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from edge_runtime.kv.cache import KVCache
from edge_runtime.sequence import SeqStatus

CAPACITY_STEP = 64  # capacity is a multiple of this many positions
PER_TOKEN_COPY_MAX = 64  # copy_to_cache copies up to this many tokens one by one


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


class DenseKV:
    def __init__(self, cache: KVCache, limit_bytes: int | None, max_capacity: int) -> None:
        self.cache = cache
        layers, _, _, self.kv_heads, self.head_dim = cache.data.shape
        self.layers = layers
        self.limit_bytes = limit_bytes
        self.max_capacity = max_capacity
        self.buffer: torch.Tensor | None = None  # [layers, 2, rows, kv_heads, capacity, head_dim]
        self.owners: list = []  # the sequence of each used row; rows [0, len) are in use
        self.valid: list[int] = []  # positions of each row that hold its keys/values
        self.row_of: dict[int, int] = {}  # id(sequence) -> row

    # -- geometry -------------------------------------------------------------------------------

    @property
    def token_bytes(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 4

    @property
    def rows_capacity(self) -> int:
        return 0 if self.buffer is None else self.buffer.shape[2]

    @property
    def capacity(self) -> int:
        return 0 if self.buffer is None else self.buffer.shape[4]

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel() * 4

    def row_pointer(self, layer: int, kind: int, row: int) -> int:
        """Address of buffer[layer, kind, row] (the first row of a binding)."""
        assert self.buffer is not None
        rows, cap = self.rows_capacity, self.capacity
        offset = ((layer * 2 + kind) * rows + row) * self.kv_heads * cap * self.head_dim
        return self.buffer.data_ptr() + offset * 4

    def ensure(self, rows: int, capacity: int) -> bool:
        """Make room for rows [0, rows) of `capacity` positions; False if that would pass the
        byte limit (the caller then runs from a scratch buffer)."""
        if rows <= self.rows_capacity and capacity <= self.capacity:
            return True
        new_rows = max(rows, self.rows_capacity, min(2 * self.rows_capacity, rows + 8))
        new_cap = max(capacity, self.capacity)
        if capacity > self.capacity:
            new_cap = max(capacity, min(2 * self.capacity, self.max_capacity))
        new_cap = _round_up(new_cap, CAPACITY_STEP)
        if self.limit_bytes is not None and new_rows * new_cap * self.token_bytes > self.limit_bytes:
            # No spare rows or positions: exactly the rows in use (those a past growth added
            # beyond them would push a full cache past the limit into the scratch path).
            new_rows = max(rows, len(self.owners))
            new_cap = max(_round_up(capacity, CAPACITY_STEP), self.capacity)
            if new_rows * new_cap * self.token_bytes > self.limit_bytes:
                return False
        # Uninitialised on purpose: GroupQueryAttention reads only positions below each row's
        # context, which are always written first; untouched pages never cost memory or time.
        grown = torch.empty(self.layers, 2, new_rows, self.kv_heads, new_cap, self.head_dim,
                            dtype=torch.float32, device=self.cache.data.device)
        if self.buffer is not None and self.owners:
            n, cap = min(len(self.owners), self.rows_capacity), self.capacity
            grown[:, :, :n, :, :cap].copy_(self.buffer[:, :, :n])
        self.buffer = grown
        return True

    # -- rows -----------------------------------------------------------------------------------

    def release_stale(self, keep: Iterable[int]) -> None:
        """Free the rows of sequences that are no longer running (finished, preempted, or a
        cost-model probe), except those in `keep` (ids of this step's sequences)."""
        keep = set(keep)
        for row in range(len(self.owners) - 1, -1, -1):
            seq = self.owners[row]
            if id(seq) not in keep and getattr(seq, "status", None) is not SeqStatus.RUNNING:
                self._free(row)

    def _free(self, row: int) -> None:
        last = len(self.owners) - 1
        del self.row_of[id(self.owners[row])]
        if row != last:
            moved, n = self.owners[last], self.valid[last]
            if n:
                assert self.buffer is not None
                self.buffer[:, :, row, :, :n].copy_(self.buffer[:, :, last, :, :n])
            self.owners[row], self.valid[row] = moved, n
            self.row_of[id(moved)] = row
        self.owners.pop()
        self.valid.pop()

    def assign(self, seqs: Iterable) -> list[int]:
        """Each sequence's row; new sequences take the next free rows, in order."""
        rows = []
        for seq in seqs:
            row = self.row_of.get(id(seq))
            if row is None:
                row = len(self.owners)
                self.owners.append(seq)
                self.valid.append(0)
                self.row_of[id(seq)] = row
            rows.append(row)
        return rows

    def fill(self, row: int, block_table: list[int], start: int) -> None:
        """Make positions [0, start) of `row` hold the sequence's keys/values (copying what the
        row lacks from the paged cache); positions from `start` on are about to be written."""
        have = self.valid[row]
        if have < start:
            assert self.buffer is not None
            size = self.cache.block_size
            table = torch.tensor(block_table, dtype=torch.long)
            pos = torch.arange(have, start)
            slots = (table[pos // size] * size + pos % size).to(self.cache.data.device)
            src = self.cache.data.index_select(2, slots)  # [layers, 2, n, kv_heads, d]
            self.buffer[:, :, row, :, have:start].copy_(src.permute(0, 1, 3, 2, 4))
        self.valid[row] = start

    def copy_to_cache(self, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        """Copy the keys/values at (rows[i], positions[i]) to the paged cache's slots[i]."""
        assert self.buffer is not None
        data = self.cache.data
        if len(rows) <= PER_TOKEN_COPY_MAX and data.dtype == torch.float32 and data.device.type == "cpu":
            # A decode step's few tokens: one strided NumPy copy [layers, 2, kv_heads, d] each.
            # Right after a graph run (cold caches) this measured 2-3x cheaper than the
            # index_select + index_copy_ below at 1 stream and ~1.5x at 16.
            src, dst = self.buffer.numpy(), data.numpy()
            for row, pos, slot in zip(rows.tolist(), positions.tolist(), slots.tolist(), strict=True):
                dst[:, :, slot] = src[:, :, row, :, pos]
            return
        layers, heads, cap, d = self.layers, self.kv_heads, self.capacity, self.head_dim
        # One index_select over [layers * 2, rows * heads * capacity, d] (advanced indexing of
        # the 6-d buffer costs ~1 ms a step at 16 rows).
        flat = self.buffer.view(layers * 2, self.rows_capacity * heads * cap, d)
        index = (rows[:, None] * heads + np.arange(heads)[None, :]) * cap + positions[:, None]
        src = flat.index_select(1, torch.from_numpy(index.reshape(-1)).to(flat.device))
        src = src.view(layers, 2, len(rows), heads, d).to(data.dtype)
        data.index_copy_(2, torch.from_numpy(slots).to(data.device), src)
