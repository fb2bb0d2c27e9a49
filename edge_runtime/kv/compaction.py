"""Compaction of a pruned sequence's KV: its retained (layer, KV head, position) entries packed into
as few of its blocks as they need, the blocks left holding nothing given back to the pool. Owns
where each entry lies (`CompactLayout`); knows blocks and the slab, not the scheduler or the rule
that decided what is retained (edge_runtime.kv.pruning).

Entries. Layer l's keys (and values) are rows `slot * kv_heads + lane` of `k_cache(l).view(-1, d)`.
A block holds `block_size * kv_heads` entries of every layer, so a sequence's block table gives
each layer the same entry space: its entry j lies in block `table[j // E]`, row
`table[j // E] * E + j % E` (E = block_size * kv_heads). Keys are cached already rotated, so an
entry means the same wherever it lies; only the decode gather must know where.

Layout. Positions below `base_pos` are compacted: each retained entry at `entry[l, h, p]`;
position p >= base_pos lies whole (every lane, every layer) in the table's slot
`base_slot + p - base_pos`, as every position of a sequence never compacted does (base 0, 0).
A layer's packed entries go in position-major order; the sum over layers is what the budget
bounds, the largest layer is what the blocks must hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from edge_runtime.kv.block_pool import BlockPool
from edge_runtime.kv.cache import KVCache


@dataclass
class CompactLayout:
    base_pos: int  # positions below it are compacted
    base_slot: int  # the table slot of position base_pos (and of each later one, in order)
    entry: Tensor  # [layers, kv_heads, base_pos] long: table entry of each retained entry; -1: none

    @property
    def slots_saved(self) -> int:
        """Cache slots the sequence holds fewer than its positions (what the scheduler counts)."""
        return self.base_pos - self.base_slot


def table_slots(block_table: list[int], block_size: int) -> Tensor:
    """The slot of each of the table's slot indices, in order."""
    offsets = torch.arange(block_size)
    return (torch.tensor(block_table, dtype=torch.long)[:, None] * block_size + offsets).view(-1)


def position_slots(layout: CompactLayout | None, block_table: list[int], block_size: int) -> Tensor:
    """The slot holding each position whole (keys written there, uncompacted). Compacted positions
    get the table's first slot, a placeholder: their entries are found through `entry_rows`."""
    slots = table_slots(block_table, block_size)
    if layout is None or layout.base_pos == 0:
        return slots
    return torch.cat([slots[:1].expand(layout.base_pos), slots[layout.base_slot :]])


def entry_rows(layout: CompactLayout | None, block_table: list[int], n: int, block_size: int,
               num_layers: int, kv_heads: int) -> Tensor:
    """[layers, kv_heads, n] long: the row of `k_cache(l).view(-1, d)` holding each (l, h, p) for
    positions 0..n-1. A compacted entry no longer retained points at row 0 (masked anyway: the
    decode gather must only stay inside the slab)."""
    per_block = block_size * kv_heads
    lanes = torch.arange(kv_heads)
    base = 0 if layout is None else min(layout.base_pos, n)
    slots = position_slots(layout, block_table, block_size)[base:n]
    whole = (slots[None, :] * kv_heads + lanes[:, None]).expand(num_layers, kv_heads, n - base)
    if base == 0:
        return whole
    table = torch.tensor(block_table, dtype=torch.long)
    j = layout.entry[:, :, :base]
    present = j >= 0
    j = j.clamp(min=0)
    packed = torch.where(present, table[j // per_block] * per_block + j % per_block, 0)
    return torch.cat([packed, whole], dim=-1)


@dataclass
class Compaction:
    layout: CompactLayout
    block_table: list[int]
    released: list[int]  # blocks the sequence no longer holds (given back unless shared or cached)
    allocated: int  # fresh blocks taken to copy entries out of blocks it must not write


def compact(layout: CompactLayout | None, retained: Tensor, block_table: list[int], pool: BlockPool,
            cache: KVCache) -> Compaction | None:
    """Pack the retained entries of positions 0..n-1 (retained: [layers, kv_heads, n] bool) into
    the lowest entries of blocks the sequence alone holds, and release every block then unused.
    Returns None, changing nothing, when that would not leave the pool with at least one more
    free block.

    Blocks another sequence shares (ref count > 1: a prefix-cache hit) are never written: their
    entries stay where they are (the block stays in the table while it holds one). A block that
    caches a prefix but only this sequence holds is never written either: its entries are copied
    out and it goes back to the pool, still caching its prefix."""
    layers, kv_heads, n = retained.shape
    size = pool.block_size
    per_block = size * kv_heads
    rows = entry_rows(layout, block_table, n, size, layers, kv_heads)
    block_of = rows // per_block  # the block each entry lies in
    shared = [b for b in block_table if pool.ref_count[b] > 1]
    shared_set = torch.tensor(shared, dtype=torch.long)
    stays = retained & torch.isin(block_of, shared_set) if shared else torch.zeros_like(retained)
    kept = [b for b in shared if bool((stays & (block_of == b)).any())]
    moves = retained & ~stays
    # Position-major order: entries never move up, and a layer that prunes nothing keeps its slots.
    moving = [moves[layer].t().nonzero() for layer in range(layers)]  # [(p, h)] per layer
    most = max(len(m) for m in moving)
    dest_blocks = -(-most // per_block)
    writable = [b for b in block_table if pool.ref_count[b] == 1 and pool.hash_of[b] is None]
    fresh = max(0, dest_blocks - len(writable))
    dest = writable[:dest_blocks]
    released = [b for b in block_table if b not in kept and b not in dest]
    freed = sum(1 for b in released if pool.ref_count[b] == 1)
    if freed - fresh < 1 or fresh > pool.num_free:
        return None
    dest += [pool.allocate() for _ in range(fresh)]
    table = kept + dest
    index_of = {b: i for i, b in enumerate(table)}

    entry = torch.full((layers, kv_heads, n), -1, dtype=torch.long)
    if kept:
        remap = torch.zeros(pool.num_blocks, dtype=torch.long)
        remap[shared_set] = torch.tensor([index_of.get(b, 0) for b in shared], dtype=torch.long)
        in_place = remap[block_of] * per_block + rows % per_block
        entry = torch.where(stays, in_place, entry)
    first = len(kept) * per_block
    dest_t = torch.tensor(dest, dtype=torch.long)
    for layer, found in enumerate(moving):
        if not len(found):
            continue
        p, h = found[:, 0], found[:, 1]
        rank = torch.arange(len(found))
        entry[layer, h, p] = first + rank
        src = rows[layer, h, p]
        dst = dest_t[rank // per_block] * per_block + rank % per_block
        if torch.equal(src, dst):
            continue
        device = cache.data.device
        src, dst = src.to(device), dst.to(device)
        for kind in (0, 1):
            flat = cache.data[layer, kind].view(-1, cache.data.shape[-1])
            # Gathered whole before written: a destination may be another entry's source.
            flat.index_copy_(0, dst, flat.index_select(0, src))
    base_slot = len(kept) * size + -(-most // kv_heads)
    for block in released:
        pool.release(block)  # after the copies: a block given back reads as zeros
    return Compaction(CompactLayout(n, base_slot, entry), table, released, fresh)
