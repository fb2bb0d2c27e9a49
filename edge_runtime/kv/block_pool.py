"""Fixed-size KV blocks: allocation, reference counts, and the prefix cache over full blocks.

A full block is identified by a chain hash of (previous block's hash, its tokens, the adapter
that produced its keys/values). Freed blocks keep their hash and stay reusable until a new
allocation evicts them, least recently freed first; a cached block also records whose prompts it
holds, so an erasure drops it. Knows nothing about tensors or scheduling.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def block_hash(parent: bytes | None, tokens: Sequence[int], salt: str = "") -> bytes:
    """Chain hash of a full block; `salt` separates caches of different adapter versions."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(salt.encode())
    h.update(b",".join(str(t).encode() for t in tokens))
    return h.digest()


@dataclass
class PrefixCacheStats:
    queried_blocks: int = 0
    hit_blocks: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0


class BlockPool:
    """`num_blocks` blocks of `block_size` token slots each."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True,
                 on_idle: Callable[[list[int]], None] | None = None) -> None:
        """`on_idle(blocks)` hears of blocks that stopped holding anything (freed without a
        cached prefix, or evicted from the prefix cache), so their memory can be given back."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a block pool needs at least one block of at least one slot")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        # Cached blocks' owners: the users whose prompts registered or reused them (their data).
        self.owners: dict[int, set[str]] = {}
        # Free blocks in eviction order: never-used first, then least recently freed.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.stats = PrefixCacheStats()
        self.on_idle = on_idle

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a reusable prefix (evictable on demand)."""
        return sum(1 for b in self.free if self.hash_of[b] is not None)

    def allocate(self) -> int:
        if not self.free:
            raise RuntimeError("KV block pool exhausted (the scheduler must check num_free first)")
        block, _ = self.free.popitem(last=False)
        old = self.hash_of[block]
        if old is not None:
            if self.cached.get(old) == block:
                del self.cached[old]
            self.hash_of[block] = None
            self.owners.pop(block, None)
            self.stats.evictions += 1
        self.ref_count[block] = 1
        return block

    def release(self, block: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] < 0:
            raise RuntimeError(f"block {block} released more often than it was taken")
        if self.ref_count[block] == 0:
            if self.hash_of[block] is None:
                # Nothing reusable: hand it out before blocks that still cache a prefix.
                self.free[block] = None
                self.free.move_to_end(block, last=False)
                if self.on_idle is not None:
                    self.on_idle([block])
            else:
                self.free[block] = None

    def match(self, h: bytes) -> int | None:
        """Take a reference on the cached block with hash `h`, if any (counts toward hit rate)."""
        if not self.enable_prefix_cache:
            return None
        self.stats.queried_blocks += 1
        block = self.cached.get(h)
        if block is None:
            return None
        self.stats.hit_blocks += 1
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1
        return block

    def register(self, block: int, h: bytes) -> None:
        """Record that `block` is full and holds the prefix with hash `h`."""
        if not self.enable_prefix_cache or self.hash_of[block] is not None:
            return
        if h in self.cached:
            return  # an identical block is cached already; this one stays private
        self.hash_of[block] = h
        self.cached[h] = block

    def uncache(self, block: int) -> None:
        """Stop a held block caching its prefix, so its holder may write it (KV compaction with no
        free block to copy into)."""
        h = self.hash_of[block]
        if h is None:
            return
        if self.cached.get(h) == block:
            del self.cached[h]
        self.hash_of[block] = None
        self.owners.pop(block, None)
        self.stats.evictions += 1

    def claim(self, block: int, owner: str) -> None:
        """Record that `owner`'s prompt holds the cached block `block` (it registered or reused it)."""
        if owner and self.hash_of[block] is not None:
            self.owners.setdefault(block, set()).add(owner)

    def forget(self, owner: str) -> int:
        """Erase `owner` from the prefix cache: a cached block no other user's prompt holds stops
        being reusable (a free one is handed out first and its memory may be given back; a held
        one stays with its holders until they release it). Returns how many blocks left the cache."""
        if not owner:
            return 0
        dropped = []
        for block, owners in list(self.owners.items()):
            owners.discard(owner)
            if not owners:
                self.uncache(block)
                dropped.append(block)
        idle = [b for b in dropped if self.ref_count[b] == 0]
        for block in idle:
            self.free.move_to_end(block, last=False)
        if idle and self.on_idle is not None:
            self.on_idle(idle)
        return len(dropped)

    def evict_cached(self, count: int) -> int:
        """Drop up to `count` cached-but-free prefixes (memory pressure). Returns how many."""
        dropped = 0
        evicted = []
        for block in list(self.free):
            if dropped >= count:
                break
            h = self.hash_of[block]
            if h is None:
                continue
            if self.cached.get(h) == block:
                del self.cached[h]
            self.hash_of[block] = None
            self.owners.pop(block, None)
            self.stats.evictions += 1
            dropped += 1
            evicted.append(block)
        if evicted and self.on_idle is not None:
            self.on_idle(evicted)
        return dropped
