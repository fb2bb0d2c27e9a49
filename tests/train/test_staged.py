"""The staged fine-tune task: gradients equal one full-sequence autograd pass of the same DPO loss
(fp32, max relative error <= 1e-4) however the pair is cut into windows and layer groups; stages
report estimates; only LoRA parameters change; activations can be shed and recomputed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from edge_runtime.train import StageKind
from edge_runtime.train.logprobs import pair_logps, pair_logps_dense
from edge_runtime.train.staged import FineTuneTask
from tests.train.helpers import full_autograd_grads, make_trainer, max_rel_error, staged_grads


@pytest.mark.parametrize("window, group", [(None, 4), (None, 1), (4, 1), (3, 2), (7, 3)])
def test_staged_gradients_equal_full_autograd(tiny4, tiny4_tokenizer, pairs, window, group):
    trainer = make_trainer(tiny4, tiny4_tokenizer, window=window, group=group, accumulation=2)
    want = full_autograd_grads(trainer, pairs[:2], accumulation=2)
    got = staged_grads(trainer, pairs[:2])  # two pairs accumulate into the same .grad
    assert all(w.abs().max() > 0 for w in want)
    assert max_rel_error(got, want) <= 1e-4


def test_held_graphs_path_equals_full_autograd(tiny4, tiny4_tokenizer, pairs, monkeypatch):
    # The path that keeps the forward's graphs instead of recomputing each layer in the backward.
    monkeypatch.setattr(FineTuneTask, "recompute", False)
    trainer = make_trainer(tiny4, tiny4_tokenizer, window=3, group=2, accumulation=2)
    want = full_autograd_grads(trainer, pairs[:2], accumulation=2)
    assert max_rel_error(staged_grads(trainer, pairs[:2]), want) <= 1e-4


def test_recompute_replays_lora_dropout_and_holds_layer_inputs_only(tiny4, tiny4_tokenizer, pairs, monkeypatch):
    # With dropout the recomputed layer must draw the masks the forward drew: the gradients equal
    # those of the path that keeps the forward's graphs, from the same seed.
    grads, held = {}, {}
    for recompute in (False, True):
        monkeypatch.setattr(FineTuneTask, "recompute", recompute)
        trainer = make_trainer(tiny4, tiny4_tokenizer, window=4, group=3)
        trainer.weights.settings = dataclasses.replace(trainer.weights.settings, dropout=0.3)
        torch.manual_seed(11)
        task = trainer.task(pairs[1], score=False)
        held[recompute] = []
        while task.next_stage().kind is not StageKind.OPTIMIZER:
            task.run_next()
            held[recompute].append(task.held_bytes)
        trainer.release(task)
        grads[recompute] = [p.grad.clone() for p in trainer.weights.parameters()]
    assert all(g.abs().max() > 0 for g in grads[True])
    assert max_rel_error(grads[True], grads[False]) <= 1e-4
    # The estimate of what is held between forward and backward: the layer inputs, not the graphs.
    assert 0 < max(held[True]) < max(held[False])


def test_windowed_log_probs_equal_one_dense_pass(tiny4, tiny4_tokenizer, pairs):
    trainer = make_trainer(tiny4, tiny4_tokenizer)
    for record in pairs:
        tokens = trainer.tokenize(record)
        dense = pair_logps_dense(tiny4, tokens, trainer.weights).tolist()
        for window in (None, 2, 5):
            assert pair_logps(tiny4, tokens, trainer.weights, window) == pytest.approx(dense, rel=1e-5)


def test_stages_run_in_order_with_estimates_and_release_their_memory(tiny4, tiny4_tokenizer, pairs):
    trainer = make_trainer(tiny4, tiny4_tokenizer, window=4, group=2, accumulation=1)
    task = trainer.task(pairs[0])
    kinds = [s.kind for s in task.stages]
    assert kinds[0] is StageKind.SCORE and kinds[-1] is StageKind.OPTIMIZER
    assert kinds.count(StageKind.BACKWARD) == 2 and kinds.count(StageKind.FORWARD) == len(task.windows)
    # The score is windowed like the forward (so each stage fits an iteration's slack) and gives
    # the same loss as one unstaged no-grad pass.
    assert kinds.count(StageKind.SCORE) == len(task.windows) > 1
    whole = trainer.score_tokens(task.tokens)
    held = []
    while not task.done:
        estimate = task.next_stage().estimate()
        assert estimate.seconds >= 0 and estimate.peak_bytes >= 0
        task.run_next()
        held.append(task.held_bytes)
    assert max(held) > 0 and held[-1] == 0
    assert task.score is not None and task.result is not None
    assert task.score.loss == pytest.approx(whole.loss, rel=1e-5)
    # Before any step the policy is unchanged, so the score and the trained loss agree.
    assert task.score.loss == pytest.approx(task.result.loss, rel=1e-5)
    assert task.stepped and trainer.optimizer.steps == 1 and trainer.pairs_trained == 1


def test_only_lora_parameters_change_and_the_loss_falls(tiny4, tiny4_tokenizer, pairs):
    trainer = make_trainer(tiny4, tiny4_tokenizer, window=8, group=2, accumulation=2, lr=2e-3)
    base = {name: p.detach().clone() for name, p in tiny4.named_parameters()}
    before = trainer.evaluate(pairs, trainer.weights)
    for _ in range(6):
        trainer.train(pairs)
    after = trainer.evaluate(pairs, trainer.weights)
    assert after.dpo_loss < before.dpo_loss - 0.05
    assert after.clpd > before.clpd
    assert all(torch.equal(p, base[name]) for name, p in tiny4.named_parameters())


def test_abandoned_task_recomputes_to_the_same_gradients(tiny4, tiny4_tokenizer, pairs):
    trainer = make_trainer(tiny4, tiny4_tokenizer, window=4, group=2)
    want = staged_grads(trainer, pairs[:1])
    for p in trainer.weights.parameters():
        p.grad = None
    task = trainer.task(pairs[0], score=False)
    task.run_next()
    task.run_next()
    assert task.held_bytes > 0
    task.abandon()  # memory pressure: drop activations
    assert task.held_bytes == 0 and task.next_stage().name.startswith("forward[prompt 0:")
    while task.next_stage().kind is not StageKind.BACKWARD:
        task.run_next()
    task.run_next()
    assert not task.can_abandon  # one group's gradients are in: a restart would count them twice
    with pytest.raises(RuntimeError, match="backward of this pair has begun"):
        task.abandon()
    while task.next_stage().kind is not StageKind.OPTIMIZER:
        task.run_next()
    got = [p.grad.clone() for p in trainer.weights.parameters()]
    assert max_rel_error(got, want) <= 1e-6


def test_one_task_at_a_time_holds_the_adapter(tiny4, tiny4_tokenizer, pairs):
    trainer = make_trainer(tiny4, tiny4_tokenizer)
    first = trainer.task(pairs[0], score=False)
    while first.run_next().kind is not StageKind.FORWARD:
        pass
    second = trainer.task(pairs[1], score=False)
    second.run_next()  # its reference log-probs need no adapter: allowed
    with pytest.raises(RuntimeError, match="another fine-tune task"):
        second.run_next()
    first.run()
    second.run()
    assert trainer.pairs_trained == 2


def test_reference_log_probs_are_computed_once_per_pair(tiny4, tiny4_tokenizer, pairs):
    trainer = make_trainer(tiny4, tiny4_tokenizer)
    first = trainer.task(pairs[0], score=False)
    assert first.stages[0].kind is StageKind.REFERENCE  # a visible cost the first time only
    first.run()
    assert trainer.task(pairs[0], score=False).stages[0].kind is StageKind.FORWARD
    trainer.train(pairs[:2])
    trainer.train(pairs[:2])
    assert len(trainer.reference) == 2 and trainer.reference.misses == 2


def test_unscored_tasks_are_ranked_by_the_adapters_expected_loss(tiny4, tiny4_tokenizer, pairs):
    import math

    from edge_runtime.sched.finetune import FineTuneJob

    trainer = make_trainer(tiny4, tiny4_tokenizer, window=4, group=2)
    waiting = FineTuneJob("later", trainer.task(pairs[1], score=False), 0.0, 0.0)
    assert trainer.recent_loss is None and waiting.loss_for_priority() == pytest.approx(math.log(2.0))
    task = trainer.task(pairs[0], score=False)
    assert all(s.kind is not StageKind.SCORE for s in task.stages)
    result = task.run()
    # The trained pair's loss, measured by its own forward, becomes the estimate for the next.
    assert trainer.recent_loss == pytest.approx(result.loss)
    assert waiting.loss_for_priority() == pytest.approx(result.loss)
    second = trainer.task(pairs[1], score=False).run()
    assert trainer.recent_loss == pytest.approx(0.7 * result.loss + 0.3 * second.loss)
