"""Regression guard: a candidate adapter is published only if its held-out win rate and CLPD did
not fall more than a tolerance below the version being served; otherwise the served version stays
and the rejection is recorded in the user's adapter event log.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from edge_runtime.lora.registry import AdapterRef, AdapterRegistry
from edge_runtime.lora.weights import LoraWeights
from edge_runtime.train.dpo import AlignmentMetrics
from edge_runtime.train.pairs import PairLike, PairTokens
from edge_runtime.train.trainer import AdapterTrainer


@dataclass(frozen=True)
class GuardDecision:
    accepted: bool
    reason: str
    before: AlignmentMetrics | None  # the served version (or the base) on the held-out pairs
    after: AlignmentMetrics | None  # the candidate

    def as_dict(self) -> dict[str, Any]:
        return {
            "accepted": self.accepted,
            "reason": self.reason,
            "before": None if self.before is None else self.before.as_dict(),
            "after": None if self.after is None else self.after.as_dict(),
        }


@dataclass(frozen=True)
class RegressionGuard:
    win_rate_tolerance: float = 0.05  # absolute drop in win rate allowed
    clpd_tolerance: float = 1.0  # absolute drop in CLPD (nats per pair) allowed
    min_heldout_pairs: int = 1  # fewer: nothing to judge by, publish (and say so)

    def check(self, before: AlignmentMetrics, after: AlignmentMetrics) -> GuardDecision:
        drops = []
        if after.win_rate < before.win_rate - self.win_rate_tolerance:
            drops.append(f"win rate fell {before.win_rate:.3f} -> {after.win_rate:.3f}")
        if after.clpd < before.clpd - self.clpd_tolerance:
            drops.append(f"CLPD fell {before.clpd:.3f} -> {after.clpd:.3f}")
        if drops:
            return GuardDecision(False, "; ".join(drops) + " (beyond tolerance)", before, after)
        return GuardDecision(True, "held-out win rate and CLPD within tolerance", before, after)


def publish_guarded(
    registry: AdapterRegistry,
    trainer: AdapterTrainer,
    user: str,
    heldout: Sequence[PairLike | PairTokens],
    guard: RegressionGuard | None = None,
    candidate: LoraWeights | None = None,
    reset_on_reject: bool = False,
    served_metrics: AlignmentMetrics | None = None,
    **info: Any,
) -> tuple[GuardDecision, AdapterRef | None]:
    """Evaluate `candidate` (default: the trainer's current weights) against the user's served
    version on `heldout`; publish it as the next version if the guard accepts. On rejection the
    served version stays. Training goes on from the candidate by default: in online DPO the
    pairs that correct a regression come from the regressed policy, so discarding it would also
    discard the correction (`reset_on_reject=True` restarts from the served weights instead).
    `served_metrics`: the served version's metrics on these same pairs, if already known (a
    version is immutable, so callers publishing often can skip re-evaluating it)."""
    guard = guard or RegressionGuard()
    candidate = candidate if candidate is not None else trainer.snapshot()
    served = registry.newest(user)
    served_weights = None if served is None else registry.weights(served)
    if len(heldout) < guard.min_heldout_pairs:
        decision = GuardDecision(True, f"only {len(heldout)} held-out pairs; published unguarded", None, None)
    else:
        before = served_metrics if served_metrics is not None else trainer.evaluate(heldout, served_weights)
        after = trainer.evaluate(heldout, candidate)
        decision = guard.check(before, after)
    if decision.accepted:
        metrics = {} if decision.after is None else {"heldout": decision.after.as_dict()}
        ref = registry.publish(user, candidate, **metrics, **info)
        return decision, ref
    registry.record_event(user, "rejected", serving=None if served is None else served.version,
                          **decision.as_dict(), **info)
    if reset_on_reject:
        if served_weights is not None:
            trainer.reset(served_weights)
        else:
            trainer.reset(LoraWeights.init(trainer.model.cfg, trainer.weights.settings, seed=trainer.dpo.seed))
    return decision, None
