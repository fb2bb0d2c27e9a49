"""RPO (DPO plus the chosen answer's per-token NLL, TRL's `rpo_alpha`): our loss from summed
log-probs equals TRL's formula computed from the logits themselves (its `nll_loss` is the token
mean cross-entropy over the chosen completion), the objective's seed gives the same logit
gradients, and the staged task's gradients equal one full autograd pass of that loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from edge_runtime.train.dpo import DPOScore, dpo_loss, rpo_loss
from edge_runtime.train.logprobs import pair_logps_dense
from edge_runtime.train.objectives import DPOObjective
from tests.train.helpers import make_trainer, max_rel_error, staged_grads

IGNORE = -100


def _trl_style(policy: torch.Tensor, ref: torch.Tensor, labels: torch.Tensor, beta: float, alpha: float):
    """TRL's DPO + rpo_alpha * nll_loss, written from its definition: rows 0/1 are chosen/rejected,
    labels IGNORE outside the completion; sequence log-probs are sums of the completion's token
    log-probs; nll_loss is cross-entropy averaged over the chosen completion's tokens."""
    def seq_logps(logits):
        logp = torch.log_softmax(logits, -1)
        mask = labels != IGNORE
        picked = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        return (picked * mask).sum(-1)

    pc, pr = seq_logps(policy)
    rc, rr = seq_logps(ref)
    dpo = -F.logsigmoid(beta * ((pc - rc) - (pr - rr)))
    nll = F.cross_entropy(policy[0], labels[0], ignore_index=IGNORE)
    return dpo + alpha * nll, (pc, pr, rc, rr)


@pytest.mark.parametrize("alpha, beta", [(1.0, 0.1), (0.5, 0.5), (0.0, 0.3)])
def test_rpo_loss_and_seed_equal_trls_formula_on_the_same_logits(alpha, beta):
    g = torch.Generator().manual_seed(3)
    steps, vocab = 9, 17
    policy = torch.randn(2, steps, vocab, generator=g, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(2, steps, vocab, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (2, steps), generator=g)
    labels[:, :3] = IGNORE  # the prompt
    labels[0, 8:] = IGNORE  # the chosen answer is shorter: 5 tokens, the rejected one 6
    chosen_tokens = int((labels[0] != IGNORE).sum())

    want, (pc, pr, rc, rr) = _trl_style(policy, ref, labels, beta, alpha)
    ours = rpo_loss(pc, pr, rc, rr, beta, alpha, chosen_tokens)
    assert ours.item() == pytest.approx(want.item(), rel=1e-12)
    if alpha == 0.0:
        assert ours.item() == pytest.approx(dpo_loss(pc, pr, rc, rr, beta).item(), rel=1e-12)

    # The staged backward seeds d(loss)/d(summed log-probs) and chains through the log-probs;
    # that must give TRL's gradient on the logits.
    (want_grad,) = torch.autograd.grad(want, policy, retain_graph=True)
    objective = DPOObjective(beta, alpha, chosen_tokens)
    score = objective.score((pc.item(), pr.item()), (rc.item(), rr.item()))
    seed = objective.seed(score, accumulation_steps=1)
    got_grad = torch.autograd.grad((seed[0] * pc + seed[1] * pr), policy)[0]
    assert torch.allclose(got_grad, want_grad, rtol=1e-9, atol=1e-12)
    # The reported loss stays DPO's (the scheduler's priority); the optimised one adds the NLL.
    assert score.loss == pytest.approx(dpo_loss(pc, pr, rc, rr, beta).item(), rel=1e-9)
    assert score.objective_loss == pytest.approx(want.item(), rel=1e-9)


def test_rpo_needs_a_chosen_token():
    with pytest.raises(ValueError):
        rpo_loss(*(torch.tensor(0.0) for _ in range(4)), 0.1, 1.0, 0)
    assert DPOScore(-1.0, -2.0, -1.0, -2.0, 0.1).objective_loss == pytest.approx(DPOScore(
        -1.0, -2.0, -1.0, -2.0, 0.1).loss)


def test_staged_rpo_gradients_equal_full_autograd(tiny4, tiny4_tokenizer, pairs):
    trainer = make_trainer(tiny4, tiny4_tokenizer, window=4, group=2, accumulation=2)
    trainer.dpo = dataclasses.replace(trainer.dpo, rpo_alpha=1.0)
    for p in trainer.weights.parameters():
        p.grad = None
    for record in pairs[:2]:
        tokens = trainer.tokenize(record)
        ref_c, ref_r = (torch.tensor(v) for v in trainer.reference_logps(tokens))
        logps = pair_logps_dense(trainer.model, tokens, trainer.weights)
        loss = rpo_loss(logps[0], logps[1], ref_c, ref_r, trainer.dpo.beta, 1.0, len(tokens.chosen))
        (loss / 2).backward()
    want = [p.grad.clone() for p in trainer.weights.parameters()]
    for p in trainer.weights.parameters():
        p.grad = None
    got = staged_grads(trainer, pairs[:2])
    assert max_rel_error(got, want) <= 1e-4
    # The NLL term changes the update: DPO alone gives other gradients.
    for p in trainer.weights.parameters():
        p.grad = None
    trainer.dpo = dataclasses.replace(trainer.dpo, rpo_alpha=0.0)
    assert max_rel_error(staged_grads(trainer, pairs[:2]), want) > 1e-2
