"""A sequence's prefix-cache blocks: which cached full blocks of its tokens it can reuse when
admitted, and which of its newly full blocks it registers after a forward. Hashes and the pool's
match/register only; the scheduler decides when.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edge_runtime.kv.block_pool import BlockPool, block_hash
from edge_runtime.sched.bins import grid_piece
from edge_runtime.sequence import Sequence

if TYPE_CHECKING:
    from edge_runtime.kv.prefix_tier import PrefixTier


def cache_salt(seq: Sequence, rope_switch: int | None) -> str:
    """What separates prefix-cache blocks of the same tokens with different keys/values: the
    adapter version, and which LongRoPE factors the sequence is computed with."""
    salt = seq.request.cache_salt
    if rope_switch is not None and seq.num_tokens > rope_switch:
        salt += "#rope-long"
    return salt


def match_prefix(seq: Sequence, pool: BlockPool, salt: str, tier: PrefixTier | None = None,
                 amount: int | None = None) -> None:
    """Reuse cached full blocks of this sequence's tokens (never its last two: the last must
    run through the model to produce logits, and a lone row would run as a decode row, whose
    attention ONNX Runtime rounds otherwise than a chunk's: #31): from the pool, else read back
    from the disk tier; blocks reused from the pool are handed to the tier to keep. With `amount`
    (the tokens the scheduler planned for its first chunk), a hit whose next grid chunk is longer
    than that gives its last blocks back, so the chunk still ends on the grid within its plan."""
    size = pool.block_size
    parent = None
    owner = seq.request.owner
    reused = []
    for i in range(max(0, seq.num_tokens - 2) // size):
        tokens = seq.token_ids[i * size : (i + 1) * size]
        h = block_hash(parent, tokens, salt)
        block = pool.match(h)
        if block is not None:
            reused.append((block, h, parent, tokens, salt))
        elif tier is not None:
            block = tier.restore(owner, h, parent, tokens, salt)
        if block is None:
            break
        pool.claim(block, owner)
        seq.block_table.append(block)
        seq.block_hashes.append(h)
        seq.num_computed += size
        parent = h
    if amount is not None:
        while seq.block_table and not grid_piece(seq.num_computed, min(amount, seq.num_tokens - seq.num_computed),
                                                 seq.num_tokens, size):
            pool.release(seq.block_table.pop())
            seq.block_hashes.pop()
            seq.num_computed -= size
    if tier is not None and reused:
        tier.remember(owner, reused)


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
        metrics = seq.request.metrics
        if metrics is not None and (i + 1) * size <= seq.num_prompt and pool.cached.get(h) == seq.block_table[i]:
            metrics.cache_write_tokens += size  # a prompt block this request put in the cache
        pool.claim(seq.block_table[i], seq.request.owner)
        seq.block_hashes.append(h)
