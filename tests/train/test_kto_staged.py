"""The staged KTO task: gradients equal one full-sequence autograd pass of the KTO loss (with the
reference point z0 from the user's recent mismatched answers, detached), also in a job that mixes
unpaired examples with a DPO pair; same stage kinds as a pair; the loss falls with training."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from edge_runtime.train import StageKind
from edge_runtime.train.dpo import dpo_loss
from edge_runtime.train.kto import KTOScore, kto_loss
from edge_runtime.train.logprobs import pair_logps_dense
from edge_runtime.train.objectives import KTOObjective
from edge_runtime.train.unpaired import UnpairedRecord
from tests.train.helpers import chat, make_trainer, max_rel_error


def unpaired_records() -> list[UnpairedRecord]:
    return [
        UnpairedRecord(chat("What is the capital of France?"), "Paris is the capital of France.", True, 1),
        UnpairedRecord(chat("Hello, how are you today?"), "The quick brown fox jumps over the lazy dog.", False, 2),
        UnpairedRecord(chat("Please write a short poem about the sea."), "The sea and the sky.", True, 3),
        UnpairedRecord(chat("Fine-tuning on the device?"), "Sure", False, 4),
    ]


def _kto_trainer(model, tokenizer, window, group, accumulation=16, lr=5e-4):
    trainer = make_trainer(model, tokenizer, window=window, group=group, accumulation=accumulation, lr=lr)
    trainer.dpo = dataclasses.replace(trainer.dpo, kto_desirable_weight=1.3, kto_undesirable_weight=0.8)
    return trainer


def _autograd_grads(trainer, tasks, accumulation):
    """One dense forward per example with grad, the KTO (or DPO) loss over them, one backward;
    z0 for each example: the mean of the earlier examples' and its own mismatched log-ratios."""
    for p in trainer.weights.parameters():
        p.grad = None
    samples: list[float] = []
    z0s = []
    for task in tasks:
        tokens = task.tokens
        ref_a, ref_b = (torch.tensor(v, dtype=torch.float32) for v in trainer.reference_logps(tokens))
        logps = pair_logps_dense(trainer.model, tokens, trainer.weights)
        if isinstance(task.objective, KTOObjective):
            if task.objective.example.has_kl:
                samples.append(float(logps[1].detach() - ref_b))
            z0 = max(0.0, sum(samples) / len(samples)) if samples else 0.0
            z0s.append(z0)
            s = trainer.dpo
            loss = kto_loss(logps[0], ref_a, torch.tensor(task.objective.example.desirable), z0, s.kto_beta,
                            s.kto_desirable_weight, s.kto_undesirable_weight)
        else:
            loss = dpo_loss(logps[0], logps[1], ref_a, ref_b, trainer.dpo.beta)
        (loss / accumulation).backward()
    grads = [p.grad.clone() for p in trainer.weights.parameters()]
    for p in trainer.weights.parameters():
        p.grad = None
    return grads, z0s


@pytest.mark.parametrize("window, group", [(None, 4), (4, 1), (3, 2)])
def test_kto_staged_gradients_equal_full_autograd_in_a_mixed_job(tiny4, tiny4_tokenizer, pairs, window, group):
    trainer = _kto_trainer(tiny4, tiny4_tokenizer, window, group)
    examples = unpaired_records()
    items = [examples[0], examples[1], pairs[0], examples[2], examples[3]]
    tasks = [trainer.task(item) for item in items]
    assert [isinstance(t.objective, KTOObjective) for t in tasks] == [True, True, False, True, True]
    assert not tasks[0].objective.example.has_kl and tasks[0].tokens.rejected == (tiny4_tokenizer.hf.eos_token_id,)
    # The mismatched answer is the user's previous answer (TRL rotates the batch by one).
    assert tasks[1].objective.example.has_kl and tasks[1].tokens.rejected == tasks[0].tokens.chosen
    for task in tasks:
        task.run()  # the optimizer stages accumulate (16 > 5 examples): nothing steps
    assert trainer.optimizer.steps == 0 and len(trainer.kl_samples) == 3
    got = [p.grad.clone() for p in trainer.weights.parameters()]
    want, z0s = _autograd_grads(trainer, tasks, accumulation=16)
    assert all(w.abs().max() > 0 for w in want)
    assert max_rel_error(got, want) <= 1e-4
    kto_results = [t.result for t in tasks if isinstance(t.objective, KTOObjective)]
    assert [r.z0 for r in kto_results] == pytest.approx(z0s, abs=1e-4)


def test_kto_task_has_the_stages_of_a_pair_and_its_score_matches_training(tiny4, tiny4_tokenizer):
    trainer = _kto_trainer(tiny4, tiny4_tokenizer, window=4, group=2, accumulation=1)
    trainer.task(unpaired_records()[0]).run()
    task = trainer.task(unpaired_records()[1])
    kinds = [s.kind for s in task.stages]
    assert kinds[0] is StageKind.SCORE and kinds[-1] is StageKind.OPTIMIZER
    assert kinds.count(StageKind.FORWARD) == len(task.windows) and kinds.count(StageKind.BACKWARD) == 2
    task.run()
    assert isinstance(task.score, KTOScore) and isinstance(task.result, KTOScore)
    assert not task.result.desirable
    assert task.score.loss == pytest.approx(task.result.loss, rel=1e-5)


def test_kto_training_separates_desirable_from_undesirable(tiny4, tiny4_tokenizer):
    trainer = _kto_trainer(tiny4, tiny4_tokenizer, window=8, group=2, accumulation=2, lr=2e-3)
    examples = unpaired_records()
    base = {name: p.detach().clone() for name, p in tiny4.named_parameters()}
    before = trainer.evaluate_unpaired(examples, trainer.weights)
    for _ in range(6):
        trainer.train(examples)
    after = trainer.evaluate_unpaired(examples, trainer.weights)
    assert after.margin > before.margin + 1.0
    assert trainer.evaluate_unpaired(examples, None).margin == 0.0  # the base: every log-ratio is 0
    assert all(torch.equal(p, base[name]) for name, p in tiny4.named_parameters())
