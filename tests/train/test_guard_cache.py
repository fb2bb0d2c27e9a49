"""What one candidate's guard evaluation recomputes (issue #32: a guarded publish took minutes): the
served version's held-out rows come back from the previous evaluation and only a new held-out pair
is scored under it, the reference's greedy answers are made once per prompt and again for a new
prompt or a new base (fleet) beneath, and a candidate is judged on at most `max_heldout_pairs`
pairs, the newest always among them, the rest chosen stably as the set grows. Verdicts unchanged."""

from __future__ import annotations

from edge_runtime.lora import AdapterRegistry, LoraSettings
from edge_runtime.train import AdapterTrainer, DPOSettings, PreferenceRecord
from edge_runtime.train.guard import RegressionGuard, guard_evaluation
from edge_runtime.train.guard_task import judged_pairs
from edge_runtime.train.pairs import PairTokens
from tests.lora.helpers import ALL_LINEAR, random_adapter

SETTINGS = LoraSettings(rank=4, alpha=8, target_modules=ALL_LINEAR)


def _pairs(n: int, start: int = 0) -> list[PreferenceRecord]:
    return [PreferenceRecord(({"role": "user", "content": f"Question {i}: say something about {i}."},),
                             f"Indeed, {i} is fine.", f"{i} is fine.") for i in range(start, start + n)]


def _trainer(model, tokenizer) -> AdapterTrainer:
    return AdapterTrainer(model, tokenizer, lora=SETTINGS, dpo=DPOSettings(window_tokens=16, layers_per_group=2))


def _scored(evaluation, field: str) -> int:
    return sum(1 for s in evaluation.stages if s.name.startswith(f"guard {field}["))


def test_the_served_rows_of_the_last_evaluation_are_reused_and_a_new_pair_is_scored(tiny4, tiny4_tokenizer,
                                                                                   tmp_path):
    guard = RegressionGuard(degeneration_prompts=2, degeneration_tokens=4)
    registry = AdapterRegistry(tmp_path, tiny4.cfg)
    registry.publish("ann", random_adapter(tiny4.cfg, SETTINGS, seed=1, std=0.3))
    candidate = random_adapter(tiny4.cfg, SETTINGS, seed=2, std=0.3)
    trainer = _trainer(tiny4, tiny4_tokenizer)
    heldout = _pairs(4)
    first = guard_evaluation(registry, trainer, "ann", heldout, guard, candidate)
    assert _scored(first, "before") == 4 and _scored(first, "after") == 4
    first.run()
    rows = first.pair_rows["before"]
    assert len(rows) == 4
    again = guard_evaluation(registry, trainer, "ann", heldout, guard, candidate, served_rows=rows)
    assert _scored(again, "before") == 0 and _scored(again, "after") == 4
    assert again.run().as_dict() | {"degeneration": None} == first.decision().as_dict() | {"degeneration": None}
    grown = guard_evaluation(registry, trainer, "ann", heldout + _pairs(1, 4), guard, candidate, served_rows=rows)
    assert _scored(grown, "before") == 1  # only the new held-out pair under the served version
    fresh = guard_evaluation(registry, _trainer(tiny4, tiny4_tokenizer), "ann", heldout + _pairs(1, 4), guard,
                             candidate)
    assert grown.run().before == fresh.run().before  # the same metrics as scoring every pair again


def test_the_reference_answers_are_made_again_for_a_new_prompt_and_a_new_base(tiny4, tiny4_tokenizer, tmp_path):
    guard = RegressionGuard(degeneration_prompts=3, degeneration_tokens=4)
    registry = AdapterRegistry(tmp_path, tiny4.cfg)
    candidate = random_adapter(tiny4.cfg, SETTINGS, seed=2, std=0.3)
    trainer = _trainer(tiny4, tiny4_tokenizer)

    def reference_stages(heldout):
        evaluation = guard_evaluation(registry, trainer, "ann", heldout, guard, candidate)
        n = sum(1 for s in evaluation.stages if s.name.startswith("guard reference"))
        evaluation.run()
        return n

    assert reference_stages(_pairs(2)) > 0
    assert len(trainer.reference_answers) == 2
    assert reference_stages(_pairs(2)) == 0  # the same prompts, the same base: known
    assert reference_stages(_pairs(3)) > 0  # a new held-out prompt
    assert len(trainer.reference_answers) == 3
    assert reference_stages(_pairs(3)) == 0
    trainer.set_fleet(random_adapter(tiny4.cfg, SETTINGS, seed=9, std=0.3), key="fleet@2")  # a new base
    assert reference_stages(_pairs(3)) > 0
    assert {key[0] for key in trainer.reference_answers} == {"", "fleet@2"}


def _tokens(i: int) -> PairTokens:
    return PairTokens((1, 2, i), (3, i, 0), (4, i, 0))


def test_at_most_the_cap_is_judged_the_newest_always_and_the_rest_stably():
    pairs = [_tokens(i) for i in range(40)]
    assert judged_pairs(pairs[:16], 16) == pairs[:16]  # under the cap: all, in order
    assert judged_pairs(pairs, 0) == pairs  # 0: no cap
    chosen = judged_pairs(pairs, 16)
    assert len(chosen) == 16 and chosen == [p for p in pairs if p in chosen]  # in the set's order
    assert pairs[-4:] == chosen[-4:]  # the newest quarter
    grown = judged_pairs(pairs + [_tokens(40)], 16)
    assert grown[-1] == _tokens(40)
    # Older pairs chosen before stay chosen unless the newcomers pushed them out: most carry over.
    assert len(set(chosen[:-4]) & set(grown)) >= 10
