"""Regression guard: a candidate adapter is published only if its held-out win rate and CLPD (on
held-out pairs) and its desirable-vs-undesirable log-ratio margin (on held-out unpaired examples:
thumbs, ratings) did not fall more than a tolerance below the version being served; otherwise the
served version stays and the rejection is recorded in the user's adapter event log. It also
refuses a candidate that degenerated where the user expressed no preference: its per-token KL from
the reference on its own greedy answers over a budget, or those answers' distinct-2 fallen more than
a fraction below the reference's, or one word repeated beyond a limit (train/degeneration.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from edge_runtime.lora.registry import AdapterRef, AdapterRegistry
from edge_runtime.lora.weights import LoraWeights
from edge_runtime.train.degeneration import DegenerationMetrics
from edge_runtime.train.dpo import AlignmentMetrics
from edge_runtime.train.guard_task import GuardDecision, GuardEvaluation
from edge_runtime.train.kto import UnpairedMetrics
from edge_runtime.train.pairs import PairLike, PairTokens
from edge_runtime.train.trainer import AdapterTrainer
from edge_runtime.train.unpaired import UnpairedLike


@dataclass(frozen=True)
class RegressionGuard:
    win_rate_tolerance: float = 0.05  # absolute drop in win rate allowed
    clpd_tolerance: float = 1.0  # absolute drop in CLPD (nats per pair) allowed
    min_heldout_pairs: int = 1  # fewer: nothing to judge by, publish (and say so)
    # More: a candidate is judged on this many of them (0: all), the newest quarter and a stable
    # hash-chosen rest (guard_task.judged_pairs): a candidate's cost stops growing with the set.
    max_heldout_pairs: int = 16
    margin_tolerance: float = 1.0  # absolute drop in the unpaired log-ratio margin (nats) allowed
    min_heldout_unpaired: int = 2  # and at least one desirable and one undesirable example
    # Degeneration (docs/training.md, "Regression guard" for how the defaults were chosen): the
    # first `degeneration_prompts` held-out prompts are answered greedily, `degeneration_tokens`
    # tokens each, by the candidate and by the reference (the adapter off). 0 prompts: not judged.
    degeneration_prompts: int = 12
    degeneration_tokens: int = 16
    batch_prompts: int = 4  # held-out prompts answered together (one forward per token for all)
    kl_budget: float = 1.0  # mean KL(candidate || reference) per answer token allowed (nats)
    kl_skip_tokens: int = 2  # leading answer tokens left out of the KL: where a preference shows
    distinct_2_drop: float = 0.10  # largest fraction distinct-2 may fall below the reference's
    max_word_repeats: int = 4  # one word this many times in an answer, or the reference's most, at most

    def check(self, before: AlignmentMetrics | None, after: AlignmentMetrics | None,
              unpaired_before: UnpairedMetrics | None = None,
              unpaired_after: UnpairedMetrics | None = None,
              degeneration: DegenerationMetrics | None = None) -> GuardDecision:
        """Judge by whichever held-out kinds are given (pairs, unpaired examples, or both), and by
        the degeneration measures when given."""
        drops, judged = [], []
        if before is not None and after is not None:
            judged.append("win rate and CLPD")
            if after.win_rate < before.win_rate - self.win_rate_tolerance:
                drops.append(f"win rate fell {before.win_rate:.3f} -> {after.win_rate:.3f}")
            if after.clpd < before.clpd - self.clpd_tolerance:
                drops.append(f"CLPD fell {before.clpd:.3f} -> {after.clpd:.3f}")
        if unpaired_before is not None and unpaired_after is not None:
            judged.append("desirable-vs-undesirable margin")
            if unpaired_after.margin < unpaired_before.margin - self.margin_tolerance:
                drops.append(f"unpaired margin fell {unpaired_before.margin:.3f} -> {unpaired_after.margin:.3f}")
        figures = ""
        if degeneration is not None:
            drops.extend(self.degenerated(degeneration))
            d = degeneration
            judged.append("drift from the base")
            figures = (f" (KL {d.kl_per_token:.3f} nats/token, budget {self.kl_budget:g}; distinct-2 "
                       f"{d.distinct_2:.3f} vs base {d.base_distinct_2:.3f}; a word at most "
                       f"{d.max_word_repeats}x vs base {d.base_max_word_repeats}x)")
        args = (before, after, unpaired_before, unpaired_after, degeneration)
        if drops:
            return GuardDecision(False, "; ".join(drops) + " (beyond tolerance)" + figures, *args)
        return GuardDecision(True, f"held-out {' and '.join(judged)} within tolerance" + figures, *args)

    def degenerated(self, d: DegenerationMetrics) -> list[str]:
        """Why `d` shows a collapsed candidate (empty: it does not)."""
        out = []
        if d.kl_per_token > self.kl_budget:
            out.append(f"KL from the base {d.kl_per_token:.3f} nats/token over the budget {self.kl_budget:g}")
        if d.distinct_2_drop > self.distinct_2_drop:
            out.append(f"greedy answers repeat: distinct-2 {d.distinct_2:.3f} is {100 * d.distinct_2_drop:.0f}% "
                       f"below the base's {d.base_distinct_2:.3f}")
        limit = max(self.max_word_repeats, d.base_max_word_repeats)
        if d.max_word_repeats > limit:
            out.append(f"greedy answers repeat a word {d.max_word_repeats}x (limit {limit})")
        return out

    def judges_unpaired(self, examples: Sequence[UnpairedLike]) -> bool:
        kinds = {bool(e.desirable) for e in examples}
        return len(examples) >= self.min_heldout_unpaired and kinds == {True, False}


def publish_guarded(
    registry: AdapterRegistry,
    trainer: AdapterTrainer,
    user: str,
    heldout: Sequence[PairLike | PairTokens],
    guard: RegressionGuard | None = None,
    candidate: LoraWeights | None = None,
    reset_on_reject: bool = False,
    served_metrics: AlignmentMetrics | None = None,
    heldout_unpaired: Sequence[UnpairedLike] = (),
    served_unpaired: UnpairedMetrics | None = None,
    **info: Any,
) -> tuple[GuardDecision, AdapterRef | None]:
    """Evaluate `candidate` (default: the trainer's current weights) against the user's served
    version on `heldout`, all at once; publish it as the next version if the guard accepts (see
    `conclude`). `served_metrics`: the served version's metrics on these same pairs, if already
    known (a version is immutable, so callers publishing often can skip re-evaluating it).
    `heldout_unpaired` (thumbs, ratings; `served_unpaired` likewise): judged by the margin. The
    daemon runs the same evaluation as stages beside serving instead (`guard_evaluation`)."""
    evaluation = guard_evaluation(registry, trainer, user, heldout, guard, candidate, served_metrics,
                                  heldout_unpaired, served_unpaired)
    evaluation.run()
    return conclude(registry, trainer, user, evaluation, reset_on_reject, **info)


def guard_evaluation(
    registry: AdapterRegistry,
    trainer: AdapterTrainer,
    user: str,
    heldout: Sequence[PairLike | PairTokens],
    guard: RegressionGuard | None = None,
    candidate: LoraWeights | None = None,
    served_metrics: AlignmentMetrics | None = None,
    heldout_unpaired: Sequence[UnpairedLike] = (),
    served_unpaired: UnpairedMetrics | None = None,
    served_rows: Mapping[PairTokens, tuple[float, ...]] | None = None,
) -> GuardEvaluation:
    """The staged evaluation of `candidate` against the user's served version (not run yet).
    `served_rows`: the served version's log-prob rows on held-out pairs, known from an earlier
    evaluation (`GuardEvaluation.pair_rows`); only the other pairs are scored under it."""
    guard = guard or RegressionGuard()
    candidate = candidate if candidate is not None else trainer.snapshot()
    served = registry.newest(user)
    return GuardEvaluation(trainer, guard, candidate, heldout, heldout_unpaired,
                           None if served is None else registry.weights(served), served_metrics, served_unpaired,
                           batch_prompts=guard.batch_prompts, served_rows=served_rows)


def conclude(registry: AdapterRegistry, trainer: AdapterTrainer, user: str, evaluation: GuardEvaluation,
             reset_on_reject: bool = False, **info: Any) -> tuple[GuardDecision, AdapterRef | None]:
    """Publish the evaluated candidate as the next version if the guard accepts it; on rejection
    the served version stays and the rejection goes to the user's event log. Training goes on
    from the candidate by default: in online DPO the pairs that correct a regression come from
    the regressed policy, so discarding it would also discard the correction
    (`reset_on_reject=True` restarts from the served weights instead)."""
    decision = evaluation.decision()
    served = registry.newest(user)
    if decision.accepted:
        metrics: dict[str, Any] = {} if decision.after is None else {"heldout": decision.after.as_dict()}
        if decision.unpaired_after is not None:
            metrics["heldout_unpaired"] = decision.unpaired_after.as_dict()
        if decision.degeneration is not None:
            metrics["degeneration"] = decision.degeneration.as_dict()
        ref = registry.publish(user, evaluation.candidate, **metrics, guard_s=round(evaluation.seconds, 3), **info)
        return decision, ref
    registry.record_event(user, "rejected", serving=None if served is None else served.version,
                          **decision.as_dict(), guard_s=round(evaluation.seconds, 3), **info)
    if reset_on_reject:
        served_weights = None if served is None else registry.weights(served)
        if served_weights is not None:
            trainer.reset(served_weights)
        else:
            trainer.reset(LoraWeights.init(trainer.model.cfg, trainer.weights.settings, seed=trainer.dpo.seed))
    return decision, None
