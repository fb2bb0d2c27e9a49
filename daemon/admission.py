"""Admission control: normal -> shed fine-tuning -> queue -> reject, from live pressure signals.

A pure state machine fed numbers (memory headroom, GPU/EMC load, temperature, power, queue
length) and a clock. It decides and explains; it never touches the engine, ledger or sockets.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any, Literal

from edge_runtime.errors import AdmissionRejected
from edge_runtime.telemetry.budget import MemoryBudget
from edge_runtime.telemetry.reading import TelemetryReading

log = logging.getLogger(__name__)

WorkKind = Literal["inference", "finetune"]
Verdict = Literal["allow", "queue", "reject"]


class AdmissionState(str, Enum):
    """Ordered by severity; each state includes the measures of the ones before it."""

    NORMAL = "normal"
    SHED_FINETUNE = "shed_finetune"  # fine-tuning paused and its activations released
    QUEUE = "queue"  # new inference waits in the queue instead of starting
    REJECT = "reject"  # new inference is refused with a retry-after

    @property
    def level(self) -> int:
        return _LEVELS.index(self)


_LEVELS = [AdmissionState.NORMAL, AdmissionState.SHED_FINETUNE, AdmissionState.QUEUE,
           AdmissionState.REJECT]


# The AGX Orin 64GB's `50W` nvpmodel mode: the power budget where the device reports no limit.
JETSON_POWER_BUDGET_MW = 50_000.0


@dataclass(frozen=True)
class Threshold:
    """Enter a state when the signal crosses `enter`; leave it only once back past `exit`.

    The gap between the two is the hysteresis that keeps a signal hovering at one value from
    flapping the state. `higher_is_worse=False` is for headroom-like signals.
    """

    enter: float
    exit: float
    higher_is_worse: bool = True

    def __post_init__(self) -> None:
        looser = self.exit <= self.enter if self.higher_is_worse else self.exit >= self.enter
        if not looser:
            raise ValueError(f"exit {self.exit} must be on the safe side of enter {self.enter}")

    def crossed(self, value: float, holding: bool) -> bool:
        limit = self.exit if holding else self.enter
        return value >= limit if self.higher_is_worse else value < limit


Ladder = dict[AdmissionState, Threshold]


def _down(enter: float, exit: float) -> Threshold:
    return Threshold(enter, exit, higher_is_worse=False)


@dataclass
class AdmissionConfig:
    """Thresholds per signal and state, defaulting to a Jetson AGX Orin 64GB.

    Temperatures: L4T puts Orin's software throttle trip at 99.0 C and software shutdown at
    104.5 C on every zone (cpu, gpu, cv0-2, soc0-2, tj); see docs/telemetry.md. We yield well
    before the clocks drop so inference latency stays predictable.
    """

    memory_headroom_mb: Ladder = field(default_factory=lambda: {
        AdmissionState.SHED_FINETUNE: _down(4096, 6144),
        AdmissionState.QUEUE: _down(1024, 2048),
        AdmissionState.REJECT: _down(256, 768),
    })
    temperature_c: Ladder = field(default_factory=lambda: {
        AdmissionState.SHED_FINETUNE: Threshold(85.0, 80.0),
        AdmissionState.QUEUE: Threshold(92.0, 88.0),
        AdmissionState.REJECT: Threshold(96.0, 93.0),
    })
    # Fine-tuning competes with decode for the GPU and for DRAM bandwidth (EMC); when either
    # is saturated, pausing it is the cheapest relief.
    gpu_util_pct: Ladder = field(default_factory=lambda: {
        AdmissionState.SHED_FINETUNE: Threshold(97.0, 85.0),
    })
    emc_util_pct: Ladder = field(default_factory=lambda: {
        AdmissionState.SHED_FINETUNE: Threshold(90.0, 75.0),
    })
    # Fraction of `power_budget_mw`; the budget is the nvpmodel mode's (AGX Orin: 50 W mode).
    power_fraction: Ladder = field(default_factory=lambda: {
        AdmissionState.SHED_FINETUNE: Threshold(0.90, 0.80),
        AdmissionState.QUEUE: Threshold(1.00, 0.92),
    })
    # None: the device's own limit where telemetry reports one (NVML's enforced power limit on a
    # discrete GPU: an H100 idles above 50 W), else JETSON_POWER_BUDGET_MW; 0 ignores power.
    power_budget_mw: float | None = None
    queue_length: Ladder = field(default_factory=lambda: {
        AdmissionState.SHED_FINETUNE: Threshold(8, 4),  # backlog: give decode everything
        AdmissionState.REJECT: Threshold(256, 192),  # queue full
    })
    min_dwell_s: float = 5.0  # a state is held at least this long before stepping down
    stale_after_s: float = 10.0  # no reading for this long: assume the worst we can shed
    retry_after_s: float = 2.0  # floor of the retry hint given to rejected clients
    history: int = 32  # transitions kept for `macectl status`


@dataclass(frozen=True)
class AdmissionSignals:
    """What admission looks at, in plain numbers; None = not measured on this machine."""

    memory_headroom_mb: float | None = None
    gpu_util_pct: float | None = None
    emc_util_pct: float | None = None
    max_temp_c: float | None = None
    power_mw: float | None = None
    power_limit_mw: float | None = None  # the device's own enforced limit (NVML), if it has one
    queue_length: int = 0

    @classmethod
    def from_telemetry(
        cls, reading: TelemetryReading | None, budget: MemoryBudget | None, queue_length: int
    ) -> AdmissionSignals:
        return cls(
            memory_headroom_mb=budget.headroom_mb if budget is not None else None,
            gpu_util_pct=reading.gpu_util_pct if reading is not None else None,
            emc_util_pct=reading.emc_util_pct if reading is not None else None,
            max_temp_c=reading.max_temp_c if reading is not None else None,
            power_mw=reading.total_power_mw if reading is not None else None,
            power_limit_mw=reading.power_limit_mw if reading is not None else None,
            queue_length=queue_length,
        )


@dataclass(frozen=True)
class AdmissionDecision:
    state: AdmissionState
    reason: str
    retry_after_s: float | None  # set while new inference is rejected
    since: float  # clock time the state was entered


@dataclass(frozen=True)
class AdmissionVerdict:
    """The answer for one piece of work: allow it, let it wait, or refuse it."""

    action: Verdict
    reason: str
    retry_after_s: float | None = None


class AdmissionController:
    """Feed it `observe(signals)` on every reading and `observe_queue(n)` in between; ask it
    `admit(kind)`.

    Escalation is immediate (protection never waits); de-escalation steps down one state at a
    time, and only after the current state has been held `min_dwell_s`, so fine-tuning is the
    last thing to come back.
    """

    def __init__(self, config: AdmissionConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or AdmissionConfig()
        self.clock = clock
        now = clock()
        self.signals = AdmissionSignals()
        self._started = now
        self._last_signal_t: float | None = None
        self.decision = AdmissionDecision(
            AdmissionState.NORMAL, "no telemetry yet", None, since=now)
        self.transitions: deque[tuple[float, AdmissionState, str]] = deque(
            maxlen=self.config.history)

    @property
    def state(self) -> AdmissionState:
        return self.decision.state

    def observe(self, signals: AdmissionSignals) -> AdmissionDecision:
        """Take new signals and return the (possibly new) decision."""
        self.signals = signals
        self._last_signal_t = self.clock()
        return self._decide()

    def observe_queue(self, queue_length: int) -> AdmissionDecision:
        """A new queue length between readings; does not count as fresh telemetry."""
        self.signals = replace(self.signals, queue_length=queue_length)
        return self._decide()

    def tick(self) -> AdmissionDecision:
        """Re-evaluate without new signals (staleness, dwell expiry); call periodically."""
        return self._decide()

    def admit(self, kind: WorkKind) -> AdmissionVerdict:
        """What to do with a new piece of work of this kind, given the current state."""
        state, reason = self.decision.state, self.decision.reason
        if kind == "finetune":
            # Fine-tuning is internal and durable (its feedback is already stored): it waits.
            if state is AdmissionState.NORMAL:
                return AdmissionVerdict("allow", reason)
            return AdmissionVerdict("queue", f"fine-tuning paused ({state.value}): {reason}")
        if kind != "inference":
            raise ValueError(f"unknown work kind {kind!r}")
        if state in (AdmissionState.NORMAL, AdmissionState.SHED_FINETUNE):
            return AdmissionVerdict("allow", reason)
        if state is AdmissionState.QUEUE:
            return AdmissionVerdict("queue", f"inference queued: {reason}")
        return AdmissionVerdict("reject", f"inference rejected: {reason}",
                                self.decision.retry_after_s)

    def device_allows_inference(self) -> bool:
        """Whether the device itself (memory, temperature, loads, power, fresh telemetry) would let
        inference in: True when only the request backlog, which clients make, holds admission
        above `shed_finetune`. The service then sheds the heaviest clients, not light ones."""
        device, _ = self._target(self.decision.state, self.clock(), include_queue=False)
        return device.level < AdmissionState.QUEUE.level

    def require(self, kind: WorkKind) -> AdmissionVerdict:
        """`admit`, raising `AdmissionRejected` (with its retry hint) instead of rejecting."""
        verdict = self.admit(kind)
        if verdict.action == "reject":
            raise AdmissionRejected(
                f"The device is under pressure ({verdict.reason}); retry in "
                f"{verdict.retry_after_s:.0f} s.",
                retry_after_s=verdict.retry_after_s or self.config.retry_after_s,
                reason=self.decision.reason,
            )
        return verdict

    def power_budget_mw(self) -> float | None:
        """The power draw admission measures against: the configured budget; by default the
        device's own enforced limit where telemetry reports one, else the AGX Orin's 50W mode."""
        configured = self.config.power_budget_mw
        if configured is not None:
            return configured or None  # 0: power is not a signal
        return self.signals.power_limit_mw or JETSON_POWER_BUDGET_MW

    def status(self) -> dict[str, Any]:
        """Everything `macectl status` shows about admission, JSON-ready."""
        now = self.clock()
        d = self.decision
        return {
            "state": d.state.value,
            "reason": d.reason,
            "power_budget_mw": self.power_budget_mw(),
            "retry_after_s": d.retry_after_s,
            "in_state_s": round(now - d.since, 3),
            "signals": asdict(self.signals),
            "telemetry_age_s": (None if self._last_signal_t is None
                                else round(now - self._last_signal_t, 3)),
            "transitions": [
                {"t": t, "state": s.value, "reason": r} for t, s, r in self.transitions
            ],
        }

    def _decide(self) -> AdmissionDecision:
        now = self.clock()
        current = self.decision.state
        target, reasons = self._target(current, now)
        why = "; ".join(reasons) or "all signals within limits"
        if target.level > current.level:
            return self._enter(target, why, now)
        if target.level < current.level:
            held_s = now - self.decision.since
            if held_s >= self.config.min_dwell_s:  # one step at a time on the way down
                step = _LEVELS[current.level - 1]
                return self._enter(step, f"stepping down from {current.value}: {why}", now)
            why = (f"recovering ({why}); holding {current.value} for another "
                   f"{self.config.min_dwell_s - held_s:.1f} s")
        self.decision = replace(self.decision, reason=why)
        return self.decision

    def _enter(self, state: AdmissionState, reason: str, now: float) -> AdmissionDecision:
        log.info("admission %s -> %s: %s", self.decision.state.value, state.value, reason)
        self.decision = AdmissionDecision(state, reason, self._retry_after(state), since=now)
        self.transitions.append((now, state, reason))
        return self.decision

    def _target(self, current: AdmissionState, now: float,
                include_queue: bool = True) -> tuple[AdmissionState, list[str]]:
        """The most severe state any signal asks for, and why."""
        cfg, sig = self.config, self.signals
        checks: list[tuple[str, float | None, Ladder, Callable[[float], str]]] = [
            ("memory headroom", sig.memory_headroom_mb, cfg.memory_headroom_mb,
             lambda v: f"{v:.0f} MiB"),
            ("temperature", sig.max_temp_c, cfg.temperature_c, lambda v: f"{v:.1f} C"),
            ("GPU load", sig.gpu_util_pct, cfg.gpu_util_pct, lambda v: f"{v:.0f}%"),
            ("EMC load", sig.emc_util_pct, cfg.emc_util_pct, lambda v: f"{v:.0f}%"),
        ]
        if include_queue:
            checks.append(("queue length", float(sig.queue_length), cfg.queue_length, lambda v: f"{v:.0f}"))
        budget_mw = self.power_budget_mw()
        if sig.power_mw is not None and budget_mw:
            budget_w = budget_mw / 1000
            checks.append(("power", sig.power_mw / budget_mw, cfg.power_fraction,
                           lambda v: f"{v * budget_w:.1f} W"))
        target, reasons = AdmissionState.NORMAL, []
        for name, value, ladder, show in checks:
            if value is None:
                continue
            level = self._signal_level(value, ladder, current)
            if level is AdmissionState.NORMAL:
                continue
            limit = ladder[level]
            bound = limit.exit if current.level >= level.level else limit.enter
            relation = ">=" if limit.higher_is_worse else "<"
            reasons.append(f"{name} {show(value)} {relation} {show(bound)} ({level.value})")
            target = _worse(target, level)
        silent_s = now - (self._last_signal_t if self._last_signal_t is not None else self._started)
        if silent_s > cfg.stale_after_s:
            reasons.append(f"no telemetry for {silent_s:.0f} s (shed_finetune)")
            target = _worse(target, AdmissionState.SHED_FINETUNE)
        return target, reasons

    @staticmethod
    def _signal_level(value: float, ladder: Ladder, current: AdmissionState) -> AdmissionState:
        level = AdmissionState.NORMAL
        for state, threshold in ladder.items():
            # A state already held (or a worse one) only needs the looser exit limit.
            if threshold.crossed(value, holding=current.level >= state.level):
                level = _worse(level, state)
        return level

    def _retry_after(self, state: AdmissionState) -> float | None:
        if state is not AdmissionState.REJECT:
            return None
        # Nothing changes faster than the dwell time allows us to step down.
        return max(self.config.retry_after_s, self.config.min_dwell_s)


def _worse(a: AdmissionState, b: AdmissionState) -> AdmissionState:
    return a if a.level >= b.level else b
