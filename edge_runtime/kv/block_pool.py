"""Fixed-size KV blocks: allocation, reference counts, and the prefix cache over full blocks and
finished sequences' partial last blocks ("tails").

A full block is identified by a chain hash of (previous block's hash, its tokens, the adapter
that produced its keys/values); a kept tail by a hash of its valid rows' tokens that no full block
can have. Freed blocks keep their hash and stay reusable until a new allocation evicts them, least
recently freed first; a cached block also records whose prompts it holds, so an erasure drops it.
Blocks cached with their tokens are donors: their first rows can be copied for a prompt that
shares only part of a block (`best_donor`). Knows nothing about tensors or scheduling.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def block_hash(parent: bytes | None, tokens: Sequence[int], salt: str = "", person: bytes = b"") -> bytes:
    """Chain hash of a full block; `salt` separates caches of different adapter versions; `person`
    separates kinds of key (`tail_hash`)."""
    h = hashlib.blake2b(digest_size=16, person=person)
    h.update(parent or b"root")
    h.update(salt.encode())
    h.update(b",".join(str(t).encode() for t in tokens))
    return h.digest()


def tail_hash(parent: bytes | None, tokens: Sequence[int], salt: str = "") -> bytes:
    """A kept tail's key: its own personalisation, so it never equals a full block's hash."""
    return block_hash(parent, tokens, salt, b"mace-kv-tail")


def common_rows(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class PrefixCacheStats:
    queried_blocks: int = 0
    hit_blocks: int = 0
    evictions: int = 0
    partial_hits: int = 0  # prompts that copied the first rows of a donor block
    partial_rows: int = 0  # ... and how many rows they copied in all

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"prefix_cache_hit_rate": round(self.hit_rate, 4), "prefix_cache_hit_blocks": self.hit_blocks,
                "prefix_cache_queried_blocks": self.queried_blocks, "prefix_cache_partial_hits": self.partial_hits,
                "prefix_cache_partial_rows": self.partial_rows}


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
        # Donors: cached blocks whose tokens are known, by (parent hash, salt) -> {block: tokens}
        # (a full block's 16, a tail's valid rows'), so a prompt sharing part of a block finds them.
        self.donors: dict[tuple[bytes | None, str], dict[int, tuple[int, ...]]] = {}
        self._donor_key: dict[int, tuple[bytes | None, str]] = {}
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
        self._drop(block)
        self.ref_count[block] = 1
        return block

    def _drop(self, block: int) -> bool:
        """Make `block` cache nothing (it keeps its place in the free list); whether it did."""
        old = self.hash_of[block]
        if old is None:
            return False
        if self.cached.get(old) == block:
            del self.cached[old]
        self.hash_of[block] = None
        self.owners.pop(block, None)
        key = self._donor_key.pop(block, None)
        if key is not None:
            group = self.donors[key]
            del group[block]
            if not group:
                del self.donors[key]
        self.stats.evictions += 1
        return True

    def _index_donor(self, block: int, parent: bytes | None, tokens: Sequence[int], salt: str) -> None:
        key = (parent, salt)
        self.donors.setdefault(key, {})[block] = tuple(tokens)
        self._donor_key[block] = key

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

    def register(self, block: int, h: bytes, parent: bytes | None = None, tokens: Sequence[int] | None = None,
                 salt: str = "") -> None:
        """Record that `block` is full and holds the prefix with hash `h`; with its `tokens` (and the
        `parent` and `salt` `h` was made of) it is also a donor of its first rows."""
        if not self.enable_prefix_cache or self.hash_of[block] is not None:
            return
        if h in self.cached:
            return  # an identical block is cached already; this one stays private
        self.hash_of[block] = h
        self.cached[h] = block
        if tokens is not None:
            self._index_donor(block, parent, tokens, salt)

    def keep_tail(self, block: int, parent: bytes | None, tokens: Sequence[int], salt: str, owner: str) -> None:
        """Release a finished sequence's partial last block, whose first `len(tokens)` rows hold
        those tokens' keys/values after the prefix `parent`: it stays cached as a donor (its
        memory is kept, not given back) until evicted like a freed full block. An identical tail
        cached already makes this one a plain release."""
        h = tail_hash(parent, tokens, salt)
        if self.enable_prefix_cache and tokens and self.ref_count[block] == 1 and self.hash_of[block] is None \
                and h not in self.cached:
            self.hash_of[block] = h
            self.cached[h] = block
            self._index_donor(block, parent, tokens, salt)
            self.claim(block, owner)
        self.release(block)

    def best_donor(self, parent: bytes | None, salt: str, tokens: Sequence[int], owner: str) -> tuple[int, int]:
        """(block, rows): the cached donor after `parent` under `salt` whose tokens share the longest
        run with `tokens`, and the length of that run ((-1, 0): none). Only donors no other user's
        prompt holds: a hit on part of a block would let a timing probe read another user's
        prompt a token at a time (a full block takes a guess of all its tokens)."""
        best, rows = -1, 0
        if not self.enable_prefix_cache:
            return best, rows
        for block, held in self.donors.get((parent, salt), {}).items():
            owners = self.owners.get(block)
            if owners and owner not in owners:
                continue
            n = common_rows(held, tokens)
            if n > rows:
                best, rows = block, n
        return best, rows

    def copy_of(self, donor: int, rows: int, copy_rows: Callable[[int, int, int], None]) -> int | None:
        """A freshly allocated block whose first `rows` rows `copy_rows(donor, block, rows)` copied
        from `donor` (which stays cached as it was, and counts as just used); None if no block is
        free but the donor."""
        if self.ref_count[donor] == 0:
            del self.free[donor]  # so the allocation cannot evict it
        self.ref_count[donor] += 1
        block = self.allocate() if self.free else None
        if block is not None:
            copy_rows(donor, block, rows)
            self.stats.partial_hits += 1
            self.stats.partial_rows += rows
        self.release(donor)
        return block

    def uncache(self, block: int) -> None:
        """Stop a held block caching its prefix, so its holder may write it (KV compaction with no
        free block to copy into)."""
        self._drop(block)

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
            if not self._drop(block):
                continue
            dropped += 1
            evicted.append(block)
        if evicted and self.on_idle is not None:
            self.on_idle(evicted)
        return dropped
