"""A user's adapter trains on top of the fleet adapter served beneath it: staged DPO gradients
with the fleet (frozen) beneath equal one full autograd pass of base + fleet + user, the
reference includes the fleet, and a fleet version goes through the regression guard like a
user's."""

from __future__ import annotations

import pytest
import torch

from edge_runtime.lora import AdapterRef, AdapterRegistry, LoraSettings
from edge_runtime.lora.registry import FLEET
from edge_runtime.train import AdapterTrainer, DPOSettings, PreferenceRecord
from edge_runtime.train.dpo import dpo_loss
from edge_runtime.train.guard import RegressionGuard, publish_guarded
from edge_runtime.train.logprobs import ReferenceCache, pair_logps_dense
from edge_runtime.train.optim import OptimizerSettings
from tests.lora.helpers import ALL_LINEAR, random_adapter
from tests.train.helpers import full_autograd_grads, make_trainer, max_rel_error, staged_grads


class _HandSum:
    """The fleet's and the user's deltas added, written here so the check shares no code with
    the trainer's composition."""

    def __init__(self, fleet, user) -> None:
        self.fleet, self.user = fleet, user

    def delta(self, layer, target, x):
        parts = [w.delta(layer, target, x) for w in (self.fleet, self.user)]
        parts = [d for d in parts if d is not None]
        return None if not parts else parts[0] if len(parts) == 1 else parts[0] + parts[1]


def _fleet(cfg):
    # Targets the MLP too, where the user's adapter has none on some runs.
    return random_adapter(cfg, LoraSettings(rank=3, alpha=6, target_modules=ALL_LINEAR), seed=17, std=0.1)


def _full_autograd(trainer, fleet, records, accumulation):
    for p in trainer.weights.parameters():
        p.grad = None
    for record in records:
        tokens = trainer.tokenize(record)
        with torch.no_grad():
            ref_c, ref_r = pair_logps_dense(trainer.model, tokens, fleet)
        logps = pair_logps_dense(trainer.model, tokens, _HandSum(fleet, trainer.weights))
        (dpo_loss(logps[0], logps[1], ref_c, ref_r, trainer.dpo.beta) / accumulation).backward()
    grads = [p.grad.clone() for p in trainer.weights.parameters()]
    for p in trainer.weights.parameters():
        p.grad = None
    return grads


@pytest.mark.parametrize("window, group, targets", [(None, 4, ALL_LINEAR), (3, 2, ALL_LINEAR),
                                                    (4, 1, ("q_proj", "v_proj"))])
def test_staged_gradients_with_the_fleet_beneath_equal_full_autograd(tiny4, tiny4_tokenizer, pairs,
                                                                     window, group, targets):
    fleet = _fleet(tiny4.cfg)
    trainer = make_trainer(tiny4, tiny4_tokenizer, window=window, group=group, accumulation=2, targets=targets)
    without = staged_grads(trainer, pairs[:2])
    for p in trainer.weights.parameters():
        p.grad = None
    trainer.set_fleet(fleet, "+fleet@1")
    want = _full_autograd(trainer, fleet, pairs[:2], accumulation=2)
    got = staged_grads(trainer, pairs[:2])
    assert all(w.abs().max() > 0 for w in want)
    assert max_rel_error(got, want) <= 1e-4
    assert max_rel_error(without, want) > 1e-2  # the fleet beneath changes what the user's adapter learns


def test_the_reference_includes_the_fleet_and_is_cached_per_fleet_version(tiny4, tiny4_tokenizer, pairs):
    cache = ReferenceCache()
    fleet = _fleet(tiny4.cfg)
    plain = AdapterTrainer(tiny4, tiny4_tokenizer, reference_cache=cache)
    beneath = AdapterTrainer(tiny4, tiny4_tokenizer, reference_cache=cache, fleet=fleet, fleet_key="+fleet@1")
    tokens = plain.tokenize(pairs[0])
    base = plain.reference_logps(tokens)
    with_fleet = beneath.reference_logps(tokens)
    dense = pair_logps_dense(tiny4, tokens, fleet).tolist()
    assert with_fleet == pytest.approx(dense, rel=1e-5)
    assert abs(with_fleet[0] - base[0]) > 1e-3
    assert len(cache) == 2 and beneath.has_reference(tokens) and plain.has_reference(tokens)
    # A fresh adapter (B = 0) on top of the fleet is the reference: evaluation sees log 2.
    assert beneath.evaluate(pairs[:2], beneath.weights).dpo_loss == pytest.approx(0.6931, abs=1e-3)


def test_a_fleet_candidate_is_published_through_the_guard_and_rolled_back(tiny4, tiny4_tokenizer, pairs, tmp_path):
    registry = AdapterRegistry(tmp_path, tiny4.cfg)
    dpo = DPOSettings(window_tokens=None, layers_per_group=2,
                      optimizer=OptimizerSettings(accumulation_steps=1, learning_rate=3e-3))
    fleet_trainer = AdapterTrainer(tiny4, tiny4_tokenizer, LoraSettings(rank=4, alpha=8), dpo)
    for _ in range(4):
        fleet_trainer.train(pairs)
    decision, ref = publish_guarded(registry, fleet_trainer, FLEET, pairs, RegressionGuard(0.0, 0.0))
    assert decision.accepted and ref == AdapterRef(FLEET, 1)

    flipped = [PreferenceRecord(p.prompt, p.rejected, p.chosen) for p in pairs]
    for _ in range(6):
        fleet_trainer.train(flipped)
    decision, ref = publish_guarded(registry, fleet_trainer, FLEET, pairs, RegressionGuard(0.0, 0.0))
    assert not decision.accepted and ref is None and registry.newest(FLEET) == AdapterRef(FLEET, 1)
    assert [e["kind"] for e in registry.events(FLEET)] == ["published", "rejected"]
    assert registry.rollback(FLEET) is None and registry.users() == []


def test_kto_staged_gradients_with_the_fleet_beneath_equal_full_autograd(tiny4, tiny4_tokenizer, pairs,
                                                                         monkeypatch):
    from tests.train import test_kto_staged as kto

    fleet = _fleet(tiny4.cfg)
    trainer = kto._kto_trainer(tiny4, tiny4_tokenizer, window=3, group=2)
    trainer.set_fleet(fleet, "+fleet@1")
    examples = kto.unpaired_records()
    tasks = [trainer.task(item) for item in (examples[0], examples[1], pairs[0], examples[2])]
    for task in tasks:
        task.run()  # accumulates (16 > 4 examples): nothing steps
    got = [p.grad.clone() for p in trainer.weights.parameters()]
    # The KTO test's own autograd pass, its policy forward given the hand-added fleet beneath.
    monkeypatch.setattr(kto, "pair_logps_dense",
                        lambda model, tokens, weights: pair_logps_dense(model, tokens, _HandSum(fleet, weights)))
    want, _ = kto._autograd_grads(trainer, tasks, accumulation=16)
    assert all(w.abs().max() > 0 for w in want)
    assert max_rel_error(got, want) <= 1e-4


@pytest.mark.parametrize("window, group", [(None, 4), (3, 2)])
def test_a_fleet_rounds_staged_gradients_on_the_fleet_adapter_equal_full_autograd(tiny4, tiny4_tokenizer, pairs,
                                                                                  window, group):
    """In a federated round the fleet adapter is the trainable one (nothing beneath it, the base
    as reference), built as `daemon.fleet.device.rounds.round_trainer` builds it."""
    from daemon.fleet.device.rounds import round_trainer
    from daemon.wire import FleetRoundConfig

    given = _fleet(tiny4.cfg)
    trainer = round_trainer(tiny4, tiny4_tokenizer, given, FleetRoundConfig(beta=0.1, lr=1e-3), examples=3)
    trainer.dpo = DPOSettings(beta=0.1, window_tokens=window, layers_per_group=group, optimizer=trainer.dpo.optimizer)
    assert trainer.fleet is None and trainer.optimizer.settings.accumulation_steps == 3
    assert all(torch.equal(a, b) for a, b in zip(trainer.weights.parameters(), given.parameters(), strict=True))
    want = full_autograd_grads(trainer, pairs[:3], accumulation=3)
    got = staged_grads(trainer, pairs[:3])
    assert all(w.abs().max() > 0 for w in want)
    assert max_rel_error(got, want) <= 1e-4
