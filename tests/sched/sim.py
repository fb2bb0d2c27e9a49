"""A model-free harness for scheduler tests: real scheduler, policies, bins and ledger; fake
sequences (a token per sampling step), fake fine-tune work with declared stage costs, and a
clock that advances by each iteration's planned latency."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from edge_runtime.kv.block_pool import BlockPool
from edge_runtime.memory import MemoryKind, MemoryLedger
from edge_runtime.outputs import RequestMetrics
from edge_runtime.sampling import SamplingParams
from edge_runtime.sched.batch import Batch
from edge_runtime.sched.cost_model import CostModel, ForwardCoefficients
from edge_runtime.sched.finetune import FineTuneJob
from edge_runtime.sched.policy import Policy
from edge_runtime.sched.scheduler import Scheduler
from edge_runtime.sched.testing import FakeStage, FakeTrainer, FakeWork, Kind, fake_work  # noqa: F401
from edge_runtime.sequence import Request, Sequence

KV_BLOCK_BYTES = 4096
WEIGHTS_BYTES = 1 << 20


def make_costs(block_size: int = 16) -> CostModel:
    # ~1 ms per forward plus 0.2 ms per token: a decode batch of 16 costs ~4 ms.
    return CostModel(ForwardCoefficients(1e-3, 2e-4, 1e-7, 5e-5), KV_BLOCK_BYTES, block_size, 512, 1024)


@dataclass
class Sim:
    policy: Policy
    budget: int = WEIGHTS_BYTES + (2 << 20)
    num_blocks: int = 256
    block_size: int = 16
    latency_budget_s: float = 0.02
    max_num_seqs: int = 16
    max_batched_tokens: int = 128
    max_latency_budget_s: float | None = None  # > latency_budget_s: headroom-spending policies may grow to it
    kv_relief: Any = None  # a PruneUnderPressure (kv_prune_when = "pressure")
    now: float = 0.0
    finished: list[Sequence] = field(default_factory=list)
    stage_log: list[tuple[float, str]] = field(default_factory=list)  # (time, job id) per stage run
    token_times: dict[int, list[float]] = field(default_factory=dict)  # seq id -> when each token went out

    def __post_init__(self) -> None:
        self.pool = BlockPool(self.num_blocks, self.block_size)
        self.costs = make_costs(self.block_size)
        self.ledger = MemoryLedger(self.budget)
        self.ledger.set(MemoryKind.WEIGHTS, "model", WEIGHTS_BYTES)
        self.scheduler = Scheduler(self.pool, self.policy, self.costs, self.ledger,
                                   max_batched_tokens=self.max_batched_tokens, max_num_seqs=self.max_num_seqs,
                                   latency_budget_s=self.latency_budget_s, slo_tbt_s=2 * self.latency_budget_s,
                                   max_latency_budget_s=self.max_latency_budget_s, kv_relief=self.kv_relief)
        self._ids = itertools.count()
        self.trainers = [FakeTrainer(), FakeTrainer()]

    def add_request(self, prompt_len: int, max_tokens: int, token: int = 7) -> Sequence:
        n = next(self._ids)
        prompt = [token + (i % 5) for i in range(prompt_len)]
        request = Request(f"r{n}", "", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), self.now,
                          metrics=RequestMetrics(self.now, prompt_tokens=prompt_len))
        seq = Sequence(n, request, 0, list(prompt), decoder=None)  # type: ignore[arg-type]
        request.seqs.append(seq)
        self.scheduler.add(seq)
        return seq

    def add_job(self, trainer: int = 0, **shape: float) -> FineTuneJob:
        job = FineTuneJob(f"ft{next(self._ids)}", fake_work(self.trainers[trainer], **shape), self.now, self.now)
        self.scheduler.add_finetune(job)
        return job

    def step(self) -> Batch:
        batch = self.scheduler.schedule(self.now)
        elapsed = batch.planned_s if not batch.empty else 1e-3
        queue = self.scheduler.finetune
        for scheduled in batch.finetune:
            job = scheduled.job
            for _ in range(scheduled.num_stages):
                queue.before_stage(job, job.next_kind or "")
                stage = job.work.run_next()
                self.stage_log.append((self.now, job.job_id))
                queue.after_stage(job, stage.seconds or 0.0, self.now + elapsed)
        sampling = [item.seq for item in batch.items if item.samples]
        self.scheduler.commit(batch, self.now + elapsed)
        for seq in sampling:
            if seq.kv_pruning is not None:
                seq.kv_pruning.steps += 1  # a pruned step ran (a FakePruning's; real ones count in observe)
            seq.token_ids.append(3)
            times = self.token_times.setdefault(seq.seq_id, [])
            times.append(self.now + batch.planned_forward_s)  # tokens go out before the stages run
            if seq.request.metrics.first_token_time is None:
                seq.request.metrics.first_token_time = times[0]
            if seq.num_generated >= seq.params.max_tokens:
                self.scheduler.finish(seq, "length")
                self.finished.append(seq)
        self.now += elapsed
        return batch
