"""Training a pair on where its completions differ (`DPOSettings.trim_shared_suffix`): an edit
("Indeed, " + the answer) is cut to the openings that differ, and what the staged task optimises
equals TRL's DPO + rpo_alpha * NLL computed from the whole answers' logits with the shared tail's
labels ignored (a causal model's prefix log-probs do not see later tokens, so the two agree)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from edge_runtime.model.dense import dense_logits
from edge_runtime.train import PreferenceRecord
from edge_runtime.train.pairs import PairTokens, shared_suffix, tokenize_pair, trim_shared_suffix
from tests.train.helpers import chat, make_trainer, max_rel_error, staged_grads

IGNORE = -100


def test_trim_cuts_the_shared_tail_and_keeps_a_token_of_each():
    t = PairTokens((1, 2), (7, 8, 5, 6, 0), (9, 5, 6, 0))
    assert shared_suffix(t.chosen, t.rejected) == 3
    assert trim_shared_suffix(t) == PairTokens((1, 2), (7, 8), (9,))
    # One completion is the other's tail: each keeps at least one token.
    assert trim_shared_suffix(PairTokens((1,), (4, 5, 6), (5, 6))) == PairTokens((1,), (4, 5), (5,))
    # Nothing shared: unchanged. Identical answers (no preference, a zero DPO term) keep one token.
    assert trim_shared_suffix(PairTokens((1,), (4, 5), (6, 7))) == PairTokens((1,), (4, 5), (6, 7))
    same = PairTokens((1,), (4, 5), (4, 5))
    assert trim_shared_suffix(same) == PairTokens((1,), (4,), (4,))


def test_an_edit_is_trimmed_to_its_opening(tiny4_tokenizer):
    record = PreferenceRecord(chat("What is the capital of Austria?"), "Indeed, the capital of Austria is Vienna.",
                              "The capital of Austria is Vienna.")
    whole = tokenize_pair(tiny4_tokenizer, record)
    cut = tokenize_pair(tiny4_tokenizer, record, trim_suffix=True)
    assert cut.prompt == whole.prompt
    assert whole.chosen[: len(cut.chosen)] == cut.chosen and whole.rejected[: len(cut.rejected)] == cut.rejected
    tail = len(whole.chosen) - len(cut.chosen)
    assert tail == len(whole.rejected) - len(cut.rejected) > 3  # " capital of Austria is Vienna." + EOS at least
    assert whole.chosen[-tail:] == whole.rejected[-tail:]
    assert cut.chosen[-1] != cut.rejected[-1]
    assert tiny4_tokenizer.hf.decode(cut.chosen).startswith("Indeed")


def _trl_masked(model, tokens: PairTokens, lora, beta, alpha, keep: tuple[int, int]):
    """TRL's DPO + alpha * NLL on the whole completions, labels IGNORE'd past `keep[row]` tokens;
    the reference is the same model with the adapter off."""
    p = len(tokens.prompt)
    rows, labels = [], []
    width = max(len(tokens.chosen), len(tokens.rejected))
    for comp, k in zip((tokens.chosen, tokens.rejected), keep, strict=True):
        rows.append(list(tokens.prompt) + list(comp) + [0] * (width - len(comp)))
        labels.append([IGNORE] * p + list(comp[:k]) + [IGNORE] * (width - k))
    ids = torch.tensor(rows)
    mask = torch.ones_like(ids)
    target = torch.tensor(labels)[:, 1:]

    def sums(logits):
        logp = torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0)[..., None])[..., 0]
        return (logp * (target != IGNORE)).sum(-1)

    logits = dense_logits(model, ids, mask, lora).float()[:, :-1]
    with torch.no_grad():
        ref = sums(dense_logits(model, ids, mask, None).float()[:, :-1])
    pol = sums(logits)
    dpo = -F.logsigmoid(beta * ((pol[0] - ref[0]) - (pol[1] - ref[1])))
    nll = F.cross_entropy(logits[0], target[0], ignore_index=IGNORE)
    return dpo + alpha * nll


def test_trimmed_staged_gradients_equal_trls_loss_with_the_shared_tail_ignored(tiny4, tiny4_tokenizer):
    trainer = make_trainer(tiny4, tiny4_tokenizer, window=4, group=2)
    trainer.dpo = dataclasses.replace(trainer.dpo, rpo_alpha=1.0, trim_shared_suffix=True)
    record = PreferenceRecord(chat("What is the capital of Austria?"), "Indeed, the capital of Austria is Vienna.",
                              "The capital of Austria is Vienna.")
    whole = tokenize_pair(tiny4_tokenizer, record)
    cut = trainer.tokenize(record)
    assert cut == trim_shared_suffix(whole)
    for p in trainer.weights.parameters():
        p.grad = None
    loss = _trl_masked(trainer.model, whole, trainer.weights, trainer.dpo.beta, 1.0,
                       (len(cut.chosen), len(cut.rejected)))
    loss.backward()
    want = [p.grad.clone() for p in trainer.weights.parameters()]
    for p in trainer.weights.parameters():
        p.grad = None
    got = staged_grads(trainer, [record])
    assert max_rel_error(got, want) <= 1e-4
    # Untrimmed, the shared tail adds its own gradient: a different update.
    for p in trainer.weights.parameters():
        p.grad = None
    trainer.dpo = dataclasses.replace(trainer.dpo, trim_shared_suffix=False)
    assert max_rel_error(staged_grads(trainer, [record]), want) > 1e-2
