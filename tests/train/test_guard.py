"""Regression guard: a candidate adapter is published only when held-out win rate and CLPD did not
fall beyond the tolerance; a rejected candidate leaves the served version and is logged."""

from __future__ import annotations

import pytest
import torch

from edge_runtime.lora import AdapterRef, AdapterRegistry, LoraSettings
from edge_runtime.train import AdapterTrainer, DPOSettings, PreferenceRecord
from edge_runtime.train.dpo import AlignmentMetrics
from edge_runtime.train.guard import RegressionGuard, publish_guarded
from edge_runtime.train.optim import OptimizerSettings


def _metrics(win_rate: float, clpd: float) -> AlignmentMetrics:
    return AlignmentMetrics(win_rate=win_rate, clpd=clpd, dpo_loss=0.6, reward_accuracy=0.5, pairs=10)


def test_guard_tolerates_small_drops_and_rejects_large_ones():
    guard = RegressionGuard(win_rate_tolerance=0.05, clpd_tolerance=1.0)
    assert guard.check(_metrics(0.80, 2.0), _metrics(0.76, 1.2)).accepted
    decision = guard.check(_metrics(0.80, 2.0), _metrics(0.70, 2.5))
    assert not decision.accepted and "win rate fell" in decision.reason
    assert not guard.check(_metrics(0.80, 2.0), _metrics(0.90, 0.5)).accepted


def _trainer(model, tokenizer) -> AdapterTrainer:
    dpo = DPOSettings(window_tokens=None, layers_per_group=2,
                      optimizer=OptimizerSettings(accumulation_steps=1, learning_rate=3e-3))
    return AdapterTrainer(model, tokenizer, LoraSettings(rank=4, alpha=8), dpo)


def test_improving_candidate_is_published_and_a_regression_is_not(tiny4, tiny4_tokenizer, pairs, tmp_path):
    registry = AdapterRegistry(tmp_path, tiny4.cfg)
    trainer = _trainer(tiny4, tiny4_tokenizer)
    for _ in range(4):
        trainer.train(pairs)
    decision, ref = publish_guarded(registry, trainer, "alice", pairs, RegressionGuard(0.0, 0.0))
    assert decision.accepted and ref == AdapterRef("alice", 1)
    assert decision.after.clpd > decision.before.clpd  # better than the base on these pairs

    # Train on the flipped preferences: held-out alignment falls, the guard keeps v1.
    flipped = [PreferenceRecord(p.prompt, p.rejected, p.chosen) for p in pairs]
    for _ in range(6):
        trainer.train(flipped)
    decision, ref = publish_guarded(registry, trainer, "alice", pairs, RegressionGuard(0.0, 0.0),
                                    reset_on_reject=True)
    assert not decision.accepted and ref is None
    assert registry.newest("alice") == AdapterRef("alice", 1)
    event = registry.events("alice")[-1]
    assert event["kind"] == "rejected" and event["serving"] == 1 and "fell" in event["reason"]
    # Asked to, training restarts from the served weights, not from the rejected candidate.
    served = registry.weights(AdapterRef("alice", 1))
    assert all(torch.equal(trainer.weights.b[k].detach(), served.b[k]) for k in served.keys())


def test_without_heldout_pairs_the_candidate_is_published_unguarded(tiny4, tiny4_tokenizer):
    registry = AdapterRegistry(None, tiny4.cfg)
    decision, ref = publish_guarded(registry, _trainer(tiny4, tiny4_tokenizer), "bob", [])
    assert decision.accepted and "unguarded" in decision.reason and ref.version == 1


@pytest.mark.parametrize("tolerance", [0.0, 0.5])
def test_guard_compares_against_the_served_version_not_the_base(tiny4, tiny4_tokenizer, pairs, tolerance):
    registry = AdapterRegistry(None, tiny4.cfg)
    trainer = _trainer(tiny4, tiny4_tokenizer)
    for _ in range(4):
        trainer.train(pairs)
    publish_guarded(registry, trainer, "alice", pairs)
    decision, _ = publish_guarded(registry, trainer, "alice", pairs, RegressionGuard(tolerance, tolerance))
    assert decision.before == decision.after  # nothing trained since v1: identical metrics
    assert decision.accepted


def test_by_default_training_continues_from_a_rejected_candidate(tiny4, tiny4_tokenizer, pairs):
    registry = AdapterRegistry(None, tiny4.cfg)
    trainer = _trainer(tiny4, tiny4_tokenizer)
    publish_guarded(registry, trainer, "alice", pairs)
    for _ in range(6):
        trainer.train([PreferenceRecord(p.prompt, p.rejected, p.chosen) for p in pairs])
    candidate = trainer.snapshot()
    decision, ref = publish_guarded(registry, trainer, "alice", pairs, RegressionGuard(0.0, 0.0))
    assert not decision.accepted and registry.newest("alice").version == 1
    assert all(torch.equal(trainer.weights.b[k].detach(), candidate.b[k]) for k in candidate.keys())


def test_guard_judges_unpaired_feedback_by_the_heldout_margin(tiny4, tiny4_tokenizer, tmp_path):
    from edge_runtime.train.kto import UnpairedMetrics
    from edge_runtime.train.unpaired import UnpairedRecord
    from tests.train.test_kto_staged import unpaired_records

    guard = RegressionGuard(margin_tolerance=0.5)
    base = UnpairedMetrics(0.0, 0.0, 0.0, 0.0, 2, 2)
    assert guard.check(None, None, base, UnpairedMetrics(-0.4, 0.0, 0.4, 0.5, 2, 2)).accepted
    assert "unpaired margin fell" in guard.check(None, None, base, UnpairedMetrics(-0.6, 0, 0.6, 0, 2, 2)).reason

    registry = AdapterRegistry(tmp_path, tiny4.cfg)
    trainer = _trainer(tiny4, tiny4_tokenizer)
    examples = unpaired_records()
    for _ in range(3):
        trainer.train(examples)
    decision, ref = publish_guarded(registry, trainer, "ann", [], RegressionGuard(margin_tolerance=0.0),
                                    heldout_unpaired=examples)
    assert decision.accepted and ref == AdapterRef("ann", 1) and decision.before is None
    assert decision.unpaired_after.margin > decision.unpaired_before.margin == 0.0
    assert registry.events("ann")[-1]["heldout_unpaired"]["margin"] == decision.unpaired_after.margin

    # Thumbs flipped: the held-out margin falls and the guard keeps v1.
    flipped = [UnpairedRecord(e.prompt, e.completion, not e.desirable) for e in examples]
    for _ in range(5):
        trainer.train(flipped)
    decision, ref = publish_guarded(registry, trainer, "ann", [], RegressionGuard(margin_tolerance=0.0),
                                    heldout_unpaired=examples)
    assert not decision.accepted and ref is None and registry.newest("ann") == AdapterRef("ann", 1)
    # Examples of one kind only cannot judge a margin: published unguarded, and said so.
    only_up = [e for e in examples if e.desirable]
    decision, _ = publish_guarded(registry, trainer, "ann", [], heldout_unpaired=only_up)
    assert decision.accepted and "unguarded" in decision.reason
