"""Fine-tune work with declared stage costs, for driving the scheduler without a model: the
same interface the scheduler's queue uses on `train.staged` tasks (next_stage, run_next,
remaining, abandon, held_bytes, trainer). Used by tests/sched and tools/bench_scheduler.py."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from edge_runtime.train.costs import StageEstimate


class Kind(enum.Enum):
    SCORE = "score"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


@dataclass(eq=False)
class FakeStage:
    kind: Kind
    name: str
    est: StageEstimate
    seconds: float | None = None

    def estimate(self) -> StageEstimate:
        return self.est


class FakeTrainer:
    persistent_bytes = 8192


@dataclass(eq=False)
class FakeWork:
    trainer: FakeTrainer
    stages: list[FakeStage]
    cursor: int = 0
    held_bytes: int = 0
    score: object = None

    @property
    def done(self) -> bool:
        return self.cursor >= len(self.stages)

    def next_stage(self) -> FakeStage | None:
        return None if self.done else self.stages[self.cursor]

    def remaining(self) -> list[FakeStage]:
        return self.stages[self.cursor :]

    def run_next(self) -> FakeStage:
        stage = self.stages[self.cursor]
        stage.seconds = stage.est.seconds
        self.held_bytes = stage.est.held_bytes
        self.cursor += 1
        return stage

    def abandon(self) -> None:
        self.held_bytes = 0
        first_forward = next(i for i, s in enumerate(self.stages) if s.kind is Kind.FORWARD)
        self.cursor = min(self.cursor, first_forward)


def fake_work(trainer: FakeTrainer, forwards: int = 2, backwards: int = 2, stage_s: float = 0.01,
              held_per_forward: int = 32 * 1024, peak: int = 16 * 1024, score: bool = True) -> FakeWork:
    stages = [FakeStage(Kind.SCORE, "score", StageEstimate(stage_s, peak, 0))] if score else []
    for i in range(forwards):
        stages.append(FakeStage(Kind.FORWARD, f"forward{i}", StageEstimate(stage_s, peak + held_per_forward,
                                                                             held_per_forward * (i + 1))))
    total = held_per_forward * forwards
    for i in range(backwards):
        left = total - total * (i + 1) // backwards
        stages.append(FakeStage(Kind.BACKWARD, f"backward{i}", StageEstimate(stage_s, peak, left)))
    stages.append(FakeStage(Kind.OPTIMIZER, "optimizer", StageEstimate(stage_s / 10, 1024, 0)))
    return FakeWork(trainer, stages)
