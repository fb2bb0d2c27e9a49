"""Compaction of a pruned sequence's KV: its retained (layer, KV head, position) entries packed into
as few of its blocks as they need, the blocks left holding nothing given back to the pool. Owns
where each entry lies (`CompactLayout`); knows blocks and the slab, not the scheduler or the rule
that decided what is retained (edge_runtime.kv.pruning).

Entries. The slab `[layer, k/v, slot, kv_head, d]` seen as rows of d: layer l's key of lane h in
slot s is row `((2 l) S + s) H + h` (S slots, H KV heads), its value the row `S H` after. A block
holds `block_size` slots of every layer, so `layers x block_size x kv_heads` entries, and any of
them can hold any (layer, head, position)'s key and value: keys are cached already rotated, so an
entry means the same wherever it lies; only the decode gather must know where. Packing across
layers matters because MACE shares C_total among the heads of all layers by their norms (sec.
4.3): one layer may keep nearly its whole context while another keeps a few positions, and only
the sum is what the budget bounds.

Layout. Positions below `base_pos` are compacted: each retained entry's key at slab row
`rows[l, h, p]` (in a block of the table's first ones, which stay where they are until the next
compaction, so the rows need no recomputing per step); position p >= base_pos lies whole (every
lane, every layer) in the table's slot `base_slot + p - base_pos`, as every position of a
sequence never compacted does (base 0, 0).
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
    rows: Tensor  # [layers, kv_heads, base_pos] long: slab row of each retained entry's key; 0: none

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


def slab_row(slot: Tensor, plane: Tensor | int, lane: Tensor | int, num_slots: int, kv_heads: int) -> Tensor:
    """The row of the slab seen as rows of d holding the key of `lane` in `slot` of layer `plane`
    (its value: the row `num_slots * kv_heads` after)."""
    return ((2 * plane) * num_slots + slot) * kv_heads + lane


def entry_rows(layout: CompactLayout | None, block_table: list[int], n: int, block_size: int,
               num_layers: int, kv_heads: int, num_slots: int) -> Tensor:
    """[layers, kv_heads, n] long: the slab row (`slab_row`) of the key of each (l, h, p) for
    positions 0..n-1. A compacted entry no longer retained points at row 0 (masked anyway: the
    decode gather must only stay inside the slab)."""
    lanes = torch.arange(kv_heads)
    planes = torch.arange(num_layers)
    base = 0 if layout is None else min(layout.base_pos, n)
    slots = position_slots(layout, block_table, block_size)[base:n]
    whole = slab_row(slots[None, None, :], planes[:, None, None], lanes[None, :, None], num_slots, kv_heads)
    if base == 0:
        return whole
    return torch.cat([layout.rows[:, :, :base], whole], dim=-1)


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
    Returns None, changing nothing, when that would leave the pool with no more free blocks than
    before and would drop no reference to a shared block.

    Blocks another sequence shares (ref count > 1: a prefix-cache hit) are never written: their
    entries stay where they are (the block stays in the table while it holds one). A block that
    caches a prefix but only this sequence holds is copied out of and goes back to the pool, still
    caching its prefix, while the pool has free blocks to copy into; when it has too few, such
    blocks stop caching their prefix (`BlockPool.uncache`) and take entries instead."""
    layers, kv_heads, n = retained.shape
    size = pool.block_size
    num_slots = cache.data.shape[2]
    per_slot = layers * kv_heads  # entries in one slot of every layer
    rows = entry_rows(layout, block_table, n, size, layers, kv_heads, num_slots)
    block_of = (rows // kv_heads) % num_slots // size  # the block each entry lies in
    shared = [b for b in block_table if pool.ref_count[b] > 1]
    shared_set = torch.tensor(shared, dtype=torch.long)
    stays = retained & torch.isin(block_of, shared_set) if shared else torch.zeros_like(retained)
    holding = set(block_of[stays].unique().tolist())
    kept = [b for b in shared if b in holding]
    moves = retained & ~stays
    # Position-major, then layer, then head: the oldest positions lowest, whatever their layer.
    moving = moves.permute(2, 0, 1).nonzero()  # [(p, l, h)]
    dest_blocks = -(-len(moving) // (per_slot * size))
    writable = [b for b in block_table if pool.ref_count[b] == 1 and pool.hash_of[b] is None]
    short = dest_blocks - len(writable) - pool.num_free
    # No free block to copy into (memory pressure): blocks only this sequence holds stop caching
    # their prefix and take entries, rather than nothing being given back. The chain's last ones
    # first: a prefix is matched from its first block, so its head stays reusable.
    own_cached = [b for b in block_table if pool.ref_count[b] == 1 and pool.hash_of[b] is not None]
    uncache = own_cached[::-1][: max(0, short)]
    writable += uncache
    fresh = max(0, dest_blocks - len(writable))
    dest = writable[:dest_blocks]
    staying = set(kept) | set(dest)
    released = [b for b in block_table if b not in staying]
    freed = sum(1 for b in released if pool.ref_count[b] == 1)
    # Dropping a shared block's reference frees nothing now, but its memory goes once the other
    # sequence ends; worth a compaction that takes no fresh block.
    if fresh > pool.num_free or freed - fresh < (0 if released and not fresh else 1):
        return None
    for block in uncache:
        pool.uncache(block)
    dest += [pool.allocate() for _ in range(fresh)]
    # Entries left in shared blocks keep their rows; the others get the rows they move to.
    packed = torch.where(stays, rows, 0)
    if len(moving):
        p, layer, h = moving[:, 0], moving[:, 1], moving[:, 2]
        rank = torch.arange(len(moving))
        dest_t = torch.tensor(dest, dtype=torch.long)
        dest_slot = dest_t[rank // per_slot // size] * size + rank // per_slot % size
        src = rows[layer, h, p]
        dst = slab_row(dest_slot, rank % per_slot // kv_heads, rank % kv_heads, num_slots, kv_heads)
        packed[layer, h, p] = dst
        if not torch.equal(src, dst):
            device = cache.data.device
            value = num_slots * kv_heads  # a key's row to its value's
            src = torch.cat([src, src + value]).to(device)
            dst = torch.cat([dst, dst + value]).to(device)
            flat = cache.data.view(-1, cache.data.shape[-1])
            # Gathered whole before written: a destination may be another entry's source.
            flat.index_copy_(0, dst, flat.index_select(0, src))
    base_slot = len(kept) * size + -(-len(moving) // per_slot)
    for block in released:
        pool.release(block)  # after the copies: a block given back reads as zeros
    return Compaction(CompactLayout(n, base_slot, packed), kept + dest, released, fresh)
