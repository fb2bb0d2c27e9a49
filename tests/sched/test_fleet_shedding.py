"""A fleet round's fine-tune jobs (`shed_first`) are the first fine-tune work shed on the engine
(tiny random llama): when the ledger must free activations the whole round is dropped before a
user's update gives anything back, and admission's pause drops it while users' updates only wait;
the user's update and inference go on."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_runtime.lora.registry import FLEET
from edge_runtime.memory import MemoryKind
from edge_runtime.sched.finetune import FineTuneJob
from tests.sched.test_engine_coserving import (
    GREEDY,
    PAIRS,
    PROMPTS,
    make_engine,
    run_all,
    trainer_for,
)


@pytest.fixture(scope="module")
def cost_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("costs")


def first_forward(engine, job_id: str) -> None:
    """Run the job's stages up to and including its first forward window, as the engine does."""
    queue = engine.scheduler.finetune
    job = queue.jobs[job_id]
    while True:
        stage = job.work.next_stage()
        queue.before_stage(job, stage.kind.value)
        job.work.run_next()
        queue.after_stage(job, stage.seconds or 0.0, engine.clock())
        if stage.kind.value == "forward":
            break
    engine.scheduler.sync_memory()


def test_memory_pressure_drops_the_fleet_round_before_a_users_update(tiny_model_dir: Path, cost_cache: Path) -> None:
    engine = make_engine(tiny_model_dir, cost_cache, policy="fcfs")
    ended: list[FineTuneJob] = []
    fleet, user = trainer_for(engine, seed=1), trainer_for(engine)
    fleet_jobs = [engine.add_finetune(fleet.task(p), user=FLEET, shed_first=True, on_done=ended.append)
                  for p in PAIRS[:3]]
    mine = engine.add_finetune(user.task(PAIRS[3]), user="ann", on_done=ended.append)
    first_forward(engine, fleet_jobs[0])
    first_forward(engine, mine)
    activations = engine.ledger.entries(MemoryKind.ACTIVATIONS)
    assert activations[fleet_jobs[0]] > 0 and activations[mine] > 0
    request = engine.add_request(PROMPTS[0], GREEDY)

    # Free exactly what the fleet round holds: the round goes, the user's update keeps its activations.
    report = engine.set_memory_budget(engine.ledger.held() - activations[fleet_jobs[0]])
    assert report.satisfied and report.freed == {"activations": activations[fleet_jobs[0]]}
    assert {j.job_id: j.error for j in ended} == dict.fromkeys(fleet_jobs, "shed: memory pressure")
    user_job = engine.scheduler.finetune.jobs[mine]
    assert user_job.abandoned == 0 and user_job.work.held_bytes == activations[mine]

    engine.set_memory_budget(engine.ledger.held() + (64 << 20))
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    assert len(outputs[request].candidates[0].token_ids) == GREEDY.max_tokens
    assert ended[-1].job_id == mine and ended[-1].error is None and user.pairs_trained == 1
    assert fleet.pairs_trained == 0 and engine.ledger.held(MemoryKind.ACTIVATIONS) == 0


def test_a_fleet_job_holding_nothing_still_goes_before_a_users_activations(tiny_model_dir: Path,
                                                                          cost_cache: Path) -> None:
    engine = make_engine(tiny_model_dir, cost_cache, policy="fcfs")
    ended: list[FineTuneJob] = []
    fleet, user = trainer_for(engine, seed=1), trainer_for(engine)
    queued = engine.add_finetune(fleet.task(PAIRS[0]), user=FLEET, shed_first=True, on_done=ended.append)
    mine = engine.add_finetune(user.task(PAIRS[1]), user="ann", on_done=ended.append)
    first_forward(engine, mine)
    held = engine.ledger.entries(MemoryKind.ACTIVATIONS)[mine]
    engine.set_memory_budget(engine.ledger.held() - held)
    # The round is dropped first; it freed nothing, so the user's update then gives its back
    # (and restarts later), as before.
    assert [(j.job_id, j.error) for j in ended] == [(queued, "shed: memory pressure")]
    assert engine.scheduler.finetune.jobs[mine].abandoned == 1
    engine.set_memory_budget(engine.ledger.held() + (64 << 20))
    run_all(engine)
    assert user.pairs_trained == 1


def test_admissions_pause_drops_the_fleet_round_and_users_updates_wait(tiny_model_dir: Path, cost_cache: Path) -> None:
    engine = make_engine(tiny_model_dir, cost_cache, policy="fcfs")
    ended: list[FineTuneJob] = []
    fleet, user = trainer_for(engine, seed=1), trainer_for(engine)
    rounds = [engine.add_finetune(fleet.task(p), user=FLEET, shed_first=True, on_done=ended.append) for p in PAIRS[:2]]
    mine = engine.add_finetune(user.task(PAIRS[2]), user="ann", on_done=ended.append)
    first_forward(engine, rounds[0])
    engine.pause_finetune("admission: shed_finetune")
    assert {j.job_id: j.error for j in ended} == dict.fromkeys(rounds, "shed: admission: shed_finetune")
    assert list(engine.scheduler.finetune.jobs) == [mine] and engine.ledger.held(MemoryKind.ACTIVATIONS) == 0
    engine.resume_finetune()
    run_all(engine)
    assert ended[-1].job_id == mine and ended[-1].error is None and user.pairs_trained == 1
