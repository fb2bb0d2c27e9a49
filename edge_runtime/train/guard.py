"""Regression guard: a candidate adapter is published only if its held-out win rate and CLPD (on
held-out pairs) and its desirable-vs-undesirable log-ratio margin (on held-out unpaired examples:
thumbs, ratings) did not fall more than a tolerance below the version being served; otherwise the
served version stays and the rejection is recorded in the user's adapter event log. It also
refuses a candidate that degenerated where the user expressed no preference: its per-token KL from
the reference on its own greedy answers over a budget, or those answers' distinct-2 fallen more than
a fraction below the reference's, or one word repeated beyond a limit (train/degeneration.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from edge_runtime.lora.registry import AdapterRef, AdapterRegistry
from edge_runtime.lora.weights import LoraWeights
from edge_runtime.train.degeneration import DegenerationMetrics, degeneration_metrics
from edge_runtime.train.dpo import AlignmentMetrics
from edge_runtime.train.kto import UnpairedMetrics
from edge_runtime.train.pairs import PairLike, PairTokens
from edge_runtime.train.trainer import AdapterTrainer
from edge_runtime.train.unpaired import UnpairedLike


@dataclass(frozen=True)
class GuardDecision:
    accepted: bool
    reason: str
    before: AlignmentMetrics | None  # the served version (or the base) on the held-out pairs
    after: AlignmentMetrics | None  # the candidate
    unpaired_before: UnpairedMetrics | None = None  # the same on held-out unpaired examples
    unpaired_after: UnpairedMetrics | None = None
    degeneration: DegenerationMetrics | None = None  # the candidate's greedy answers vs the reference's

    def as_dict(self) -> dict[str, Any]:
        out = {
            "accepted": self.accepted,
            "reason": self.reason,
            "before": None if self.before is None else self.before.as_dict(),
            "after": None if self.after is None else self.after.as_dict(),
        }
        if self.unpaired_before is not None or self.unpaired_after is not None:
            out["unpaired_before"] = None if self.unpaired_before is None else self.unpaired_before.as_dict()
            out["unpaired_after"] = None if self.unpaired_after is None else self.unpaired_after.as_dict()
        if self.degeneration is not None:
            out["degeneration"] = self.degeneration.as_dict()
        return out


@dataclass(frozen=True)
class RegressionGuard:
    win_rate_tolerance: float = 0.05  # absolute drop in win rate allowed
    clpd_tolerance: float = 1.0  # absolute drop in CLPD (nats per pair) allowed
    min_heldout_pairs: int = 1  # fewer: nothing to judge by, publish (and say so)
    margin_tolerance: float = 1.0  # absolute drop in the unpaired log-ratio margin (nats) allowed
    min_heldout_unpaired: int = 2  # and at least one desirable and one undesirable example
    # Degeneration (docs/training.md, "Regression guard" for how the defaults were chosen): the
    # first `degeneration_prompts` held-out prompts are answered greedily, `degeneration_tokens`
    # tokens each, by the candidate and by the reference (the adapter off). 0 prompts: not judged.
    degeneration_prompts: int = 4
    degeneration_tokens: int = 24
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
    version on `heldout`; publish it as the next version if the guard accepts. On rejection the
    served version stays. Training goes on from the candidate by default: in online DPO the
    pairs that correct a regression come from the regressed policy, so discarding it would also
    discard the correction (`reset_on_reject=True` restarts from the served weights instead).
    `served_metrics`: the served version's metrics on these same pairs, if already known (a
    version is immutable, so callers publishing often can skip re-evaluating it).
    `heldout_unpaired` (thumbs, ratings; `served_unpaired` likewise): judged by the margin."""
    guard = guard or RegressionGuard()
    candidate = candidate if candidate is not None else trainer.snapshot()
    served = registry.newest(user)
    served_weights = None if served is None else registry.weights(served)
    pairs = len(heldout) >= guard.min_heldout_pairs
    unpaired = guard.judges_unpaired(heldout_unpaired)
    if not pairs and not unpaired:
        decision = GuardDecision(True, f"only {len(heldout)} held-out pairs and {len(heldout_unpaired)} "
                                 "unpaired examples (of one kind or none); published unguarded", None, None)
    else:
        before = after = u_before = u_after = None
        if pairs:
            before = served_metrics if served_metrics is not None else trainer.evaluate(heldout, served_weights)
            after = trainer.evaluate(heldout, candidate)
        if unpaired:
            u_before = (served_unpaired if served_unpaired is not None
                        else trainer.evaluate_unpaired(heldout_unpaired, served_weights))
            u_after = trainer.evaluate_unpaired(heldout_unpaired, candidate)
        degeneration = None
        prompts = _heldout_prompts(trainer, heldout if pairs else (), heldout_unpaired if unpaired else (),
                                   guard.degeneration_prompts)
        if prompts:
            # The reference is frozen: its answers are computed once per prompt, fleet and length.
            keys = [(trainer.fleet_key, guard.degeneration_tokens, p) for p in prompts]
            known = [trainer.reference_answers.get(k) for k in keys]
            degeneration, base = degeneration_metrics(
                trainer.model, trainer.tokenizer, prompts, trainer.policy(candidate), trainer.policy(None),
                guard.degeneration_tokens, guard.kl_skip_tokens,
                reference_answers=None if any(a is None for a in known) else known)
            if len(trainer.reference_answers) > 16 * guard.degeneration_prompts:
                trainer.reference_answers.clear()  # the held-out prompts changed many times over
            for key, answer in zip(keys, base, strict=True):
                trainer.reference_answers[key] = tuple(answer)
        decision = guard.check(before, after, u_before, u_after, degeneration)
    if decision.accepted:
        metrics: dict[str, Any] = {} if decision.after is None else {"heldout": decision.after.as_dict()}
        if decision.unpaired_after is not None:
            metrics["heldout_unpaired"] = decision.unpaired_after.as_dict()
        if decision.degeneration is not None:
            metrics["degeneration"] = decision.degeneration.as_dict()
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


def _heldout_prompts(trainer: AdapterTrainer, pairs: Sequence[PairLike | PairTokens],
                     unpaired: Sequence[UnpairedLike], limit: int) -> list[tuple[int, ...]]:
    """The first `limit` distinct held-out prompts as ids, the pairs' before the unpaired examples'."""
    out: list[tuple[int, ...]] = []
    for item in (*pairs, *unpaired):
        if len(out) >= limit:
            break
        if isinstance(item, PairTokens):
            prompt = item.prompt
        elif hasattr(item, "desirable"):
            prompt = trainer.tokenize_unpaired(item, mismatched=False).tokens.prompt  # type: ignore[arg-type]
        else:
            prompt = trainer.tokenize(item).prompt  # type: ignore[arg-type]
        if prompt not in out:
            out.append(prompt)
    return out
