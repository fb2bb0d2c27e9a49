"""The publish guard's evaluation as background stages (train/guard_task.py): run stage by stage
it reaches the verdict the all-at-once guard reaches, and queued on an engine beside serving a
chat request that arrives while it runs is answered before the evaluation ends (issue #32: the
guard had run as one 35-172 s call on the engine thread)."""

from __future__ import annotations

from pathlib import Path

from edge_runtime import Engine, SamplingParams
from edge_runtime.lora import AdapterRegistry, LoraSettings
from edge_runtime.train import AdapterTrainer, DPOSettings, PreferenceRecord
from edge_runtime.train.guard import RegressionGuard, conclude, guard_evaluation, publish_guarded
from edge_runtime.train.optim import OptimizerSettings
from tests.lora.helpers import ALL_LINEAR, random_adapter


def _heldout(n: int) -> list[PreferenceRecord]:
    return [PreferenceRecord(({"role": "user", "content": f"Question {i}: tell me about item {i}."},),
                             f"Item {i} is fine.", f"No {i}.") for i in range(n)]


def _trainer(model, tokenizer) -> AdapterTrainer:
    dpo = DPOSettings(window_tokens=16, layers_per_group=2, optimizer=OptimizerSettings(learning_rate=1e-3))
    return AdapterTrainer(model, tokenizer, lora=LoraSettings(rank=4, alpha=8, target_modules=ALL_LINEAR), dpo=dpo)


def test_the_staged_evaluation_reaches_the_all_at_once_verdict(tiny4, tiny4_tokenizer, tmp_path):
    guard = RegressionGuard(degeneration_prompts=5, degeneration_tokens=6, batch_prompts=2)
    candidate = random_adapter(tiny4.cfg, LoraSettings(rank=4, alpha=8, target_modules=ALL_LINEAR), seed=5, std=0.5)
    heldout = _heldout(5)
    trainer = _trainer(tiny4, tiny4_tokenizer)
    whole, _ = publish_guarded(AdapterRegistry(tmp_path / "a", tiny4.cfg), trainer, "ann", heldout, guard, candidate)
    registry = AdapterRegistry(tmp_path / "b", tiny4.cfg)
    staged = guard_evaluation(registry, _trainer(tiny4, tiny4_tokenizer), "ann", heldout, guard, candidate)
    kinds = {s.kind.value for s in staged.stages}
    assert kinds <= {"score", "reference"}  # nothing that needs the adapter a training job holds
    assert len(staged.stages) > 10  # pairs one per stage; answers in batches of 2, a few tokens per stage
    while not staged.done:
        staged.run_next()
    decision, ref = conclude(registry, staged.source, "ann", staged)
    assert decision.as_dict() | {"degeneration": None} == whole.as_dict() | {"degeneration": None}
    mine, theirs = decision.degeneration.as_dict(), whole.degeneration.as_dict()
    assert {k: v for k, v in mine.items() if k != "seconds"} == {k: v for k, v in theirs.items() if k != "seconds"}
    assert (ref is not None) == decision.accepted
    assert staged.seconds > 0


def test_a_chat_request_is_answered_while_the_guard_evaluates(tiny_model_dir: Path, tmp_path: Path):
    engine = Engine.load(str(tiny_model_dir), dtype="float32", kv_cache_bytes=8 << 20, block_size=8,
                         cost_cache_dir=str(tmp_path), enable_prefix_cache=False)
    trainer = _trainer(engine.model, engine.tokenizer)
    guard = RegressionGuard(degeneration_prompts=16, degeneration_tokens=24)
    evaluation = guard_evaluation(engine.adapters, trainer, "ann", _heldout(16), guard)
    ended: list[str | None] = []
    engine.add_finetune(evaluation, user="ann", on_done=lambda job: ended.append(job.error))
    for _ in range(3):  # the evaluation is under way
        engine.step()
    assert 0 < evaluation._cursor < len(evaluation.stages)
    request = engine.add_request([{"role": "user", "content": "Hello?"}], SamplingParams(max_tokens=4, ignore_eos=True))
    answered_at = None
    for _ in range(5000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.request_id == request and out.finished:
                answered_at = evaluation._cursor
    assert ended == [None] and evaluation.done
    assert answered_at is not None and answered_at < len(evaluation.stages) // 2, (answered_at, len(evaluation.stages))
    assert evaluation.decision().degeneration is not None
