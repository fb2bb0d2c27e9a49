"""Co-serving on the engine (tiny random llama, fast): greedy outputs do not change when DPO
fine-tuning runs in the same iterations, fine-tune jobs complete under every policy, the ledger
holds on a randomised workload with budget changes, shedding follows ARCHITECTURE.md, and the
forward cost model is calibrated once and then read from its cache. One slow test repeats the
invariant on the default model."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from edge_runtime import Engine, SamplingParams
from edge_runtime.errors import AdmissionRejected
from edge_runtime.lora import LoraSettings
from edge_runtime.lora.weights import LoraWeights
from edge_runtime.memory import MemoryKind
from edge_runtime.sched import cost_model
from edge_runtime.train import AdapterTrainer, DPOSettings, PreferenceRecord
from edge_runtime.train.optim import OptimizerSettings

PROMPTS = [f"Question {i}: what do you know about {topic}?" for i, topic in
           enumerate(["rivers", "the moon", "bread", "chess", "rain", "owls", "glass", "maps"])]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def chat(text: str) -> tuple[dict[str, str], ...]:
    return ({"role": "user", "content": text},)


PAIRS = [
    PreferenceRecord(chat("What is the capital of France?"), "Paris is the capital of France.", "Lyon."),
    PreferenceRecord(chat("Hello, how are you today?"), "I am fine, thank you for asking.", "Go away."),
    PreferenceRecord(chat("Write a line about the sea."), "The sea is wide and calm tonight.", "No."),
    PreferenceRecord(chat("Is my data kept on the device?"), "Yes, your data stays on this device.", "Maybe"),
]


def make_engine(model_dir: Path, cache_dir: Path, **overrides) -> Engine:
    settings = {"dtype": "float32", "kv_cache_bytes": 8 << 20, "block_size": 8, "cost_cache_dir": str(cache_dir)}
    settings.update(overrides)
    return Engine.load(str(model_dir), **settings)


def trainer_for(engine: Engine, seed: int = 0) -> AdapterTrainer:
    dpo = DPOSettings(window_tokens=8, layers_per_group=1, seed=seed, optimizer=OptimizerSettings(accumulation_steps=1))
    return AdapterTrainer(engine.model, engine.tokenizer, lora=LoraSettings(rank=4, alpha=8), dpo=dpo)


def run_all(engine: Engine, limit: int = 20000) -> None:
    for _ in range(limit):
        if not engine.has_unfinished():
            return
        engine.step()
    raise AssertionError("the engine did not finish its work")


@pytest.fixture(scope="module")
def cost_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("costs")


@pytest.fixture(scope="module")
def alone(tiny_model_dir: Path, cost_cache: Path) -> list[list[int]]:
    engine = make_engine(tiny_model_dir, cost_cache, enable_prefix_cache=False)
    return [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("policy", ["mace", "token-level", "continuous", "apt"])
def test_greedy_output_unchanged_when_finetuning_colocated(tiny_model_dir: Path, cost_cache: Path, alone, policy) -> None:
    engine = make_engine(tiny_model_dir, cost_cache, policy=policy, enable_prefix_cache=False, slo_tbt_ms=5000)
    trainer = trainer_for(engine)
    jobs = [engine.add_finetune(trainer.task(pair), user="alice") for pair in PAIRS]
    shared = []
    schedule = engine.scheduler.schedule

    def observe(now):
        batch = schedule(now)
        shared.append(bool(batch.items) and bool(batch.finetune))
        return batch

    engine.scheduler.schedule = observe
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    outputs = {}
    for _ in range(20000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
    assert [outputs[i] for i in ids] == alone
    stats = engine.stats()
    assert stats["finetune_pairs_done"] == len(jobs) and stats["finetune_failed"] == 0
    assert trainer.pairs_trained == len(jobs)
    assert any(shared), "no iteration held inference and fine-tuning together"
    assert engine.ledger.peak_used <= engine.ledger.budget


def test_finetuning_changes_the_adapter_but_not_the_base(tiny_model_dir: Path, cost_cache: Path) -> None:
    engine = make_engine(tiny_model_dir, cost_cache, policy="mace")
    trainer = trainer_for(engine)
    before = {k: v.clone() for k, v in trainer.weights.b.items()}
    base = [p.detach().clone() for p in engine.model.parameters()]
    done = []
    for pair in PAIRS[:2]:
        engine.add_finetune(trainer.task(pair), on_done=done.append)
    run_all(engine)
    assert [job.error for job in done] == [None, None] and all(job.stages_run > 3 for job in done)
    assert any((trainer.weights.b[k] - before[k]).abs().max() > 0 for k in before)
    assert all((p == q).all() for p, q in zip(engine.model.parameters(), base, strict=True))
    assert engine.ledger.held(MemoryKind.ACTIVATIONS) == 0
    assert engine.ledger.held(MemoryKind.OPTIMIZER) == trainer.persistent_bytes


@pytest.mark.parametrize("seed, policy", enumerate(["mace", "fcfs", "periodic", "continuous", "fifo", "token-level", "apt"]))
def test_engine_ledger_never_exceeded_with_random_work_and_budgets(tiny_model_dir: Path, cost_cache: Path, seed: int,
                                                                   policy: str) -> None:
    rng = random.Random(seed)
    params = {"period_s": 0.01} if policy == "periodic" else {}
    engine = make_engine(tiny_model_dir, cost_cache, policy=policy, policy_params=params, kv_cache_bytes=1 << 20)
    trainers = [trainer_for(engine, seed=s) for s in range(2)]
    for t in trainers:
        engine.add_finetune(t.task(PAIRS[0]))
    floor = engine.ledger.floor
    roomy = engine.ledger.budget
    for _ in range(60):
        roll = rng.random()
        if roll < 0.3:
            n = rng.choice([4, 12, 24])
            engine.add_request(rng.choice(PROMPTS) * rng.randint(1, 3), SamplingParams(max_tokens=n, ignore_eos=True))
        elif roll < 0.45:
            engine.add_finetune(rng.choice(trainers).task(rng.choice(PAIRS)))
        elif roll < 0.55:
            report = engine.set_memory_budget(rng.randint(floor + (64 << 10), roomy))
            assert report.satisfied
        for _ in range(rng.randint(1, 4)):
            engine.step()
            assert engine.ledger.peak_used <= engine.ledger.budget, engine.ledger.snapshot()
    engine.set_memory_budget(roomy)
    run_all(engine)
    assert engine.pool.num_used == 0 and engine.ledger.held(MemoryKind.ACTIVATIONS) == 0
    assert engine.stats()["finetune_failed"] == 0


def test_budget_shrink_sheds_activations_then_adapters_then_prefix_cache(tiny_model_dir: Path, cost_cache: Path) -> None:
    # FIFO with one stage per fine-tune iteration, so the job is seen holding activations.
    engine = make_engine(tiny_model_dir, cost_cache, policy="fifo", policy_params={"ft_batch": 1})
    settings = LoraSettings(rank=4, alpha=8)
    for user in ("bob", "carol"):
        engine.publish_adapter(user, LoraWeights.init(engine.model.cfg, settings, seed=1))
    engine.generate(PROMPTS[:3], GREEDY)  # leaves their prompts in the prefix cache
    trainer = trainer_for(engine)
    engine.add_finetune(trainer.task(PAIRS[1]))
    for _ in range(50):
        engine.step()
        if engine.ledger.held(MemoryKind.ACTIVATIONS):
            break
    engine.scheduler.sync_memory()
    held = {kind: engine.ledger.held(kind) for kind in MemoryKind}
    assert held[MemoryKind.ADAPTERS] > 0 and held[MemoryKind.PREFIX_CACHE] > 0

    report = engine.set_memory_budget(engine.ledger.held() - held[MemoryKind.ACTIVATIONS] - 1)
    assert list(report.freed) == ["activations", "adapters"] and report.satisfied
    report = engine.set_memory_budget(engine.ledger.held() - engine.ledger.held(MemoryKind.ADAPTERS) - 1)
    assert list(report.freed)[-1] == "prefix_cache" and report.satisfied
    assert engine.ledger.held(MemoryKind.WEIGHTS) == held[MemoryKind.WEIGHTS]
    # The abandoned job restarts from its first forward window and still finishes.
    engine.set_memory_budget(engine.ledger.floor + (64 << 20))
    run_all(engine)
    assert engine.stats()["finetune_pairs_done"] == 1


def test_a_trainer_that_does_not_fit_is_refused(tiny_model_dir: Path, cost_cache: Path) -> None:
    engine = make_engine(tiny_model_dir, cost_cache)
    engine.set_memory_budget(engine.ledger.held() + 1024)
    with pytest.raises(AdmissionRejected, match="optimizer state"):
        engine.add_finetune(trainer_for(engine).task(PAIRS[0]))


def test_cost_model_is_calibrated_once_then_cached(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    # A quiet machine and a good fit (both vary on a shared CI box; tested on their own below).
    monkeypatch.setattr(cost_model, "machine_busy", lambda: False)
    monkeypatch.setattr(cost_model, "fit_error", lambda coefficients, rows: 0.0)
    first = make_engine(tiny_model_dir, tmp_path)
    second = make_engine(tiny_model_dir, tmp_path)
    assert first.costs.source == "calibrated" and second.costs.source == "cached"
    assert first.costs.forward == second.costs.forward
    assert list(tmp_path.glob("forward-*.json"))
    off = make_engine(tiny_model_dir, tmp_path, cost_profile="off")
    assert off.costs.source == "nominal" and not off.calibrating
    # The online correction follows what the machine does.
    off.generate(PROMPTS[:2], GREEDY)
    assert off.costs.forward_fix.samples > 0


def test_forward_fit_recovers_known_coefficients_and_busy_calibrations_are_provisional(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    truth = cost_model.ForwardCoefficients(0.02, 1e-3, 2e-7, 5e-4)
    shapes = [(t, a, r) for t, a, r in [(1, 17, 1), (16, 4000, 16), (64, 2080, 1), (192, 18528, 1), (9, 1100, 9)]]
    rows = [(t, a, r, truth.seconds(t, a, r)) for t, a, r in shapes]
    fitted = cost_model.fit_forward(rows)
    assert fitted.base_s == pytest.approx(truth.base_s, rel=1e-3) and fitted.token_s == pytest.approx(truth.token_s, rel=1e-3)
    assert cost_model.fit_error(fitted, rows) < 1e-6

    path = tmp_path / "forward-x.json"
    builds = []

    def build():
        builds.append(1)
        return {"n": len(builds)}, True, busy[0]

    busy = [True]
    monkeypatch.setattr(cost_model, "machine_busy", lambda: busy[0])
    assert cost_model.cached(path, build) == ({"n": 1}, False)
    assert cost_model.cached(path, build) == ({"n": 1}, True)  # still busy: the provisional one serves
    busy[0] = False
    assert cost_model.cached(path, build) == ({"n": 2}, False)  # quiet: measured again and kept
    assert cost_model.cached(path, build) == ({"n": 2}, True)


def test_pause_and_cancel_finetune(tiny_model_dir: Path, cost_cache: Path) -> None:
    engine = make_engine(tiny_model_dir, cost_cache, policy="mace")
    trainer = trainer_for(engine)
    first = engine.add_finetune(trainer.task(PAIRS[0]), user="dave")
    engine.add_finetune(trainer.task(PAIRS[1]), user="erin")
    engine.pause_finetune("admission: shed_finetune")
    assert not engine.has_unfinished() and engine.step() == []
    assert engine.stats()["finetune_paused"] == "admission: shed_finetune"
    assert engine.cancel_finetune(user="dave") == 1 and engine.cancel_finetune(first) == 0
    engine.resume_finetune()
    run_all(engine)
    stats = engine.stats()
    assert stats["finetune_pairs_done"] == 1 and stats["finetune_failed"] == 1


@pytest.mark.slow
def test_greedy_output_unchanged_with_colocated_finetuning_default_model(default_model_dir: Path, tmp_path: Path) -> None:
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS[:3]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine = Engine.load(str(default_model_dir), kv_cache_bytes=64 << 20, policy="mace", enable_prefix_cache=False)
    alone = [o.token_ids for o in engine.generate(prompts, params)]
    trainer = AdapterTrainer(engine.model, engine.tokenizer, dpo=DPOSettings(window_tokens=32, layers_per_group=10))
    engine.add_finetune(trainer.task(PAIRS[0]))
    ids = [engine.add_request(p, params) for p in prompts]
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
    assert [outputs[i] for i in ids] == alone
    assert engine.stats()["finetune_pairs_done"] == 1


def test_a_job_let_in_for_a_shared_stage_stops_before_the_adapter_another_job_holds(tiny_model_dir: Path,
                                                                                      cost_cache: Path) -> None:
    # A latency budget this loose lets a bin take every stage of a job if the queue allows it.
    engine = make_engine(tiny_model_dir, cost_cache, policy="mace", slo_tbt_ms=10**7)
    trainer = trainer_for(engine)
    queue = engine.scheduler.finetune
    holder = queue.jobs[engine.add_finetune(trainer.task(PAIRS[0], score=False))]
    while holder.next_kind != "backward":  # into its forward windows, as the engine runs them
        queue.before_stage(holder, holder.next_kind)
        holder.work.run_next()
    scored = queue.jobs[engine.add_finetune(trainer.task(PAIRS[1]))]  # score stage first
    fresh = queue.jobs[engine.add_finetune(trainer.task(PAIRS[2], score=False))]  # reference stage first
    assert [scored.next_kind, fresh.next_kind] == ["score", "reference"]
    assert queue.runnable() == [holder, scored, fresh]
    assert queue.stages_allowed(holder) == len(holder.work.remaining())
    # A job let in for its (windowed) score may run all its score windows, nothing exclusive.
    score_windows = sum(1 for st in scored.work.remaining() if st.kind.value == "score")
    assert queue.stages_allowed(scored) == score_windows and queue.stages_allowed(fresh) == 1
    batch = engine.scheduler.schedule(engine.clock())
    planned = {s.job.job_id: s.num_stages for s in batch.finetune}
    assert planned[holder.job_id] == len(holder.work.remaining())
    assert planned.get(scored.job_id, 0) <= score_windows and planned.get(fresh.job_id, 0) <= 1
    run_all(engine)  # plans afresh (the batch above was not run)
    stats = engine.stats()
    assert stats["finetune_failed"] == 0 and stats["finetune_pairs_done"] == 3 and trainer.pairs_trained == 3


def test_background_calibration_serves_at_once_then_calibrates_while_idle(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(cost_model, "machine_busy", lambda: False)
    monkeypatch.setattr(cost_model, "fit_error", lambda coefficients, rows: 0.0)
    engine = make_engine(tiny_model_dir, tmp_path, cost_profile="background")
    # A quick calibration (4 batches, timed once) before serving, the full one while idle.
    assert engine.costs.source == "quick" and engine.calibrating
    quick_slo = engine.scheduler.slo_tbt_s
    assert quick_slo == pytest.approx(5.0 * engine.costs.unloaded_decode_s())
    reference = make_engine(tiny_model_dir, tmp_path / "other", cost_profile="off").generate(PROMPTS[:2], GREEDY)
    # A request in flight: no calibration step runs beside it.
    engine.add_request(PROMPTS[0], GREEDY)
    pending = len(engine._calibration.pending)
    engine.calibrate_step()
    assert len(engine._calibration.pending) == pending
    while engine.has_unfinished():
        engine.step()
    # Work that arrives between a shape's forwards stops the shape after one forward; the same
    # shape is measured in full later, with no blocks left taken.
    asked, free = [], engine.pool.num_free
    engine.calibrate_step(interrupted=lambda: asked.append(1) or True)
    assert asked == [1] and len(engine._calibration.pending) == pending
    assert engine.pool.num_free == free
    steps = 0
    while engine.calibrating:
        engine.calibrate_step()
        steps += 1
    assert steps == len(cost_model.SHAPES)
    assert engine.costs.source == "calibrated" and engine.costs.forward_fix.samples == 0
    assert engine.scheduler.slo_tbt_s != quick_slo
    assert engine.scheduler.slo_tbt_s == pytest.approx(5.0 * engine.costs.unloaded_decode_s())
    # Probes between requests change no answer, and the next start reads the cache.
    assert [o.text for o in engine.generate(PROMPTS[:2], GREEDY)] == [o.text for o in reference]
    again = make_engine(tiny_model_dir, tmp_path, cost_profile="background")
    assert again.costs.source == "cached" and not again.calibrating
    assert again.costs.forward == engine.costs.forward
    # A quick fit that misses its own points by more than their size is not used.
    monkeypatch.setattr(cost_model, "fit_error", lambda coefficients, rows: 1.5)
    nominal = make_engine(tiny_model_dir, tmp_path / "third", cost_profile="background")
    assert nominal.costs.source == "nominal" and nominal.calibrating


def test_a_finetune_stage_that_can_never_fit_fails_with_the_figures(tiny_model_dir: Path, cost_cache: Path) -> None:
    """An idle engine whose fine-tune job's next stage needs more than the budget can free would
    otherwise step empty iterations forever (has_unfinished stays true); the job fails instead,
    naming the setting to raise, and the engine is idle again."""
    from edge_runtime.train.costs import StageEstimate

    engine = make_engine(tiny_model_dir, cost_cache, policy="mace")
    task = trainer_for(engine).task(PAIRS[0])
    stages = task.remaining()
    # The fault: the task's first stage estimates more than the whole budget (as a 1B model's
    # window does under the default fine-tune room); its real estimate is tiny on this model.
    huge = StageEstimate(seconds=0.01, peak_bytes=2 * engine.ledger.budget, held_bytes=0)
    stages[0].estimate = lambda: huge
    done: list = []
    engine.add_finetune(task, on_done=done.append)
    run_all(engine, limit=50)
    assert len(done) == 1 and done[0].error.startswith("no memory: its pass (forward to optimizer) needs")
    assert "finetune_memory_bytes" in done[0].error and engine.ledger.held(MemoryKind.ACTIVATIONS) == 0
    # The same work with room trains, and requests are served throughout.
    roomy = make_engine(tiny_model_dir, cost_cache, policy="mace")
    ok: list = []
    roomy.add_finetune(trainer_for(roomy).task(PAIRS[0]), on_done=ok.append)
    run_all(roomy)
    assert ok[0].error is None
