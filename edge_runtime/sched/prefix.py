"""A sequence's prefix-cache blocks: which cached full blocks of its tokens it can reuse when
admitted, and which of its newly full blocks it registers after a forward. Hashes and the pool's
match/register only; the scheduler decides when.
"""

from __future__ import annotations

from edge_runtime.kv.block_pool import BlockPool, block_hash
from edge_runtime.sequence import Sequence


def cache_salt(seq: Sequence, rope_switch: int | None) -> str:
    """What separates prefix-cache blocks of the same tokens with different keys/values: the
    adapter version, and which LongRoPE factors the sequence is computed with."""
    salt = seq.request.cache_salt
    if rope_switch is not None and seq.num_tokens > rope_switch:
        salt += "#rope-long"
    return salt


def match_prefix(seq: Sequence, pool: BlockPool, salt: str, grid: int = 1) -> None:
    """Reuse cached full blocks of this sequence's tokens (never its last token: that one
    must run through the model to produce logits), up to the last point that is both a block
    boundary and a multiple of the chunk `grid`: the rest of the prompt is then computed in the
    same chunks as a request that found nothing cached."""
    size = pool.block_size
    hashes: list[bytes] = []
    parent = None
    for i in range((seq.num_tokens - 1) // size):
        parent = block_hash(parent, seq.token_ids[i * size : (i + 1) * size], salt)
        if not pool.is_cached(parent):
            pool.match(parent)  # counts the miss toward the hit rate, as a lookup does
            break
        hashes.append(parent)
    while hashes and len(hashes) * size % grid:
        hashes.pop()
    for h in hashes:
        block = pool.match(h)
        assert block is not None  # is_cached said so, and nothing ran in between
        seq.block_table.append(block)
        seq.block_hashes.append(h)
        seq.num_computed += size


def register_full_blocks(seq: Sequence, pool: BlockPool, salt: str) -> None:
    """Register the sequence's computed full blocks not yet in the prefix cache."""
    size = pool.block_size
    full = seq.num_computed // size
    if seq.kv_pruning is not None:
        # Its decode blocks get compacted (edge_runtime.kv.compaction): only its prompt's
        # blocks keep the prefix's keys and values.
        full = min(full, seq.num_prompt // size)
    while len(seq.block_hashes) < full:
        i = len(seq.block_hashes)
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        h = block_hash(parent, seq.token_ids[i * size : (i + 1) * size], salt)
        pool.register(seq.block_table[i], h)
        seq.block_hashes.append(h)
