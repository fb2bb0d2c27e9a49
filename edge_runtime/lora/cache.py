"""In-memory cache of adapter versions with Chameleon's cost-aware eviction.

Chameleon (sec. 4.1) scores each idle adapter by frequency, recency and size with weights
F=0.45, R=0.10, S=0.45 and evicts the lowest score first; adapters in use (pinned) are never
evicted. Knows bytes and pins, not files: the registry loads on a miss.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

FREQUENCY_WEIGHT = 0.45
RECENCY_WEIGHT = 0.10
SIZE_WEIGHT = 0.45


@dataclass
class CacheEntry(Generic[V]):
    value: V
    nbytes: int
    hits: int = 0
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class AdapterCache(Generic[K, V]):
    """Holds at most `capacity_bytes` of idle entries; pinned entries may push it over (running
    requests must keep their adapter), and are evicted only once unpinned."""

    def __init__(self, capacity_bytes: int, is_pinned: Callable[[K], bool], clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity_bytes = capacity_bytes
        self._is_pinned = is_pinned
        self._clock = clock
        self._entries: dict[K, CacheEntry[V]] = {}
        self.stats = CacheStats()

    def __contains__(self, key: K) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[K]:
        return list(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def get(self, key: K, load: Callable[[], tuple[V, int]]) -> V:
        """The cached value, or `load()` -> (value, nbytes) inserted after making room."""
        entry = self._entries.get(key)
        if entry is not None:
            self.stats.hits += 1
            entry.hits += 1
            entry.last_used = self._clock()
            return entry.value
        self.stats.misses += 1
        value, nbytes = load()
        self.put(key, value, nbytes)
        return value

    def put(self, key: K, value: V, nbytes: int) -> None:
        self._entries[key] = CacheEntry(value, nbytes, hits=1, last_used=self._clock())
        self.shrink(self.capacity_bytes, keep=key)

    def discard(self, key: K) -> None:
        self._entries.pop(key, None)

    def resize(self, capacity_bytes: int) -> int:
        """Set a new capacity (the memory ledger grows or shrinks it); returns bytes freed."""
        self.capacity_bytes = capacity_bytes
        return self.shrink(capacity_bytes)

    def shrink(self, target_bytes: int, keep: K | None = None) -> int:
        """Evict idle entries, lowest Chameleon score first, until at most `target_bytes` remain
        (or only pinned entries and `keep` are left). Returns the bytes freed."""
        freed = 0
        total = self.nbytes
        while total > target_bytes:
            idle = [k for k in self._entries if k != keep and not self._is_pinned(k)]
            if not idle:
                break
            victim = min(idle, key=self._score_fn(idle))
            size = self._entries.pop(victim).nbytes
            self.stats.evictions += 1
            freed += size
            total -= size
        return freed

    def _score_fn(self, keys: list[K]) -> Callable[[K], float]:
        entries = [self._entries[k] for k in keys]
        max_hits = max(e.hits for e in entries) or 1
        max_size = max(e.nbytes for e in entries) or 1
        now = self._clock()
        oldest = min(e.last_used for e in entries)
        span = (now - oldest) or 1.0

        def score(k: K) -> float:
            e = self._entries[k]
            recency = 1.0 - (now - e.last_used) / span  # 1 = just used, 0 = the stalest
            # Larger adapters cost more to reload, so size raises the score (kept longer).
            return (FREQUENCY_WEIGHT * e.hits / max_hits + RECENCY_WEIGHT * recency
                    + SIZE_WEIGHT * e.nbytes / max_size)

        return score
