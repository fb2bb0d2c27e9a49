"""Fine-tune jobs as the scheduler sees them: one staged update (a preference pair's DPO step on
a user's adapter), its arrival, its DPO loss (a priority input), its stage costs, and which
adapter it holds between its first forward and its optimizer stage. Runs no stage itself.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from edge_runtime.train.costs import StageEstimate

log = logging.getLogger(__name__)


class StageLike(Protocol):
    kind: Any  # an enum whose .value names the stage kind ("score", "forward", ...)
    name: str
    seconds: float | None

    def estimate(self) -> StageEstimate: ...


class FineTuneWork(Protocol):
    """What a staged fine-tune task offers (`edge_runtime.train.staged.FineTuneTask` does)."""

    trainer: Any  # jobs of one trainer hold its adapter one at a time (forward..optimizer)
    done: bool
    held_bytes: int

    def next_stage(self) -> StageLike | None: ...

    def remaining(self) -> list[StageLike]: ...

    def run_next(self) -> StageLike: ...

    def abandon(self) -> None: ...


def must_finish(job: FineTuneJob) -> bool:
    """A job whose backward has begun (gradients partly in the adapter's leaves) cannot give
    its activations back and restart; it must run to its optimizer stage."""
    return not job.work.done and not getattr(job.work, "can_abandon", True)


def pass_need_bytes(job: FineTuneJob) -> int:
    """The most memory the job's remaining stages take beyond what it holds now (its whole
    pass: forward windows, backward groups, optimizer), the figure it is admitted by."""
    return max((c.memory_bytes for c in job.stage_costs(len(job.work.remaining()))), default=0)


# Kinds that need the adapter exclusively: between a task's forward and its optimizer stage the
# autograd graph references the LoRA leaves (see AdapterTrainer.claim). The others ("score",
# "reference": no-grad log-probs) run beside another job of the same adapter.
_EXCLUSIVE = {"forward", "backward", "optimizer"}


@dataclass(frozen=True, slots=True)
class StageCost:
    kind: str
    seconds: float  # the stage's own estimate (before the scheduler's online correction)
    memory_bytes: int  # transient peak plus the activations it adds to what the job holds


@dataclass(eq=False)
class FineTuneJob:
    job_id: str
    work: FineTuneWork
    arrival: float
    enqueued: float  # when it last ran a stage (or arrived): the waiting time that ages it
    dpo_loss: float | None = None  # L_DPO for MACE's gamma term; else the score stage's, else the adapter's expected
    user: str | None = None
    on_done: Callable[[FineTuneJob], None] | None = None
    stages_run: int = 0
    seconds: float = 0.0
    finished_at: float | None = None
    abandoned: int = 0  # restarts: times its activations were shed and it began its pass again
    error: str | None = None
    # Dropped before any other job's activations when memory runs short (a fleet round: the
    # device's own users' updates and its serving matter more than a share of the fleet's).
    shed_first: bool = False
    _costs: dict[int, StageCost] = field(default_factory=dict, repr=False)
    _remaining_costs: list[StageCost] | None = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self.work.done or self.error is not None

    @property
    def next_kind(self) -> str | None:
        stage = self.work.next_stage()
        return None if stage is None else stage.kind.value

    def stage_costs(self, limit: int) -> list[StageCost]:
        """Costs of the next `limit` stages, each estimated once (estimates are arithmetic on
        the stage's shape, so re-asking every iteration would only cost scheduler time). The
        list for all remaining stages is kept until a stage runs: the policy asks for it once
        per bin it tries the job in."""
        remaining = self.work.remaining()
        if self._remaining_costs is None or len(self._remaining_costs) != len(remaining):
            out = []
            for stage in remaining:
                cost = self._costs.get(id(stage))
                if cost is None:
                    est = stage.estimate()
                    held_growth = max(0, est.held_bytes - self.work.held_bytes)
                    cost = StageCost(stage.kind.value, est.seconds, int(est.peak_bytes + held_growth))
                    self._costs[id(stage)] = cost
                out.append(cost)
            self._remaining_costs = out
        return self._remaining_costs[:limit]

    def forget_costs(self) -> None:
        """Drop the cached estimates (they depend on the activations the job holds)."""
        self._costs.clear()
        self._remaining_costs = None

    def estimate_s(self, stage: StageLike) -> float:
        """The stage's own latency estimate (before the scheduler's online correction)."""
        cost = self._costs.get(id(stage))
        return cost.seconds if cost is not None else stage.estimate().seconds

    def loss_for_priority(self) -> float:
        if self.dpo_loss is not None:
            return self.dpo_loss
        score = getattr(self.work, "score", None)
        if score is not None:
            # Computed once: DPOScore.loss goes through torch, too slow for every iteration.
            self.dpo_loss = float(score.loss)
            return self.dpo_loss
        # Not scored (yet): the adapter's expected loss (its recent pairs'), which moves as
        # other pairs of the adapter train, so it is not cached.
        expected = getattr(self.work.trainer, "expected_loss", None)
        if isinstance(expected, float):
            return expected
        return math.log(2.0)  # the DPO loss of an adapter that does not yet prefer either answer


class FineTuneQueue:
    """Jobs in arrival order, and which job holds each trainer's adapter."""

    def __init__(self) -> None:
        self.jobs: dict[str, FineTuneJob] = {}
        self.owners: dict[int, FineTuneJob] = {}  # id(trainer) -> job between forward and optimizer
        self.finished: list[FineTuneJob] = []
        self.pairs_done = 0
        self.stages_run = 0
        self.seconds = 0.0
        self.failed = 0
        self.restarts = 0  # every job's, retired ones' included
        self.stalled = 0  # jobs failed for restarting `max_restarts` times
        # A job shed this many times without finishing is failed with the figures instead of
        # starting over again (docs/scheduler.md, "Fine-tune liveness"); 0 = never.
        self.max_restarts = 16
        self._allowed: dict[str, int] = {}  # job id -> stages it may run, from the last `runnable`

    def __len__(self) -> int:
        return len(self.jobs)

    def add(self, job: FineTuneJob) -> None:
        if job.job_id in self.jobs:
            raise ValueError(f"fine-tune job {job.job_id!r} is already queued")
        self.jobs[job.job_id] = job

    def runnable(self) -> list[FineTuneJob]:
        """Jobs whose next stage may run now, and how many stages each may run in one iteration
        (`stages_allowed`). Per trainer, one job may go into the adapter: the one holding it or,
        if none does, the earliest arrival; it may run all its stages. Any other job may run the
        leading stages that do not need the adapter (score, reference) and stops before the
        first that does, since one iteration can hold several stages of a job."""
        out = []
        taken: set[int] = set()
        self._allowed = {}
        for job in self.jobs.values():
            remaining = job.work.remaining()
            if not remaining:
                continue
            key = id(job.work.trainer)
            owner = self.owners.get(key)
            if owner is job or (owner is None and key not in taken):
                taken.add(key)
                allowed = len(remaining)
            else:
                allowed = 0
                while allowed < len(remaining) and remaining[allowed].kind.value not in _EXCLUSIVE:
                    allowed += 1
            if allowed:
                self._allowed[job.job_id] = allowed
                out.append(job)
        return out

    def stages_allowed(self, job: FineTuneJob) -> int:
        """The stages `job` may run in the coming iteration, as the last `runnable` call decided
        (a job it did not list: all its remaining stages, e.g. for ranking it)."""
        allowed = self._allowed.get(job.job_id)
        return allowed if allowed is not None else len(job.work.remaining())

    def started(self, job: FineTuneJob) -> bool:
        """Whether the job is inside its pass: it holds activations or its trainer's adapter."""
        return job.work.held_bytes > 0 or self.holds_adapter(job)

    def starts_pass(self, job: FineTuneJob) -> bool:
        """Whether the stages `job` may run next iteration would begin its pass (a forward)."""
        if self.started(job):
            return False
        remaining = job.work.remaining()[: self.stages_allowed(job)]
        return any(stage.kind.value in _EXCLUSIVE for stage in remaining)

    def hold_back(self, job: FineTuneJob) -> bool:
        """Keep `job` out of its pass this iteration: only its leading stages that do not need
        the adapter may run. Returns whether any may."""
        remaining = job.work.remaining()
        allowed = 0
        while allowed < len(remaining) and remaining[allowed].kind.value not in _EXCLUSIVE:
            allowed += 1
        self._allowed[job.job_id] = allowed
        return allowed > 0

    def admit_passes(self, runnable: list[FineTuneJob], room: int) -> list[FineTuneJob]:
        """A job begins its pass (first forward) only if the memory its whole pass needs fits
        in `room` (what fine-tune work may take) beside what the passes already begun still
        need; in arrival order, so a later job never starts ahead of an earlier one waiting for
        room. Passes that cannot all fit run one after another instead of each holding part of
        the memory the others need (issue #32). Returns the jobs that may run stages."""
        room -= sum(pass_need_bytes(job) for job in self.jobs.values() if self.started(job))
        out, waiting = [], False
        for job in runnable:
            if self.starts_pass(job):
                need = pass_need_bytes(job)
                if waiting or need > room:
                    waiting = True
                    if not self.hold_back(job):
                        continue
                else:
                    room -= need
            out.append(job)
        return out

    def fail_if_stalled(self, job: FineTuneJob, now: float, memory: dict[str, int]) -> bool:
        """After a restart: a job shed `max_restarts` times is failed with the figures (its
        owner may queue it again later) instead of starting over once more."""
        if not self.max_restarts or job.abandoned < self.max_restarts or job.job_id not in self.jobs:
            return False
        mib = {k: v / 2**20 for k, v in memory.items()}
        why = (f"stalled: its activations were shed {job.abandoned} times (memory for serving or a smaller "
               f"budget) after {job.stages_run} stages and {job.seconds:.1f} s without finishing; budget "
               f"{mib.get('budget_bytes', 0):.0f} MiB, held {mib.get('held_bytes', 0):.0f} MiB (prefix cache "
               f"{mib.get('prefix_cache_bytes', 0):.0f}, kv {mib.get('kv_bytes', 0):.0f}, adapters "
               f"{mib.get('adapters_bytes', 0):.0f}, activations {mib.get('activations_bytes', 0):.0f})")
        log.warning("fine-tune job %s (user %s) %s", job.job_id, job.user, why)
        self.stalled += 1
        self.retire(job, now, error=why)
        return True

    def before_stage(self, job: FineTuneJob, kind: str) -> None:
        if kind in _EXCLUSIVE:
            self.owners[id(job.work.trainer)] = job

    def after_stage(self, job: FineTuneJob, seconds: float, now: float) -> None:
        job.stages_run += 1
        job.seconds += seconds
        # Memory estimates count held growth from what the job held when they were made: a
        # stage that changed it makes them stale (over-asking would keep the job from fitting).
        job.forget_costs()
        job.enqueued = now
        self.stages_run += 1
        self.seconds += seconds
        if job.work.done:
            self.retire(job, now)

    def retire(self, job: FineTuneJob, now: float, error: str | None = None) -> None:
        self.jobs.pop(job.job_id, None)
        self._release(job)
        job.finished_at = now
        if error is not None:
            job.error = error
            self.failed += 1
        else:
            self.pairs_done += 1
        self.finished.append(job)
        del self.finished[:-256]  # recent history only; counters keep the totals
        if job.on_done is not None:
            job.on_done(job)

    def abandon(self, job: FineTuneJob) -> int:
        """Drop the job's held activations (memory pressure); it restarts at its first forward.
        Returns the bytes given back."""
        held = job.work.held_bytes
        job.work.abandon()
        job.abandoned += 1
        self.restarts += 1
        job.forget_costs()  # held-state-dependent estimates are stale now
        self._release(job)
        return held

    def holds_adapter(self, job: FineTuneJob) -> bool:
        """Whether `job` holds its trainer's adapter (between its forward and optimizer stages)."""
        return self.owners.get(id(job.work.trainer)) is job

    def _release(self, job: FineTuneJob) -> None:
        key = id(job.work.trainer)
        if self.owners.get(key) is job:
            del self.owners[key]

    def holding(self) -> list[FineTuneJob]:
        return [job for job in self.jobs.values() if job.work.held_bytes > 0]

    def stalling(self) -> list[FineTuneJob]:
        """Queued jobs restarted at least half of `max_restarts` times: on their way to failing."""
        limit = max(1, self.max_restarts // 2) if self.max_restarts else 0
        return [job for job in self.jobs.values() if limit and job.abandoned >= limit]

    def job_stats(self) -> list[dict[str, Any]]:
        """Per queued job: who, how far, how often it restarted (for status reports)."""
        return [{"job_id": job.job_id, "user": job.user, "next": job.next_kind, "stages_run": job.stages_run,
                 "restarts": job.abandoned, "seconds": round(job.seconds, 3)} for job in self.jobs.values()]
