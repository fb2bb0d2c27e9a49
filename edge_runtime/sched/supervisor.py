"""The fine-tune supervisor: queues jobs with the scheduler, runs the stages it packed into an
iteration, and drops, cancels, pauses or fails jobs without tearing an adapter's update. Runs
stages only through `FineTuneWork`; knows nothing of the model or of inference.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

from edge_runtime.memory import MemoryKind, MemoryLedger
from edge_runtime.sched.batch import Batch
from edge_runtime.sched.cost_model import CostModel
from edge_runtime.sched.finetune import (
    FineTuneJob,
    FineTuneQueue,
    FineTuneWork,
    must_finish,
    pass_need_bytes,
)
from edge_runtime.sched.scheduler import Scheduler

log = logging.getLogger(__name__)


class FineTuneSupervisor:
    def __init__(self, scheduler: Scheduler, ledger: MemoryLedger, costs: CostModel,
                 clock: Callable[[], float]) -> None:
        self.scheduler = scheduler
        self.ledger = ledger
        self.costs = costs
        self.clock = clock
        self._job_ids = itertools.count()
        # Called after an iteration's stages ran (the engine gives back the pages of weights a
        # stage read from a memory-mapped block cache).
        self.after_stages: Callable[[], None] | None = None

    @property
    def queue(self) -> FineTuneQueue:
        return self.scheduler.finetune

    def add(self, task: FineTuneWork, *, user: str | None = None, dpo_loss: float | None = None,
            arrival: float | None = None, job_id: str | None = None,
            on_done: Callable[[FineTuneJob], None] | None = None, shed_first: bool = False) -> str:
        """Queue one staged task as a job (see `Engine.add_finetune`); returns its id."""
        job_id = job_id or f"ft-{next(self._job_ids)}"
        now = self.clock()
        job = FineTuneJob(job_id, task, arrival if arrival is not None else now,
                          arrival if arrival is not None else now, dpo_loss, user, on_done,
                          shed_first=shed_first)
        self.scheduler.add_finetune(job)
        return job_id

    def cancel(self, job_id: str | None = None, *, user: str | None = None) -> int:
        """Drop one queued job, or every job of `user`; one whose backward has begun runs to its
        end instead. Returns how many were dropped."""
        jobs = [j for j in list(self.queue.jobs.values())
                if (job_id is not None and j.job_id == job_id) or (user is not None and j.user == user)]
        dropped = 0
        for job in jobs:
            dropped += not must_finish(job)
            self.drop(job, "cancelled", finish=True)
        return dropped

    def fail_jobs_that_cannot_fit(self) -> None:
        """Nothing else runs and still no stage was packed: a job whose next stage needs more
        memory than the ledger can free would wait forever (a 1B model's DPO window under the
        default `finetune_memory_bytes`, say). Fail it with the figures instead. Room is made
        only from idle adapters and the prefix cache, never from another job's activations (the
        jobs would restart each other for ever: issue #32); a job not yet in its pass is judged
        by its whole pass and waits while other jobs' activations would make room once they
        finish. A job whose backward has begun is left alone: it runs to its optimizer stage."""
        queue, ledger = self.queue, self.ledger
        for job in list(queue.jobs.values()):
            costs = job.stage_costs(1)
            if not costs or must_finish(job) or job.job_id not in queue.jobs:
                continue
            started = queue.started(job)
            need = costs[0].memory_bytes if started else pass_need_bytes(job)
            if need <= ledger.free or ledger.reclaim(need, for_finetune=True).satisfied:
                continue
            others = sum(b for key, b in ledger.entries(MemoryKind.ACTIVATIONS).items() if key != job.job_id)
            if need <= ledger.free + others:
                if started:
                    self._yield_to(job, need)
                continue  # room comes back as the passes begun finish
            what = f"its next stage ({costs[0].kind})" if started else "its pass (forward to optimizer)"
            reason = (f"{what} needs {need / 2**20:.1f} MiB and only "
                      f"{max(0, self.ledger.free) / 2**20:.1f} MiB of the {self.ledger.budget / 2**20:.0f} MiB "
                      "memory budget is free with nothing else running: raise engine.finetune_memory_bytes "
                      "(or memory_budget_bytes), or train with smaller windows (dpo window_tokens)")
            log.warning("fine-tune job %s cannot run: %s", job.job_id, reason)
            self.drop(job, f"no memory: {reason}")

    def _yield_to(self, job: FineTuneJob, need: int) -> None:
        """Passes begun that hold each other's room (a budget drop after they were admitted):
        the earliest goes on, and later ones give their activations back (a counted restart) as
        far as it needs, so one pass always finishes; a later job just waits for the earliest."""
        queue, ledger = self.queue, self.ledger
        begun = [j for j in queue.jobs.values() if queue.started(j)]
        if begun[0] is not job:
            return
        for other in reversed(begun[1:]):
            if need <= ledger.free:
                break
            if other.work.held_bytes and not must_finish(other):
                queue.abandon(other)
                ledger.drop(MemoryKind.ACTIVATIONS, other.job_id)
                queue.fail_if_stalled(other, self.clock(), ledger.snapshot())

    def drop(self, job: FineTuneJob, reason: str, finish: bool = False) -> None:
        """Retire `job` with error `reason`, giving back what it holds; with `finish`, a job
        whose backward has begun runs its remaining stages instead and retires as done."""
        queue = self.queue
        if finish and must_finish(job):
            # Its gradient is partly in the adapter's leaves: a torn update would leak into the
            # next pair's optimizer step. Run the few stages left (backward groups, the
            # optimizer) instead; it then retires as done, not dropped.
            try:
                self.finish_now(job)
            except Exception as exc:
                log.exception("fine-tune job %s failed while finishing", job.job_id)
                if job.job_id in queue.jobs:
                    queue.retire(job, self.clock(), error=f"{reason}; finishing failed: {exc}")
            self.ledger.drop(MemoryKind.ACTIVATIONS, job.job_id)
            return
        try:
            if job.work.held_bytes or queue.holds_adapter(job):
                queue.abandon(job)
        finally:
            queue.retire(job, self.clock(), error=reason)
            self.ledger.drop(MemoryKind.ACTIVATIONS, job.job_id)

    def finish_now(self, job: FineTuneJob) -> None:
        queue = self.queue
        while job.job_id in queue.jobs:
            stage = job.work.next_stage()
            if stage is None:
                queue.retire(job, self.clock())
                break
            queue.before_stage(job, stage.kind.value)
            job.work.run_next()
            queue.after_stage(job, stage.seconds or 0.0, self.clock())

    def pause(self, reason: str) -> None:
        """Stop scheduling fine-tune stages and give activations back; `shed_first` jobs are
        dropped, the others wait for `resume`."""
        self.scheduler.finetune_paused = reason
        self.scheduler.drop_shed_first(reason)
        for job in self.queue.holding():
            if not must_finish(job):  # those run on to their optimizer stage, then wait
                self.queue.abandon(job)
        self.scheduler.sync_memory()

    def resume(self) -> None:
        self.scheduler.finetune_paused = None

    def run(self, batch: Batch, before: Callable[[], None] | None = None) -> None:
        """Run the stages the scheduler packed into `batch` (calling `before` first, if there
        are any), then record what their jobs hold. A failing stage drops its job alone."""
        if batch.finetune:
            if before is not None:
                before()
            self._run_stages(batch)
            if self.after_stages is not None:
                self.after_stages()
        self.scheduler.commit_finetune(batch)

    def _run_stages(self, batch: Batch) -> None:
        queue = self.queue
        for scheduled in batch.finetune:
            job = scheduled.job
            for _ in range(scheduled.num_stages):
                stage = job.work.next_stage()
                if stage is None:
                    break
                kind = stage.kind.value
                estimate_s = job.estimate_s(stage)
                queue.before_stage(job, kind)
                try:
                    job.work.run_next()
                except Exception as exc:  # a failing update must not take inference down with it
                    log.exception("fine-tune job %s failed in stage %s", job.job_id, stage.name)
                    self.drop(job, f"{stage.name} failed: {exc}")
                    break
                self.costs.observe_stage(kind, estimate_s, stage.seconds or 0.0)
                queue.after_stage(job, stage.seconds or 0.0, self.clock())

    def stats(self) -> dict[str, Any]:
        queue = self.queue
        return {
            "finetune_queued": len(queue),
            "finetune_pairs_done": queue.pairs_done,
            "finetune_failed": queue.failed,
            "finetune_stages_run": queue.stages_run,
            "finetune_seconds": round(queue.seconds, 3),
            "finetune_paused": self.scheduler.finetune_paused,
            # restarts: times a job's activations were shed and it began its pass again (all jobs)
            "finetune_restarts": queue.restarts,
            "finetune_stalling": len(queue.stalling()),  # queued jobs restarted >= max_restarts / 2 times
            "finetune_stalled": queue.stalled,  # jobs failed for restarting max_restarts times
            "finetune_max_restarts": queue.max_restarts,
            "finetune_jobs": queue.job_stats(),
        }
