"""A sequence's prefix-cache blocks: which cached blocks of its tokens it can reuse when admitted
(full blocks, and on row-invariant backends part of one more), which of its newly full blocks it
registers after a forward, and what it leaves cached when released. Hashes and the pool's calls
only; the scheduler decides when.
"""

from __future__ import annotations

from collections.abc import Callable
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
                 amount: int | None = None, copy_rows: Callable[[int, int, int], None] | None = None) -> None:
    """Reuse cached full blocks of this sequence's tokens (never its last two: the last must
    run through the model to produce logits, and a lone row would run as a decode row, whose
    attention ONNX Runtime rounds otherwise than a chunk's: #31): from the pool, else read back
    from the disk tier; blocks reused from the pool are handed to the tier to keep. With `amount`
    (the tokens the scheduler planned for its first chunk), a hit whose next grid chunk is longer
    than that gives its last blocks back, so the chunk still ends on the grid within its plan.

    With `copy_rows` (given only on backends whose rows are invariant, where a row's keys/values
    do not depend on how its prompt was chunked, so no grid is needed), reuse runs up to the
    prompt's last token, as llama.cpp's server does: full blocks, then the first rows of the
    cached block (full, or a finished sequence's kept tail) that shares the longest run with the
    next block's tokens, copied into a fresh block that this sequence goes on writing."""
    size = pool.block_size
    parent = None
    owner = seq.request.owner
    reused = []
    for i in range(max(0, seq.num_tokens - (1 if copy_rows else 2)) // size):
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
    if copy_rows is not None:
        _copy_partial_block(seq, pool, salt, parent, copy_rows)
    elif amount is not None:
        while seq.block_table and not grid_piece(seq.num_computed, min(amount, seq.num_tokens - seq.num_computed),
                                                 seq.num_tokens, size):
            pool.release(seq.block_table.pop())
            seq.block_hashes.pop()
            seq.num_computed -= size
    if tier is not None and reused:
        tier.remember(owner, reused)


def _copy_partial_block(seq: Sequence, pool: BlockPool, salt: str, parent: bytes | None,
                        copy_rows: Callable[[int, int, int], None]) -> None:
    """After the full-block hits: copy the rows the best donor shares with the next block's tokens
    (never the prompt's last token) into a fresh block."""
    start = seq.num_computed
    want = seq.token_ids[start : start + min(pool.block_size, seq.num_tokens - 1 - start)]
    if not want:
        return
    donor, rows = pool.best_donor(parent, salt, want, seq.request.owner)
    if rows == 0:
        return
    block = pool.copy_of(donor, rows, copy_rows)
    if block is not None:
        seq.block_table.append(block)
        seq.num_computed += rows


def release_blocks(seq: Sequence, pool: BlockPool, tail_salt: str | None = None) -> None:
    """Give a sequence's blocks back, tail first (the head of a prompt is the most shareable, so
    it is evicted last). With `tail_salt` (row-invariant backends), a partial last block of
    computed rows stays cached under it as a donor (`BlockPool.keep_tail`): a repeated prompt, or
    a chat's next turn resending this answer, copies its rows instead of computing them. Never
    from a sequence whose decode KV is pruned or compacted (those rows are not the tokens' own)."""
    size = pool.block_size
    last = seq.num_computed // size
    tail = seq.token_ids[last * size : seq.num_computed]
    keep = (tail_salt is not None and tail and seq.kv_pruning is None and seq.kv_layout is None
            and len(seq.block_hashes) == last < len(seq.block_table))
    for i in reversed(range(len(seq.block_table))):
        if keep and i == last:
            parent = seq.block_hashes[-1] if last else None
            pool.keep_tail(seq.block_table[i], parent, tail, tail_salt, seq.request.owner)
        else:
            pool.release(seq.block_table[i])
    seq.block_table = []
    seq.block_hashes = []
    seq.num_computed = 0
    seq.kv_layout = None  # a recompute writes every position whole again


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
        tokens = seq.token_ids[i * size : (i + 1) * size]
        h = block_hash(parent, tokens, salt)
        pool.register(seq.block_table[i], h, parent, tokens, salt)
        metrics = seq.request.metrics
        if metrics is not None and (i + 1) * size <= seq.num_prompt and pool.cached.get(h) == seq.block_table[i]:
            metrics.cache_write_tokens += size  # a prompt block this request put in the cache
        pool.claim(seq.block_table[i], seq.request.owner)
        seq.block_hashes.append(h)
