"""The guard's degeneration check: distinct-n and per-token KL against hand-computed values, greedy
answers through the KV windows equal to full forwards, and an adapter over-trained on one word is
refused (repetition and KL, with the figures) while a mildly trained one is published with them."""

from __future__ import annotations

import math

import pytest
import torch

from edge_runtime.lora import AdapterRef, AdapterRegistry, LoraSettings
from edge_runtime.model.dense import dense_logits
from edge_runtime.train import AdapterTrainer, DPOSettings, PreferenceRecord
from edge_runtime.train.degeneration import (
    DegenerationMetrics,
    answer_logits,
    distinct_n,
    greedy_answers,
    max_word_repeats,
    shared_closing,
    shared_opening,
    summarize,
    token_kl,
    words,
)
from edge_runtime.train.guard import RegressionGuard, publish_guarded
from edge_runtime.train.optim import OptimizerSettings
from tests.lora.helpers import ALL_LINEAR, random_adapter


def test_distinct_n_counts_each_answers_ngrams_as_li_et_al():
    answers = [["a", "b", "a", "b"], ["c"]]
    assert distinct_n(answers, 1) == pytest.approx(3 / 5)  # a b a b c
    assert distinct_n(answers, 2) == pytest.approx(2 / 3)  # ab ba ab; none across answers
    assert distinct_n([[]], 2) == 1.0


class _Words:
    """A tokenizer whose token i is the word "w<i>" (summarize decodes answers for word repeats)."""

    eos_ids = frozenset({0})

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


def test_an_opening_the_user_asked_for_is_not_read_as_repetition():
    """The preference itself ("Hon|est|ly|," before each of the base's own answers) leaves
    distinct-2 where the base's is; a template behind the opening still drops it."""
    base = [[10 + 12 * i + j for j in range(12)] for i in range(12)]  # 12 answers, no bigram twice
    opening = [1, 2, 3, 4]
    learned = [opening + a[:8] for a in base]
    assert shared_opening(learned) == 4 and shared_opening(base) == 0
    assert shared_opening([opening + [5], [9, 9, 9]]) == 0  # one answer alone is no shared opening
    m = summarize(_Words(), 12, 12, learned, [], base, 0.0)
    assert m.opening_tokens == 4 and m.distinct_2_drop <= 0.0
    assert distinct_n(learned, 2) < 0.85 * distinct_n(base, 2)  # what counting the opening read
    template = [opening + [90, 91, 92, 93, 94, 95] + a[:2] for a in base]
    assert summarize(_Words(), 12, 12, template, [], base, 0.0).distinct_2_drop > 0.3


def test_a_sign_off_the_user_asked_for_is_not_read_as_repetition():
    """The bench's preference ("...\n\nCheers, Sam!" and the stop id, behind the base's own
    answers) leaves distinct-2 where the base's is; a template before the sign-off still drops it."""
    base = [[10 + 12 * i + j for j in range(12)] for i in range(12)]
    closing = [1, 2, 3, 4, 5, 0]  # the sign-off's tokens, then the stop id
    learned = [a[:8] + closing for a in base]
    assert shared_closing(learned, {0}) == 6 and shared_closing(base, {0}) == 0
    assert shared_closing([[5] + closing, [9, 9, 9]], {0}) == 0  # one answer alone is no shared closing
    assert shared_closing([a[:8] + closing[:-1] for a in base], {0}) == 0  # cut at the cap: no closing
    m = summarize(_Words(), 12, 14, learned, [], base, 0.0)
    assert m.closing_tokens == 6 and m.opening_tokens == 0 and m.distinct_2_drop <= 0.0
    assert distinct_n(learned, 2) < 0.75 * distinct_n(base, 2)  # what counting the sign-off read
    # The KL leaves out the closing's positions where an answer carries it, as it does the first two.
    kls = [torch.full((len(a) - 2,), 3.0 if i % 2 else 1.0, dtype=torch.float64) for i, a in enumerate(learned)]
    for i in range(6):
        kls[2 * i + 1][:6] = 0.5  # the body of the odd answers drifts less than their sign-off
    one_cut = [a[:8] + closing[:-1] for a in learned[:1]]  # cut at the cap, no closing: charged in full
    m = summarize(_Words(), 13, 14, learned + one_cut, kls + [torch.full((11,), 2.0, dtype=torch.float64)],
                  base + base[:1], 0.0)
    assert m.kl_tokens == 12 * 6 + 11 and m.kl_per_token == pytest.approx((6 * 6 * 1.0 + 6 * 6 * 0.5 + 22) / 83)
    with pytest.raises(ValueError):
        summarize(_Words(), 12, 14, learned, kls[:-1], base, 0.0)
    template = [a[:2] + [90, 91, 92, 93, 94, 95] + closing for a in base]
    assert summarize(_Words(), 12, 14, template, [], base, 0.0).distinct_2_drop > 0.3


def test_word_repeats_ignore_case_and_punctuation():
    assert words("Indeed, indeed. Indeed!") == ["indeed"] * 3
    assert max_word_repeats([words("Indeed, indeed. Indeed, a leap year."), ["x"]]) == 3


def test_token_kl_matches_a_hand_computed_value():
    policy = torch.tensor([[math.log(0.5), math.log(0.5)], [0.0, 0.0]], dtype=torch.float64)
    reference = torch.tensor([[math.log(0.25), math.log(0.75)], [0.0, 0.0]], dtype=torch.float64)
    kl = token_kl(policy, reference)
    # 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln 2 + 0.5 ln(2/3)
    assert kl[0].item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), abs=1e-12)
    assert kl[1].item() == pytest.approx(0.0, abs=1e-12)


def test_greedy_answers_equal_full_forwards_and_their_logits(tiny4, tiny4_tokenizer):
    prompt = list(tiny4_tokenizer.encode("Hello there, how are you?"))
    fleet = random_adapter(tiny4.cfg, LoraSettings(rank=4, alpha=8, target_modules=ALL_LINEAR), seed=3, std=1.0)
    got = greedy_answers(tiny4, [prompt], fleet, 6)
    ids = list(prompt)
    for _ in range(6):
        ids.append(int(dense_logits(tiny4, torch.tensor([ids]), lora=fleet)[0, -1].argmax()))
    assert got.ids[0] == ids[len(prompt):]
    again = answer_logits(tiny4, prompt, got.ids[0], fleet)
    assert torch.allclose(again, got.logits[0], atol=1e-4)


def _metrics(kl: float, d2: float, repeats: int = 1) -> DegenerationMetrics:
    return DegenerationMetrics(4, 24, kl, 88, 0.5, d2, 0.6, 0.9, repeats, 2)


def test_guard_refuses_drift_and_repetition_and_states_the_figures():
    guard = RegressionGuard(kl_budget=1.0, distinct_2_drop=0.10, max_word_repeats=4)
    ok = guard.check(None, None, degeneration=_metrics(0.4, 0.85))
    assert ok.accepted and "KL 0.400 nats/token" in ok.reason and "distinct-2 0.850 vs base 0.900" in ok.reason
    refused = guard.check(None, None, degeneration=_metrics(1.5, 0.5, repeats=9))
    assert not refused.accepted
    assert "KL from the base 1.500" in refused.reason and "distinct-2 0.500 is 44% below" in refused.reason
    assert "repeat a word 9x (limit 4)" in refused.reason
    assert refused.as_dict()["degeneration"]["kl_per_token"] == 1.5


def _fleet_trainer(model, tokenizer, lr: float) -> AdapterTrainer:
    # The random tiny model answers every prompt with one repeated token; a strong random adapter
    # beneath (the reference includes it) gives it varied answers to collapse from.
    fleet = random_adapter(model.cfg, LoraSettings(rank=8, alpha=16, target_modules=ALL_LINEAR), seed=1, std=1.0)
    dpo = DPOSettings(window_tokens=None, layers_per_group=2,
                      optimizer=OptimizerSettings(accumulation_steps=1, learning_rate=lr))
    return AdapterTrainer(model, tokenizer, LoraSettings(rank=4, alpha=8), dpo, fleet=fleet)


def test_adapter_overtrained_on_one_word_is_refused_and_a_mild_one_published(tiny4, tiny4_tokenizer, pairs):
    torch.set_num_threads(1)  # tiny forwards: threads only contend on a shared machine
    word = [PreferenceRecord(p.prompt, "yes yes yes yes yes yes yes yes", p.chosen) for p in pairs]
    # The tiny model's greedy answers flip on small changes, so distinct-2 gets a looser bar than
    # the default's; the KL budget sits between the two adapters' (measured ~0.0003 and ~0.03).
    guard = RegressionGuard(0.0, 0.0, kl_budget=0.01, distinct_2_drop=0.25)
    registry = AdapterRegistry(None, tiny4.cfg)

    mild = _fleet_trainer(tiny4, tiny4_tokenizer, lr=1e-3)
    mild.train(word)
    decision, ref = publish_guarded(registry, mild, "mild", word, guard)
    assert decision.accepted and ref == AdapterRef("mild", 1), decision.reason
    published = registry.events("mild")[-1]
    assert published["degeneration"]["kl_per_token"] == decision.degeneration.kl_per_token < 0.01
    assert published["degeneration"]["base_distinct_2"] > 0.8

    hard = _fleet_trainer(tiny4, tiny4_tokenizer, lr=5e-2)
    for _ in range(15):
        hard.train(word)
    decision, ref = publish_guarded(registry, hard, "hard", word, guard)
    # What the issue saw: the held-out preference metrics only grew as the adapter collapsed.
    assert decision.after.win_rate >= decision.before.win_rate and decision.after.clpd > decision.before.clpd
    assert not decision.accepted and ref is None and registry.newest("hard") is None
    d = decision.degeneration
    assert d.distinct_2 < 0.5 * d.base_distinct_2 and d.kl_per_token > 0.01
    assert "greedy answers repeat: distinct-2" in decision.reason and "KL from the base" in decision.reason
    assert registry.events("hard")[-1]["degeneration"]["distinct_2"] == d.distinct_2


def test_the_reference_answers_are_computed_once_per_prompt(tiny4, tiny4_tokenizer, pairs):
    torch.set_num_threads(1)
    trainer = _fleet_trainer(tiny4, tiny4_tokenizer, lr=1e-3)
    registry = AdapterRegistry(None, tiny4.cfg)
    first, _ = publish_guarded(registry, trainer, "ann", pairs[:2], RegressionGuard(degeneration_prompts=2))
    assert len(trainer.reference_answers) == 2
    cached = dict(trainer.reference_answers)
    second, _ = publish_guarded(registry, trainer, "ann", pairs[:2], RegressionGuard(degeneration_prompts=2))
    assert trainer.reference_answers == cached
    assert second.degeneration.base_distinct_2 == first.degeneration.base_distinct_2
