"""The unified memory ledger: the one place that adds up the bytes the runtime holds (weights, KV
blocks, prefix-cache blocks, adapters, fine-tune activations, optimizer state) against a budget
that telemetry may move at run time. It decides what to shed and in which order; the owners of
the bytes (pool, adapter cache, trainer tasks, scheduler) do the freeing through shedders.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field


class MemoryKind(enum.Enum):
    WEIGHTS = "weights"
    KV = "kv"  # KV blocks referenced by sequences
    PREFIX_CACHE = "prefix_cache"  # free KV blocks that still hold a reusable prefix
    ADAPTERS = "adapters"  # cached LoRA versions for serving
    ACTIVATIONS = "activations"  # fine-tune activations held between forward and backward
    OPTIMIZER = "optimizer"  # trainable LoRA leaves, their gradients and AdamW moments


# docs/architecture.md, decision 3's shedding order: what goes first when the budget shrinks (after
# the relief step, KV pruning under kv_prune_when = "pressure"). Weights and optimizer state are
# not sheddable while their owners live.
SHED_ORDER: tuple[MemoryKind, ...] = (
    MemoryKind.ACTIVATIONS,
    MemoryKind.ADAPTERS,
    MemoryKind.PREFIX_CACHE,
    MemoryKind.KV,
)

# What gives way to fine-tune work itself (a job's next stage, a new trainer's optimizer state):
# idle adapters and the prefix cache, which are only caches. Never another job's activations
# (it would restart, and jobs shedding each other make no progress at all: issue #32), never
# serving streams, and not the relief step (its bytes come back only after a decode step).
FINETUNE_SHED_ORDER: tuple[MemoryKind, ...] = (MemoryKind.ADAPTERS, MemoryKind.PREFIX_CACHE)

Shedder = Callable[[int], int]  # (bytes wanted) -> bytes it freed (and removed from the ledger)


@dataclass
class ShedReport:
    """What one budget change (or reclaim) freed, per kind, and whether it was enough."""

    wanted_bytes: int = 0
    freed: dict[str, int] = field(default_factory=dict)
    promised_bytes: int = 0  # by the relief step: freed after the pruned streams' next step, not yet
    satisfied: bool = True  # freed + promised cover what was wanted

    @property
    def freed_bytes(self) -> int:
        return sum(self.freed.values())


class MemoryLedger:
    """Entries (kind, key) -> bytes, a budget, and a reservation for the running iteration's
    transient memory. `used = held + reserved` must stay <= `budget`; the scheduler asks `free`
    before packing anything, and `set_budget` sheds when the budget drops below what is held.
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError("a memory budget cannot be negative")
        self.budget = int(budget_bytes)
        self._entries: dict[MemoryKind, dict[str, int]] = {kind: {} for kind in MemoryKind}
        self._totals: dict[MemoryKind, int] = dict.fromkeys(MemoryKind, 0)
        self._held = 0
        self.reserved = 0
        self.peak_used = 0  # highest held + reserved since the budget was last set
        self._shedders: dict[MemoryKind, Shedder] = {}
        self._relief: Shedder | None = None
        self.sheds: list[ShedReport] = []

    # -- entries -----------------------------------------------------------------------------

    def set(self, kind: MemoryKind, key: str, nbytes: int) -> None:
        """Record that `key` of `kind` holds `nbytes` now (0 removes the entry)."""
        entries = self._entries[kind]
        delta = int(nbytes) - entries.get(key, 0)
        if nbytes:
            entries[key] = int(nbytes)
        else:
            entries.pop(key, None)
        self._totals[kind] += delta
        self._held += delta
        self._note_peak()

    def update(self, changes: list[tuple[MemoryKind, str, int]]) -> None:
        """Several entries at once, decreases first, so bytes moving between entries (a cached
        block taken by a sequence) never show as a passing peak."""
        entries = self._entries
        deltas = [(nbytes - entries[kind].get(key, 0), kind, key, nbytes) for kind, key, nbytes in changes]
        for _delta, kind, key, nbytes in sorted((d for d in deltas if d[0]), key=lambda d: d[0]):
            self.set(kind, key, nbytes)

    def drop(self, kind: MemoryKind, key: str) -> None:
        self.set(kind, key, 0)

    def held(self, kind: MemoryKind | None = None) -> int:
        return self._held if kind is None else self._totals[kind]

    def entries(self, kind: MemoryKind) -> dict[str, int]:
        return dict(self._entries[kind])

    @property
    def used(self) -> int:
        return self._held + self.reserved

    @property
    def free(self) -> int:
        """Bytes that may still be taken now (negative when over budget)."""
        return self.budget - self._held - self.reserved

    @property
    def floor(self) -> int:
        """Bytes no shedder can give back (weights, optimizer state)."""
        return self._held - sum(self._totals[k] for k in SHED_ORDER)

    # -- the running iteration's transient memory --------------------------------------------

    def reserve(self, nbytes: int) -> None:
        """Hold `nbytes` for work in flight (activations of the forward, a stage's peak)."""
        self.reserved += int(nbytes)
        self._note_peak()

    def release_reservation(self) -> None:
        self.reserved = 0

    def _note_peak(self) -> None:
        used = self._held + self.reserved
        if used > self.peak_used:
            self.peak_used = used

    # -- budget and shedding -----------------------------------------------------------------

    def register_shedder(self, kind: MemoryKind, shedder: Shedder) -> None:
        if kind not in SHED_ORDER:
            raise ValueError(f"{kind.value} memory cannot be shed")
        self._shedders[kind] = shedder

    def register_relief(self, relief: Shedder) -> None:
        """A step tried before SHED_ORDER that degrades work instead of dropping it: KV pruning
        turned on for running streams (kv_prune_when = "pressure"). It returns bytes it promises,
        given back once those streams have taken their next step, not now: `reclaim` counts them
        against what it wants, so nothing is shed for them, and reports them as promised."""
        self._relief = relief

    def set_budget(self, budget_bytes: int) -> ShedReport:
        """New budget (e.g. `MemoryBudget.ledger_capacity_bytes(ledger.held())` from telemetry);
        sheds in ARCHITECTURE.md order if what is held no longer fits."""
        self.budget = max(0, int(budget_bytes))
        report = self.reclaim(0)
        self.peak_used = self.used  # the watermark restarts under the new budget, after shedding
        return report

    def reclaim(self, extra_bytes: int, *, for_finetune: bool = False) -> ShedReport:
        """Shed until `extra_bytes` more would fit: the relief step's promise first (if one is
        registered), then SHED_ORDER, each kind only as far as needed. `for_finetune`: the bytes
        are for fine-tune work, which only FINETUNE_SHED_ORDER gives way to."""
        want = self.used + extra_bytes - self.budget
        report = ShedReport(wanted_bytes=max(0, want))
        if want > 0 and self._relief is not None and not for_finetune:
            report.promised_bytes = self._relief(want)
            want -= report.promised_bytes
        for kind in FINETUNE_SHED_ORDER if for_finetune else SHED_ORDER:
            if want <= 0:
                break
            shedder = self._shedders.get(kind)
            if shedder is None or self._totals[kind] == 0:
                continue
            before = self._held
            shedder(want)
            freed = before - self._held
            if freed:
                report.freed[kind.value] = freed
                want -= freed
        report.satisfied = want <= 0
        if report.wanted_bytes:
            self.sheds.append(report)
        return report

    def snapshot(self) -> dict[str, int]:
        """Bytes per kind plus budget/held/free, for stats and `macectl status`."""
        out = {f"{kind.value}_bytes": total for kind, total in self._totals.items()}
        out.update(budget_bytes=self.budget, held_bytes=self._held, free_bytes=self.free,
                   peak_used_bytes=self.peak_used)
        return out
