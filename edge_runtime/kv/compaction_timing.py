"""When a pruned stream's KV gets compacted (edge_runtime.kv.compaction does the packing): before
it needs another block, and at its first decode step and every `block_size` steps after when
that would free a block. Reads the running sequences; decides nothing about what is retained.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from edge_runtime.kv.block_pool import BlockPool
from edge_runtime.kv.cache import KVCache
from edge_runtime.kv.compaction import compact
from edge_runtime.sequence import Sequence


def compact_due(running: Iterable[Sequence], blocks_needed: Callable[[Sequence, int], int], pool: BlockPool,
                cache: KVCache, layers: int, kv_heads: int) -> int:
    """Compact every running pruned stream that is due; returns how many were compacted.

    A pruned stream about to need another block first packs what its heads retain into the
    blocks that holds and gives the rest back, so the scheduler and the ledger count the
    budget's share of its KV, not every position's. One never compacted (or recomputed after a
    preemption, every position whole again) also tries at its first decode step and every
    `block_size` steps after (a try that frees nothing costs a few ms). Any sequence with a
    pruning state, whether the engine's settings gave it one or not."""
    compacted = 0
    for seq in running:
        state = seq.kv_pruning
        if state is None or seq.in_prefill or not state.length:
            continue
        due = blocks_needed(seq, 1) > 0
        if not due and (seq.kv_layout is not None or (state.steps - 1) % pool.block_size):
            continue
        n = seq.num_computed
        retained = torch.ones(layers, kv_heads, n, dtype=torch.bool)
        seen = min(state.length, n)  # positions its decode steps have not seen yet are all retained
        retained[:, :, :seen] = state.retained[:, :, :seen].cpu()
        if not due and n - -(-int(retained.sum()) // (layers * kv_heads)) < pool.block_size:
            continue
        done = compact(seq.kv_layout, retained, seq.block_table, pool, cache)
        if done is not None:
            seq.kv_layout, seq.block_table = done.layout, done.block_table
            compacted += 1
    return compacted
