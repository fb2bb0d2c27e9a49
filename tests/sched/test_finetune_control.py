"""Pausing (admission's shed_finetune) and cancelling (erasure, rollback) fine-tune jobs at every
point of an update on the engine (tiny random llama): before its forward, between forward and
backward (activations given back, restart at the first window), and once its backward has begun
(the gradient is partly in the adapter: it runs to its optimizer stage instead of being torn)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edge_runtime.memory import MemoryKind
from edge_runtime.train.staged import StageKind
from tests.sched.test_engine_coserving import PAIRS, make_engine, run_all, trainer_for


@pytest.fixture(scope="module")
def cost_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("costs")


def run_stages_until(engine, job_id: str, kind: StageKind) -> None:
    """Step the engine until the job's next stage is of `kind`."""
    job = engine.scheduler.finetune.jobs[job_id]
    for _ in range(500):
        stage = job.work.next_stage()
        if stage is not None and stage.kind is kind:
            return
        engine.step()
    raise AssertionError(f"job never reached a {kind.value} stage")


def leaves(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.weights.parameters()]


def test_pause_mid_forward_gives_activations_back_and_resumes(tiny_model_dir: Path, cost_cache: Path) -> None:
    engine = make_engine(tiny_model_dir, cost_cache, policy="fcfs")  # one stage per iteration: every point is reachable
    trainer = trainer_for(engine)
    job_id = engine.add_finetune(trainer.task(PAIRS[0]), user="fay")
    run_stages_until(engine, job_id, StageKind.BACKWARD)
    job = engine.scheduler.finetune.jobs[job_id]
    assert job.work.held_bytes > 0 and job.work.can_abandon
    engine.pause_finetune("admission: shed_finetune")
    assert job.work.held_bytes == 0 and job.abandoned == 1
    assert engine.ledger.held(MemoryKind.ACTIVATIONS) == 0
    stats = engine.stats()  # restarts reported in total and per job (issue #32)
    assert stats["finetune_restarts"] == 1 and stats["finetune_max_restarts"] == 16
    assert [(j["job_id"], j["user"], j["restarts"]) for j in stats["finetune_jobs"]] == [(job_id, "fay", 1)]
    assert not engine.has_unfinished() and engine.step() == []
    engine.resume_finetune()
    run_all(engine)
    assert engine.stats()["finetune_pairs_done"] == 1 and trainer.pairs_trained == 1


def test_pause_once_backward_began_lets_the_update_finish_then_waits(tiny_model_dir: Path, cost_cache: Path) -> None:
    engine = make_engine(tiny_model_dir, cost_cache, policy="fcfs")  # one stage per iteration: every point is reachable
    trainer = trainer_for(engine)
    first = engine.add_finetune(trainer.task(PAIRS[0]), user="gus")
    engine.add_finetune(trainer.task(PAIRS[1]), user="gus")
    run_stages_until(engine, first, StageKind.BACKWARD)
    engine.step()  # one backward group ran
    job = engine.scheduler.finetune.jobs[first]
    assert not job.work.can_abandon
    engine.pause_finetune("admission: shed_finetune")  # must not tear the update
    assert engine.has_unfinished()
    run_all(engine)  # only the begun update runs on
    stats = engine.stats()
    assert stats["finetune_pairs_done"] == 1 and stats["finetune_queued"] == 1
    assert engine.ledger.held(MemoryKind.ACTIVATIONS) == 0 and trainer.pairs_trained == 1
    engine.resume_finetune()
    run_all(engine)
    assert engine.stats()["finetune_pairs_done"] == 2


def test_cancel_before_and_after_backward_began(tiny_model_dir: Path, cost_cache: Path) -> None:
    engine = make_engine(tiny_model_dir, cost_cache, policy="fcfs")  # one stage per iteration: every point is reachable
    trainer = trainer_for(engine)
    done: list[tuple[str, str | None]] = []
    first = engine.add_finetune(trainer.task(PAIRS[0]), user="hal", on_done=lambda j: done.append((j.job_id, j.error)))
    run_stages_until(engine, first, StageKind.BACKWARD)
    engine.step()
    before = leaves(trainer)
    # Backward begun: cancelling runs it to its optimizer stage, and it counts as done.
    assert engine.cancel_finetune(user="hal") == 0
    assert done == [(first, None)] and trainer.pairs_trained == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, leaves(trainer), strict=True))
    # Mid-forward: dropped, activations freed, the adapter free for the next update.
    second = engine.add_finetune(trainer.task(PAIRS[1]), user="hal", on_done=lambda j: done.append((j.job_id, j.error)))
    run_stages_until(engine, second, StageKind.BACKWARD)
    assert engine.cancel_finetune(user="hal") == 1 and done[-1] == (second, "cancelled")
    assert engine.ledger.held(MemoryKind.ACTIVATIONS) == 0
    third = engine.add_finetune(trainer.task(PAIRS[2]), user="hal")
    run_all(engine)
    assert third not in engine.scheduler.finetune.jobs and trainer.pairs_trained == 2
