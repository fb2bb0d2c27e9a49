#!/usr/bin/env python3
"""Scheduler overhead: wall and CPU time of one `Scheduler.schedule()` (build tasks, let the policy
pack the bin, allocate blocks, sync the ledger) with 16, 64 and 256 queued tasks, for every policy.
No model runs: sequences advance by one token per iteration and fine-tune jobs carry stage costs
like the default model's, so only the scheduler's own time is measured.

    .venv/bin/python tools/bench_scheduler.py [--iterations 400]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_runtime.kv.block_pool import BlockPool  # noqa: E402
from edge_runtime.memory import MemoryKind, MemoryLedger  # noqa: E402
from edge_runtime.outputs import RequestMetrics  # noqa: E402
from edge_runtime.sampling import SamplingParams  # noqa: E402
from edge_runtime.sched.cost_model import CostModel, ForwardCoefficients  # noqa: E402
from edge_runtime.sched.finetune import FineTuneJob  # noqa: E402
from edge_runtime.sched.registry import POLICIES, make_policy  # noqa: E402
from edge_runtime.sched.scheduler import Scheduler  # noqa: E402
from edge_runtime.sched.testing import FakeStage, FakeTrainer, FakeWork, Kind  # noqa: E402
from edge_runtime.sequence import Request, Sequence  # noqa: E402
from edge_runtime.train.costs import StageEstimate  # noqa: E402

RESULTS = ROOT / "tools" / "results"


class Trainer(FakeTrainer):
    persistent_bytes = 4 << 20


def pair_work(trainer: Trainer) -> FakeWork:
    """A pair's update as the scheduler sees it: score, 4 forward windows, 6 backward groups,
    optimizer, with the default model's order of magnitude of costs."""
    stages = [FakeStage(Kind.SCORE, "score", StageEstimate(0.08, 8 << 20, 0))]
    stages += [FakeStage(Kind.FORWARD, f"f{i}", StageEstimate(0.06, 12 << 20, (i + 1) * (8 << 20))) for i in range(4)]
    stages += [FakeStage(Kind.BACKWARD, f"b{i}", StageEstimate(0.05, 4 << 20, (5 - i) * (5 << 20))) for i in range(6)]
    stages += [FakeStage(Kind.OPTIMIZER, "opt", StageEstimate(0.002, 1 << 20, 0))]
    return FakeWork(trainer, stages)


def default_model_costs() -> CostModel:
    """SmolLM2-135M's shape (bf16, 16-token blocks) with a forward of ~25 ms + 1.5 ms per token,
    the order this project's 2-core CI machine measures."""
    hidden, intermediate, layers, kv_heads, head_dim, vocab, elem = 576, 1536, 30, 3, 64, 49152, 2
    per_token = elem * (4 * hidden + 3 * intermediate + hidden + 2 * kv_heads * head_dim)
    per_row = (4 + elem) * vocab
    block = 2 * layers * 16 * kv_heads * head_dim * elem
    return CostModel(ForwardCoefficients(0.025, 1.5e-3, 2e-7, 1e-3), block, 16, per_token, per_row)


def measure(policy_name: str, queued: int, iterations: int) -> dict[str, float]:
    costs = default_model_costs()
    pool = BlockPool(4096, 16)
    ledger = MemoryLedger(8 << 30)
    ledger.set(MemoryKind.WEIGHTS, "model", 270 << 20)
    scheduler = Scheduler(pool, make_policy(policy_name), costs, ledger, max_batched_tokens=256, max_num_seqs=16,
                          latency_budget_s=0.2, slo_tbt_s=0.25, max_latency_budget_s=0.375)  # engine defaults: 0.8x, 1.5x
    trainers = [Trainer(), Trainer()]
    ids = itertools.count()
    now = 0.0
    wall, cpu = [], []
    n_seqs, n_jobs = queued * 3 // 4, queued - queued * 3 // 4
    for i in range(iterations + 50):
        while len(scheduler.running) + len(scheduler.waiting) < n_seqs:
            n = next(ids)
            prompt = [5 + (n + j) % 97 for j in range(20 + n % 60)]
            request = Request(f"r{n}", "", prompt, SamplingParams(max_tokens=8 + n % 24, ignore_eos=True), now,
                              metrics=RequestMetrics(now))
            seq = Sequence(n, request, 0, list(prompt), decoder=None)  # type: ignore[arg-type]
            request.seqs.append(seq)
            scheduler.add(seq)
        while len(scheduler.finetune) < n_jobs:
            n = next(ids)
            scheduler.add_finetune(FineTuneJob(f"ft{n}", pair_work(trainers[n % 2]), now, now))
        t_wall, t_cpu = time.perf_counter(), time.thread_time()
        batch = scheduler.schedule(now)
        t_cpu, t_wall = time.thread_time() - t_cpu, time.perf_counter() - t_wall
        if i >= 50:  # warm-up: queues fill, caches settle
            wall.append(t_wall)
            cpu.append(t_cpu)
        elapsed = max(batch.planned_s, 1e-3)
        for scheduled in batch.finetune:
            job = scheduled.job
            for _ in range(scheduled.num_stages):
                scheduler.finetune.before_stage(job, job.next_kind or "")
                stage = job.work.run_next()
                scheduler.finetune.after_stage(job, stage.seconds or 0.0, now + elapsed)
        sampling = [item.seq for item in batch.items if item.samples]
        scheduler.commit(batch, now + elapsed)
        for seq in sampling:
            seq.token_ids.append(3)
            if seq.request.metrics.first_token_time is None:  # what mace's headroom budget reads
                seq.request.metrics.first_token_time = now + batch.planned_forward_s
            if seq.num_generated >= seq.params.max_tokens:
                scheduler.finish(seq, "length")
        now += elapsed
    ordered = sorted(wall)
    return {"policy": policy_name, "queued": queued, "iterations": iterations,
            "wall_mean_ms": 1000 * statistics.mean(wall), "wall_p50_ms": 1000 * statistics.median(wall),
            "wall_p99_ms": 1000 * ordered[int(0.99 * (len(ordered) - 1))],
            "cpu_mean_ms": 1000 * statistics.mean(cpu), "cpu_p50_ms": 1000 * statistics.median(cpu)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--queued", default="16,64,256")
    parser.add_argument("--out", default=str(RESULTS / "bench_scheduler"))
    args = parser.parse_args()
    rows = []
    load = os.getloadavg()[0]
    for queued in (int(q) for q in args.queued.split(",")):
        for policy in POLICIES:
            row = measure(policy, queued, args.iterations)
            rows.append(row)
            print(f"{policy:12s} queued {queued:4d}: wall mean {row['wall_mean_ms']:.3f} ms p50 {row['wall_p50_ms']:.3f} "
                  f"p99 {row['wall_p99_ms']:.3f}; CPU mean {row['cpu_mean_ms']:.3f} ms", flush=True)
    mace64 = next(r for r in rows if r["policy"] == "mace" and r["queued"] == 64)
    summary = (f"mace with 64 queued tasks: {mace64['wall_mean_ms']:.3f} ms mean, {mace64['wall_p50_ms']:.3f} ms p50, "
               f"{mace64['wall_p99_ms']:.3f} ms p99 wall per schedule() ({mace64['cpu_mean_ms']:.3f} ms CPU); "
               f"load average {load:.1f} on {os.cpu_count()} CPUs")
    print(summary)
    out = {"machine": f"{platform.platform()}, {os.cpu_count()} CPUs", "loadavg": load, "rows": rows, "summary": summary}
    Path(f"{args.out}.json").write_text(json.dumps(out, indent=1))
    lines = ["# Scheduler overhead (`tools/bench_scheduler.py`)", "", out["machine"] + f", load average {load:.1f}.", "",
             "| policy | queued tasks | wall mean ms | wall p50 ms | wall p99 ms | CPU mean ms |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['policy']} | {r['queued']} | {r['wall_mean_ms']:.3f} | {r['wall_p50_ms']:.3f} | "
              f"{r['wall_p99_ms']:.3f} | {r['cpu_mean_ms']:.3f} |" for r in rows]
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
