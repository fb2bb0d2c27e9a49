#!/usr/bin/env python3
"""Co-serving benchmark: one recorded trace (Poisson and Gamma-burst arrivals; a retrain rate, the
share of requests whose answer produces a preference pair; prompts from tools/traces/prompts.json)
replayed in real time against every scheduling policy on the default model, in one run.

Per run: TTFT and TBT p50/p99, SLO attainment (TTFT <= 5x the prompt's unloaded prefill, as in
the MACE paper, and mean TBT <= the TBT SLO), inference tokens/s, fine-tune pairs/s, scheduler
overhead per iteration, and snapshots of each user's adapter for the alignment metric over time
(held-out DPO loss, reward accuracy, CLPD; evaluated after the runs, off the clock). Load is set
relative to this machine's measured unloaded service time, so the sweep means the same thing on
a quiet or a busy machine. Writes tools/results/bench_coserve.{json,md} and PNG plots.

    .venv/bin/python tools/bench_coserve.py            # full run (~20-25 min on 2 CPU cores)
    .venv/bin/python tools/bench_coserve.py --quick    # smoke run (~3 min)
    .venv/bin/python tools/bench_coserve.py --record   # regenerate tools/traces/coserve.json
    .venv/bin/python tools/bench_coserve.py --scenario memory-pressure   # KV pruning off vs on under
        # a KV cache below the streams' full need (tools/results/bench_coserve_pressure.{json,md})
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_runtime.config import EngineConfig  # noqa: E402
from edge_runtime.engine import Engine  # noqa: E402
from edge_runtime.kv.cache import bytes_per_block  # noqa: E402
from edge_runtime.lora import LoraSettings  # noqa: E402
from edge_runtime.outputs import TokenEvent  # noqa: E402
from edge_runtime.sampling import SamplingParams  # noqa: E402
from edge_runtime.sched.registry import POLICIES  # noqa: E402
from edge_runtime.train import AdapterTrainer, DPOSettings, PreferenceRecord  # noqa: E402
from edge_runtime.train.logprobs import ReferenceCache  # noqa: E402
from edge_runtime.train.optim import OptimizerSettings  # noqa: E402
from tools.report import (  # noqa: E402
    RESULTS,
    OtherCPU,
    markdown_table,
    nearest_rank,
    platform_line,
    pyplot,
    save_figure,
    wait_until_quiet,
    write_json,
    write_markdown,
)

TRACES = ROOT / "tools" / "traces"
USERS = ("alice", "bob")
ORDER = ["mace", "token-level", "apt", "fifo", "continuous", "periodic", "fcfs"]
LORA = LoraSettings()
# Small stages (token windows of 24 positions, backward 5 layers at a time) so that one fits the
# latency a decode iteration leaves; one pair = one optimizer step, so alignment moves within a run.
DPO = DPOSettings(window_tokens=24, layers_per_group=5,
                  optimizer=OptimizerSettings(learning_rate=1e-3, accumulation_steps=1))


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# -- the trace --------------------------------------------------------------------------------


def record_trace(path: Path, requests: int = 600, seed: int = 7) -> dict[str, Any]:
    """Arrival times in units of the mean gap: blocks of 30 Poisson arrivals alternate with blocks
    of 30 Gamma(shape 0.25) arrivals (same mean, coefficient of variation 2: bursts and lulls).
    Each request records its prompt, length, user, the uniform draw `u` that decides whether it
    yields a preference pair at a given retrain rate (u < rate), and which pair."""
    rng = random.Random(seed)
    prompts = json.loads((TRACES / "prompts.json").read_text())
    train_pairs = len(prompts["preference"]) - prompts["heldout"]
    t = 0.0
    rows = []
    for i in range(requests):
        bursty = (i // 30) % 2 == 1
        t += rng.gammavariate(0.25, 4.0) if bursty else rng.expovariate(1.0)
        rows.append({"t": round(t, 4), "process": "gamma" if bursty else "poisson",
                     "prompt": rng.randrange(len(prompts["inference"])), "max_tokens": rng.choice([8, 12, 16, 24]),
                     "user": USERS[rng.randrange(len(USERS))], "u": round(rng.random(), 4),
                     "pair": rng.randrange(train_pairs)})
    trace = {"version": 1, "seed": seed, "unit": "mean inter-arrival gap", "feedback_delay_s": 2.0,
             "requests": rows}
    path.write_text(json.dumps(trace, indent=0))
    return trace


# -- measurements on an idle engine --------------------------------------------------------------


@dataclass
class Unloaded:
    ttft_s: list[float]  # per inference prompt, alone, no prefix cache
    decode_s: float  # one decode step of a lone stream
    pair_s: float  # one preference pair's staged update alone
    service_s: float  # a mean request alone: prefill + its decode steps
    slo_tbt_s: float


def measure_unloaded(engine: Engine, prompts: list[str], mean_tokens: float, tbt_factor: float,
                     trainer: AdapterTrainer, pair: PreferenceRecord) -> Unloaded:
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    ttft = []
    for text in prompts:
        times = []
        for _ in range(2):
            start = time.perf_counter()
            engine.generate(chat(text), one)
            times.append(time.perf_counter() - start)
        ttft.append(min(times))
    steps = []
    engine.add_request(chat(prompts[0]), SamplingParams(max_tokens=17, ignore_eos=True))
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    decode = statistics.median(steps[1:])
    start = time.perf_counter()
    engine.add_finetune(trainer.task(pair, score=False))
    while engine.has_unfinished():
        engine.step()
    pair_s = time.perf_counter() - start
    service = statistics.mean(ttft) + (mean_tokens - 1) * decode
    return Unloaded(ttft, decode, pair_s, service, tbt_factor * decode)


# -- one run ------------------------------------------------------------------------------------


@dataclass
class RunResult:
    policy: str
    load: float
    retrain_rate: float
    duration_s: float
    requests: list[dict[str, Any]] = field(default_factory=list)
    tbt_gaps_s: list[float] = field(default_factory=list)
    pairs: list[dict[str, Any]] = field(default_factory=list)
    pairs_offered: int = 0
    iterations: int = 0
    overhead_s: list[float] = field(default_factory=list)
    queued: list[int] = field(default_factory=list)
    busy: dict[str, float] = field(default_factory=dict)
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    loadavg: tuple[float, float, float] = (0.0, 0.0, 0.0)
    others_cores: float = 0.0  # CPU other processes used during the run, in cores
    cost_model: dict[str, Any] = field(default_factory=dict)
    trace: list[dict[str, Any]] = field(default_factory=list)  # per iteration (--iteration-log)
    peak_kv_blocks: int = 0  # most KV blocks sequences held after an iteration
    kv_blocks_total: int = 0
    preemptions: int = 0
    kv_prune_turned_on: int = 0  # sequences kv_prune_when = "pressure" turned pruning on for
    ft_stages_run: int = 0


def run_policy(policy: str, load: float, rate: float, trace: dict[str, Any], ctx: dict[str, Any],
               window_s: float, drain_s: float, checkpoints: int, *, engine_overrides: dict[str, Any] | None = None,
               seconds_per_unit: float | None = None, stop_when_served: bool = False) -> RunResult:
    """One replay of `trace`. Arrivals come every `seconds_per_unit` trace units (default: the
    unloaded service time / `load`); with `stop_when_served` the run ends once every request in
    the window is answered (fine-tune work left over is what it is then)."""
    model, tokenizer, unloaded = ctx["model"], ctx["tokenizer"], ctx["unloaded"]
    params = {"period_s": window_s / 3} if policy == "periodic" else {}
    settings = {"policy": policy, "policy_params": params, "slo_tbt_ms": unloaded.slo_tbt_s * 1000,
                "kv_cache_bytes": 64 << 20, "max_num_seqs": 16, "max_batched_tokens": 256,
                "cost_cache_dir": ctx["cost_dir"], **(engine_overrides or {})}
    engine = Engine(model, tokenizer, EngineConfig(**settings), name=ctx["name"])
    trainers = {u: AdapterTrainer(model, tokenizer, lora=LORA, dpo=DPO, costs=ctx["stage_costs"],
                                  reference_cache=ctx["reference"]) for u in USERS}
    gap = seconds_per_unit if seconds_per_unit is not None else unloaded.service_s / load
    prompts, pairs = ctx["prompts"]["inference"], ctx["train_pairs"]
    arrivals = [(r["t"] * gap, r) for r in trace["requests"] if r["t"] * gap <= window_s]
    feedback = sorted(((t + trace["feedback_delay_s"], r) for t, r in arrivals
                       if r["u"] < rate and t + trace["feedback_delay_s"] <= window_s), key=lambda f: f[0])
    result = RunResult(policy, load, rate, window_s + drain_s, pairs_offered=len(feedback))
    stamps: dict[str, list[float]] = {}
    pending: list[tuple[TokenEvent, float]] = []

    def emitted(event: TokenEvent) -> None:
        # A token reaches its client when the engine emits it (after its forward; an
        # iteration's fine-tune stages run after its tokens are out).
        pending.append((event, engine.clock()))
    done_pairs: list[tuple[str, float, float]] = []

    timing = {"forward": 0.0}
    execute = engine.backend.execute

    def timed_execute(batch, *args):
        started = time.perf_counter()
        out = execute(batch, *args)
        timing["forward"] += time.perf_counter() - started
        return out

    engine.backend.execute = timed_execute
    schedule = engine.scheduler.schedule
    planned: list[Any] = []

    def recorded_schedule(now):
        batch = schedule(now)
        planned.append(batch)
        return batch

    engine.scheduler.schedule = recorded_schedule
    next_request = next_pair = 0
    checkpoint_at = [window_s * (k + 1) / checkpoints for k in range(checkpoints)]
    meta: dict[str, dict[str, Any]] = {}
    os_load = os.getloadavg()
    others = OtherCPU()
    start = time.monotonic()
    engine.clock = lambda: time.monotonic() - start  # trace time (the one clock, shifted)
    while True:
        now = engine.clock()
        while next_request < len(arrivals) and arrivals[next_request][0] <= now:
            at, row = arrivals[next_request]
            rid = f"q{next_request}"
            meta[rid] = {"arrival": at, "prompt": row["prompt"], "process": row["process"],
                         "max_tokens": row["max_tokens"]}
            engine.add_request(chat(prompts[row["prompt"]]), SamplingParams(max_tokens=row["max_tokens"], ignore_eos=True),
                               request_id=rid, on_token=emitted)
            next_request += 1
        while next_pair < len(feedback) and feedback[next_pair][0] <= now:
            at, row = feedback[next_pair]
            trainer = trainers[row["user"]]

            def finished(job, at=at):
                done_pairs.append((job.user, at, job.finished_at))

            engine.add_finetune(trainer.task(pairs[row["pair"]], score=False), user=row["user"], arrival=at,
                                on_done=finished)
            next_pair += 1
        while checkpoint_at and now >= checkpoint_at[0]:
            # Taken between iterations: after a long (blocking) iteration, later than planned;
            # `t` is when it was taken.
            checkpoint_at.pop(0)
            result.snapshots.append({"t": now, **{
                u: {"pairs": trainers[u].pairs_trained, "weights": trainers[u].snapshot()} for u in USERS}})
        if now >= window_s + drain_s:
            break
        if stop_when_served and next_request == len(arrivals) and not engine.requests:
            break
        if not engine.has_unfinished():
            upcoming = [arrivals[next_request][0]] if next_request < len(arrivals) else []
            upcoming += [feedback[next_pair][0]] if next_pair < len(feedback) else []
            time.sleep(max(0.0, min([*upcoming, window_s + drain_s, now + 0.05]) - now))
            continue
        before = engine.iterations
        planned.clear()
        sched = engine.scheduler
        next_stage = []
        if ctx.get("iteration_log"):
            # The cheapest next stage a fine-tune job could run (as the scheduler prices it):
            # what an iteration had to leave free for fine-tuning to move. Only for the log:
            # this loop runs in real time, and the iteration's wall time starts after it.
            next_stage = [sched.costs.stage_s(c.kind, c.seconds) for job in sched.finetune.runnable()
                          for c in job.stage_costs(1)]
            now = engine.clock()
        step_start, ft_before = now, sched.finetune.seconds
        engine.step()
        result.peak_kv_blocks = max(result.peak_kv_blocks, engine.pool.num_used)
        delivered = engine.clock()
        for event, at in pending:
            if event.token_id is not None:
                stamps.setdefault(event.request_id, []).append(at)
        pending.clear()
        if engine.iterations == before:
            time.sleep(0.002)  # nothing runnable now (e.g. periodic between windows)
            continue
        result.overhead_s.append(engine.scheduler.overhead_s)
        result.queued.append(len(sched.waiting) + len(sched.running) + len(sched.finetune))
        if planned:
            batch = planned[-1]
            result.trace.append({
                "t": round(step_start, 4), "wall_s": round(delivered - step_start, 4),
                "budget_s": round(sched.iteration_budget_s, 4) if math.isfinite(sched.iteration_budget_s) else None,
                "planned_s": round(batch.planned_s, 4), "planned_forward_s": round(batch.planned_forward_s, 4),
                "decodes": sum(1 for i in batch.items if i.num_tokens == 1),
                "prefill_tokens": sum(i.num_tokens for i in batch.items if i.num_tokens > 1),
                "stages": sum(s.num_stages for s in batch.finetune),
                "stages_s": round(sched.finetune.seconds - ft_before, 4),
                "next_stage_s": round(min(next_stage), 4) if next_stage else None,
                "waiting": len(sched.waiting), "running": len(sched.running), "ft_jobs": len(sched.finetune)})
    end = engine.clock()
    while checkpoint_at:
        checkpoint_at.pop(0)
        result.snapshots.append({"t": end, **{
            u: {"pairs": trainers[u].pairs_trained, "weights": trainers[u].snapshot()} for u in USERS}})
    # An iteration that started before the deadline runs to its end (a blocking policy's whole
    # fine-tune job can take longer than the window): rates use the time the run really took.
    result.duration_s = end if stop_when_served else max(result.duration_s, end)
    for rid in list(engine.requests):
        engine.abort(rid)
    stats = engine.stats()
    result.iterations = stats["iterations"]
    result.kv_blocks_total, result.preemptions = stats["kv_blocks_total"], stats["preemptions"]
    result.kv_prune_turned_on, result.ft_stages_run = stats["kv_prune_turned_on"], stats["finetune_stages_run"]
    result.busy = {"forward": timing["forward"], "finetune": stats["finetune_seconds"],
                   "scheduler": sum(result.overhead_s)}
    for rid, info in meta.items():
        times = stamps.get(rid, [])
        finished = len(times) >= info["max_tokens"]
        result.requests.append({**info, "first": times[0] if times else None, "last": times[-1] if times else None,
                                "tokens": len(times), "finished": finished})
        result.tbt_gaps_s += [b - a for a, b in zip(times, times[1:], strict=False)]
    result.pairs = [{"user": u, "arrival": a, "done": d} for u, a, d in done_pairs if d is not None]
    result.loadavg = (os_load[0], os.getloadavg()[0], os.cpu_count() or 0)
    result.others_cores = others.cores()
    result.cost_model = stats["cost_model"]
    return result


# -- metrics ------------------------------------------------------------------------------------


def summarise(run: RunResult, unloaded: Unloaded, ttft_factor: float) -> dict[str, Any]:
    ttft, ok, ttft_ok = [], 0, 0
    for r in run.requests:
        if r["first"] is None:
            continue
        t = r["first"] - r["arrival"]
        ttft.append(t)
        meets_ttft = t <= ttft_factor * unloaded.ttft_s[r["prompt"]]
        tpot = (r["last"] - r["first"]) / (r["tokens"] - 1) if r["tokens"] > 1 else 0.0
        ttft_ok += meets_ttft
        ok += meets_ttft and r["finished"] and tpot <= unloaded.slo_tbt_s
    n = len(run.requests)
    tokens = sum(r["tokens"] for r in run.requests)
    pair_latency = [p["done"] - p["arrival"] for p in run.pairs]
    return {
        "policy": run.policy, "load": run.load, "retrain_rate": run.retrain_rate, "requests": n,
        "slo_attainment": ok / n if n else None,
        "ttft_slo_attainment": ttft_ok / n if n else None,
        "ttft_p50_s": nearest_rank(ttft, 0.5), "ttft_p99_s": nearest_rank(ttft, 0.99),
        "tbt_p50_s": nearest_rank(run.tbt_gaps_s, 0.5), "tbt_p99_s": nearest_rank(run.tbt_gaps_s, 0.99),
        "tokens_per_s": tokens / run.duration_s,
        "pairs_offered": run.pairs_offered, "pairs_done": len(run.pairs),
        "ft_pairs_per_s": len(run.pairs) / run.duration_s,
        "ft_pair_latency_p50_s": nearest_rank(pair_latency, 0.5),
        "ft_pairs": [{k: round(v, 3) if isinstance(v, float) else v for k, v in p.items()} for p in run.pairs],
        "iterations": run.iterations,
        "sched_overhead_mean_ms": 1000 * statistics.mean(run.overhead_s) if run.overhead_s else None,
        "sched_overhead_p99_ms": 1000 * (nearest_rank(run.overhead_s, 0.99) or 0.0),
        "max_queued": max(run.queued, default=0),
        "preemptions": run.preemptions, "peak_kv_blocks": run.peak_kv_blocks, "kv_blocks_total": run.kv_blocks_total,
        "kv_prune_turned_on": run.kv_prune_turned_on, "ft_stages_run": run.ft_stages_run,
        "ft_stages_per_s": run.ft_stages_run / run.duration_s, "duration_s": run.duration_s,
        "busy_s": {k: round(v, 3) for k, v in run.busy.items()},
        "loadavg_start_end": run.loadavg[:2],
        "other_processes_cores": round(run.others_cores, 3),
        "cost_model": run.cost_model,
    }


def evaluate_alignment(runs: list[RunResult], ctx: dict[str, Any]) -> None:
    """Held-out DPO loss / reward accuracy / CLPD of each user's adapter at each checkpoint,
    averaged over users; snapshots with no new pairs reuse the previous evaluation."""
    evaluator = AdapterTrainer(ctx["model"], ctx["tokenizer"], lora=LORA, dpo=DPO, reference_cache=ctx["reference"])
    heldout = ctx["heldout_tokens"]
    base = evaluator.evaluate(heldout, None)
    for run in runs:
        curve = []
        memo: dict[tuple[str, int], Any] = {}
        for snap in run.snapshots:
            per_user = []
            for user in USERS:
                pairs, weights = snap[user]["pairs"], snap[user]["weights"]
                key = (user, pairs)
                if key not in memo:
                    memo[key] = base if pairs == 0 else evaluator.evaluate(heldout, weights)
                per_user.append(memo[key])
            curve.append({"t": snap["t"], "pairs": sum(snap[u]["pairs"] for u in USERS),
                          "dpo_loss": statistics.mean(m.dpo_loss for m in per_user),
                          "reward_accuracy": statistics.mean(m.reward_accuracy for m in per_user),
                          "clpd": statistics.mean(m.clpd for m in per_user),
                          "win_rate": statistics.mean(m.win_rate for m in per_user)})
            for user in USERS:
                snap[user].pop("weights")
        run.snapshots = curve
    ctx["alignment_base"] = base.as_dict()


def alignment_summary(run: RunResult, base_loss: float) -> dict[str, Any]:
    if not run.snapshots:
        return {}
    return {
        # Mean over the checkpoints of the held-out DPO loss drop from the base model: an area
        # under the alignment-over-time curve (higher: aligned more, sooner).
        "alignment_gain_over_time": statistics.mean(base_loss - c["dpo_loss"] for c in run.snapshots),
        "final_dpo_loss": run.snapshots[-1]["dpo_loss"],
        "final_reward_accuracy": run.snapshots[-1]["reward_accuracy"],
        "final_clpd": run.snapshots[-1]["clpd"],
        "curve": run.snapshots,
    }


# -- memory-pressure scenario (issue #22: KV pruning turned on under pressure) ------------------

# Each run: the scheduling policy's engine with these KV pruning settings (capacity from --prune-capacity).
PRESSURE_RUNS: dict[str, dict[str, Any]] = {
    "off": {},
    "mace": {"kv_prune_policy": "mace", "kv_prune_when": "pressure"},
    "window": {"kv_prune_policy": "window", "kv_prune_when": "pressure"},
}


def pressure_trace(streams: int, max_tokens: int, span_s: float, prompts: int, pairs: int,
                   seed: int = 11) -> dict[str, Any]:
    """`streams` long generations arriving (Poisson) within `span_s` seconds, each answer giving a
    preference pair one second later: the trace format of `record_trace`, in seconds."""
    rng = random.Random(seed)
    rows, t = [], 0.0
    for i in range(streams):
        rows.append({"t": round(t, 4), "process": "poisson", "prompt": rng.randrange(prompts), "max_tokens": max_tokens,
                     "user": USERS[i % len(USERS)], "u": 0.0, "pair": rng.randrange(pairs)})
        t += rng.expovariate(streams / span_s) if span_s > 0 else 0.0
    return {"version": 1, "seed": seed, "unit": "second", "feedback_delay_s": 1.0, "requests": rows}


def full_kv_blocks(ctx: dict[str, Any], trace: dict[str, Any], block_size: int) -> int:
    """KV blocks every stream of `trace` needs at its full length (prompt + generation), together."""
    engine = Engine(ctx["model"], ctx["tokenizer"],
                    EngineConfig(cost_profile="off", block_size=block_size, kv_cache_bytes=64 << 20),
                    name=ctx["name"])
    total = 0
    for row in trace["requests"]:
        rid = engine.add_request(chat(ctx["prompts"]["inference"][row["prompt"]]),
                                 SamplingParams(max_tokens=row["max_tokens"], ignore_eos=True))
        total += -(-(len(engine.requests[rid].prompt_ids) + row["max_tokens"]) // block_size)
        engine.abort(rid)
    return total


def memory_pressure(args: argparse.Namespace) -> dict[str, Any]:
    """Pruning off vs on (kv_prune_when = "pressure") on one trace whose streams' full KV exceeds
    the cache (`--kv-fraction` of it), with their answers' preference pairs trained alongside."""
    prompts = json.loads((TRACES / "prompts.json").read_text())
    block_size = EngineConfig().block_size
    runs = [r for r in args.pressure_runs.split(",") if r]
    unknown = set(runs) - set(PRESSURE_RUNS)
    if unknown:
        raise SystemExit(f"unknown --pressure-runs: {sorted(unknown)} (use {', '.join(PRESSURE_RUNS)})")
    ctx = prepare(args, prompts, args.pressure_tokens)
    unloaded = ctx["unloaded"]
    train_pairs = len(ctx["train_pairs"])
    trace = pressure_trace(args.pressure_streams, args.pressure_tokens, args.pressure_span, len(prompts["inference"]),
                           train_pairs)
    full = full_kv_blocks(ctx, trace, block_size)
    cfg = ctx["model"].cfg
    per_block = bytes_per_block(cfg, block_size, ctx["model"].dtype)
    blocks = max(1, int(full * args.kv_fraction))
    base = {"kv_cache_bytes": blocks * per_block, "policy": args.pressure_policy, "kv_prune_capacity": args.prune_capacity}
    window_s = args.pressure_span + 2.0
    print(f"memory pressure: {len(trace['requests'])} streams x {args.pressure_tokens} tokens need {full} KV blocks; "
          f"the cache holds {blocks} ({args.kv_fraction:.0%}); pruning keeps {args.prune_capacity} positions per head",
          flush=True)
    rows, results = [], []
    for name in runs:
        overrides = {**base, **PRESSURE_RUNS[name]}
        if name == "off":
            overrides.pop("kv_prune_capacity")
        run = run_policy(args.pressure_policy, 1.0, 1.0, trace, ctx, window_s, args.pressure_drain, 1,
                         engine_overrides=overrides, seconds_per_unit=1.0, stop_when_served=True)
        row = {"pruning": name, **summarise(run, unloaded, args.ttft_factor)}
        rows.append(row)
        results.append(run)
        print(f"pruning {name:6s} SLO {row['slo_attainment']:.0%} TBT p50/p99 {fmt(row['tbt_p50_s'], 1000, 0)}/"
              f"{fmt(row['tbt_p99_s'], 1000, 0)} ms preemptions {row['preemptions']} turned on "
              f"{row['kv_prune_turned_on']} peak KV {row['peak_kv_blocks']}/{row['kv_blocks_total']} blocks "
              f"FT pairs {row['pairs_done']}/{row['pairs_offered']} stages {row['ft_stages_run']} "
              f"({run.duration_s:.1f} s)", flush=True)
    # Runs end when their streams are answered, so fine-tune progress is compared at one moment:
    # the end of the shortest run (a faster run would otherwise look slower at training).
    common_end = min(run.duration_s for run in results)
    for row, run in zip(rows, results, strict=True):
        row["common_end_s"] = common_end
        row["ft_pairs_by_common_end"] = sum(1 for p in run.pairs if p["done"] <= common_end)
        row["ft_stages_by_common_end"] = sum(it["stages"] for it in run.trace if it["t"] + it["wall_s"] <= common_end)
    out = {
        "scenario": "memory-pressure",
        "machine": f"{platform_line()}, torch {torch.__version__}, "
                   f"{args.threads} torch thread(s)",
        "model": ctx["name"], "dtype": str(ctx["model"].dtype).removeprefix("torch."),
        "policy": args.pressure_policy, "streams": len(trace["requests"]), "max_tokens": args.pressure_tokens,
        "span_s": args.pressure_span, "full_kv_blocks": full, "kv_blocks": blocks, "kv_fraction": args.kv_fraction,
        "prune_capacity": args.prune_capacity, "ttft_factor": args.ttft_factor, "tbt_factor": args.tbt_factor,
        "unloaded": asdict(unloaded), "calibration_other_processes_cores": round(ctx["calibration_others"], 3),
        "runs": rows,
    }
    out["bar"] = pressure_bar(rows)
    prefix = Path(args.out)
    write_json(f"{prefix}.json", out, default=float)
    write_pressure_report(out, Path(f"{prefix}.md"))
    print("\n".join(out["bar"]), flush=True)
    print(f"wrote {prefix}.json and {prefix}.md")
    return out


def pressure_bar(rows: list[dict[str, Any]]) -> list[str]:
    """Issue #22's bar: pruning on gives higher SLO attainment or fine-tune progress than off.
    Progress: pairs, then stages, done by the end of the shortest run."""
    off = next((r for r in rows if r["pruning"] == "off"), None)
    if off is None:
        return ["no run with pruning off to compare with"]
    lines = []
    for r in rows:
        if r is off:
            continue
        slo_up = (r["slo_attainment"] or 0) > (off["slo_attainment"] or 0)
        progress = (r["ft_pairs_by_common_end"], r["ft_stages_by_common_end"])
        ft_up = progress > (off["ft_pairs_by_common_end"], off["ft_stages_by_common_end"])
        lines.append(f"{r['pruning']} vs off: SLO {fmt(r['slo_attainment'], 100, 0)}% vs {fmt(off['slo_attainment'], 100, 0)}%, "
                     f"FT by {r['common_end_s']:.0f} s: {progress[0]} vs {off['ft_pairs_by_common_end']} pairs, "
                     f"{progress[1]} vs {off['ft_stages_by_common_end']} stages (all: {r['pairs_done']} vs "
                     f"{off['pairs_done']} pairs in {r['duration_s']:.0f} vs {off['duration_s']:.0f} s), preemptions "
                     f"{r['preemptions']} vs {off['preemptions']}: bar {'met' if slo_up or ft_up else 'NOT met'}")
    return lines


def write_pressure_report(out: dict[str, Any], path_md: Path) -> None:
    lines = [
        "# Co-serving under memory pressure (`tools/bench_coserve.py --scenario memory-pressure`)", "",
        f"{out['machine']}. Model {out['model']} ({out['dtype']}), scheduling policy {out['policy']}. "
        f"{out['streams']} streams of {out['max_tokens']} tokens arriving within {out['span_s']:g} s need "
        f"{out['full_kv_blocks']} KV blocks at full length; the cache holds {out['kv_blocks']} "
        f"({out['kv_fraction']:.0%}). Each answer gives a preference pair trained alongside. Pruning, when on, "
        f"is turned on per sequence under pressure (kv_prune_when = \"pressure\") and keeps "
        f"{out['prune_capacity']} positions per KV head. SLO: TTFT <= {out['ttft_factor']:g}x the prompt's "
        f"unloaded prefill and mean TBT <= {out['unloaded']['slo_tbt_s'] * 1000:.0f} ms. A run ends when every "
        "stream is answered.", "",
    ]
    lines += markdown_table(
        ["pruning", "SLO %", "TTFT p50/p99 s", "TBT p50/p99 ms", "preemptions", "turned on", "peak KV blocks",
         "FT pairs (stages) by the shortest run's end", "FT pairs (stages) in all", "run s", "tok/s"],
        [[r["pruning"], fmt(r["slo_attainment"], 100, 0), f"{fmt(r['ttft_p50_s'])}/{fmt(r['ttft_p99_s'])}",
          f"{fmt(r['tbt_p50_s'], 1000, 0)}/{fmt(r['tbt_p99_s'], 1000, 0)}", r["preemptions"],
          r["kv_prune_turned_on"], f"{r['peak_kv_blocks']}/{r['kv_blocks_total']}",
          f"{r['ft_pairs_by_common_end']} ({r['ft_stages_by_common_end']})",
          f"{r['pairs_done']}/{r['pairs_offered']} ({r['ft_stages_run']})", f"{r['duration_s']:.0f}",
          fmt(r["tokens_per_s"], 1, 1)] for r in out["runs"]],
        align="lrllrrrllrr")
    lines += ["", "## Bar", ""] + [f"- {line}" for line in out["bar"]] + [""]
    write_markdown(path_md, lines)


# -- report -------------------------------------------------------------------------------------


def fmt(v: Any, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def write_report(out: dict[str, Any], path_md: Path) -> None:
    lines = [
        "# Co-serving benchmark (`tools/bench_coserve.py`)", "",
        f"{out['machine']}. Model {out['model']} ({out['dtype']}). Trace `tools/traces/coserve.json` "
        f"(Poisson + Gamma(0.25) bursts), window {out['window_s']:.0f} s + {out['drain_s']:.0f} s drain per run, "
        f"all policies on the same arrivals. Load = arrival rate x unloaded service time of a mean request "
        f"({out['unloaded']['service_s']:.2f} s). Unloaded: decode step {out['unloaded']['decode_s'] * 1000:.0f} ms, "
        f"one pair's DPO update {out['unloaded']['pair_s']:.2f} s. SLO: TTFT <= {out['ttft_factor']:g}x the "
        f"prompt's unloaded prefill and mean TBT <= {out['unloaded']['slo_tbt_s'] * 1000:.0f} ms "
        f"({out['tbt_factor']:g}x a decode step). Machine load average during the run: "
        f"{out['loadavg_min']:.1f}-{out['loadavg_max']:.1f} on {os.cpu_count()} CPUs; other processes used "
        f"{out['calibration_other_processes_cores']:.2f} cores while the unloaded figures were measured and at most "
        f"{out['other_processes_cores_max']:.2f} during a run.", "",
    ]
    for title, rows in (("Load sweep", out["load_sweep"]), ("Retrain-rate sweep", out["retrain_sweep"])):
        lines += [f"## {title}", ""]
        lines += markdown_table(
            ["policy", "load", "retrain", "SLO %", "TTFT-SLO %", "TTFT p50/p99 s", "TBT p50/p99 ms", "tok/s",
             "FT pairs/s (done/offered)", "alignment gain", "sched ms mean/p99"],
            [[r["policy"], f"{r['load']:g}", f"{r['retrain_rate']:g}", fmt(r["slo_attainment"], 100, 0),
              fmt(r["ttft_slo_attainment"], 100, 0), f"{fmt(r['ttft_p50_s'])}/{fmt(r['ttft_p99_s'])}",
              f"{fmt(r['tbt_p50_s'], 1000, 0)}/{fmt(r['tbt_p99_s'], 1000, 0)}", fmt(r["tokens_per_s"], 1, 1),
              f"{fmt(r['ft_pairs_per_s'], 1, 3)} ({r['pairs_done']}/{r['pairs_offered']})",
              fmt(r.get("alignment", {}).get("alignment_gain_over_time"), 1, 3),
              f"{fmt(r['sched_overhead_mean_ms'], 1, 2)}/{fmt(r['sched_overhead_p99_ms'], 1, 2)}"] for r in rows],
            align="lrrrrllrlrl")
        lines.append("")
    bar = out["bar"]
    lines += ["## Bar", ""] + [f"- {line}" for line in bar["lines"]] + [""]
    lines += ["## Scheduler overhead with 64 queued tasks (`tools/bench_scheduler.py`)", "",
              out.get("scheduler_overhead_note", "(run tools/bench_scheduler.py)"), ""]
    write_markdown(path_md, lines)


def evaluate_bar(out: dict[str, Any]) -> dict[str, Any]:
    rows = out["load_sweep"]
    by = {(r["policy"], r["load"]): r for r in rows}
    loads = sorted({r["load"] for r in rows})
    lines = []
    target = next((x for x in loads if (by.get(("continuous", x)) or {}).get("slo_attainment", 1.0) < 0.5), None)
    result: dict[str, Any] = {"load": target}
    if target is None:
        lines.append("continuous never fell below 50% SLO attainment in the sweep: the bar's load point was not reached")
    else:
        mace, cont, per = by.get(("mace", target)), by[("continuous", target)], by.get(("periodic", target), {})
        if mace is None:
            return {"load": target, "lines": lines + ["mace was not run"]}
        ratio = mace["ft_pairs_per_s"] / cont["ft_pairs_per_s"] if cont["ft_pairs_per_s"] else float("inf")
        gain_m = mace.get("alignment", {}).get("alignment_gain_over_time")
        gain_p = per.get("alignment", {}).get("alignment_gain_over_time")
        result.update(mace_slo=mace["slo_attainment"], continuous_slo=cont["slo_attainment"], ft_ratio=ratio,
                      mace_alignment=gain_m, periodic_alignment=gain_p)
        lines.append(f"first load where continuous < 50% SLO: {target:g} (continuous {cont['slo_attainment']:.0%})")
        lines.append(f"mace SLO attainment {mace['slo_attainment']:.0%} (bar >= 90%): "
                     f"{'met' if mace['slo_attainment'] >= 0.9 else 'NOT met'}")
        lines.append(f"mace FT pairs/s = {ratio:.0%} of continuous's (bar >= 70%): {'met' if ratio >= 0.7 else 'NOT met'}")
        if gain_m is not None and gain_p is not None:
            lines.append(f"alignment gain over time: mace {gain_m:.3f} vs periodic {gain_p:.3f} (bar: above): "
                         f"{'met' if gain_m > gain_p else 'NOT met'}")
    result["lines"] = lines
    return result


def plot(out: dict[str, Any], runs_alignment: dict[str, Any], prefix: Path) -> list[str]:
    plt = pyplot()
    files = []
    rows = out["load_sweep"]
    policies = [p for p in ORDER if any(r["policy"] == p for r in rows)]
    loads = sorted({r["load"] for r in rows})
    by = {(r["policy"], r["load"]): r for r in rows}

    fig, ax = plt.subplots(figsize=(6, 4))
    for p in policies:
        ax.plot(loads, [100 * (by[(p, x)]["slo_attainment"] or 0) for x in loads], marker="o", label=p)
    ax.set_xlabel("load (x unloaded service rate)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    files.append(save_figure(fig, f"{prefix}_slo_vs_load.png"))

    focus = out["bar"].get("load") or loads[len(loads) // 2]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    for ax, (key, label) in zip(axes, (("ttft_p50_s", "TTFT p50 (s)"), ("tbt_p50_s", "TBT p50 (s)"),
                                       ("ft_pair_latency_p50_s", "fine-tune pair latency p50 (s)")), strict=True):
        ax.bar(policies, [by[(p, focus)][key] or 0 for p in policies], color="tab:blue")
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", rotation=45, labelsize=8)
    fig.suptitle(f"latency breakdown at load {focus:g}", fontsize=10)
    files.append(save_figure(fig, f"{prefix}_latency_breakdown.png"))

    rrows = out["retrain_sweep"]
    rates = sorted({r["retrain_rate"] for r in rrows})
    rby = {(r["policy"], r["retrain_rate"]): r for r in rrows}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for p in policies:
        axes[0].plot(rates, [rby[(p, x)]["tokens_per_s"] for x in rates], marker="o", label=p)
        axes[1].plot(rates, [rby[(p, x)]["ft_pairs_per_s"] for x in rates], marker="o", label=p)
    axes[0].set_ylabel("inference tokens/s")
    axes[1].set_ylabel("fine-tune pairs/s")
    for ax in axes:
        ax.set_xlabel("retrain rate")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    files.append(save_figure(fig, f"{prefix}_throughput_vs_retrain.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    base = out["alignment_base"]["dpo_loss"]
    for p in policies:
        curve = runs_alignment.get((p, focus), {}).get("curve", [])
        if curve:
            ax.plot([0] + [c["t"] for c in curve], [0] + [base - c["dpo_loss"] for c in curve], marker="o", label=p)
    ax.set_xlabel("time in the run (s)")
    ax.set_ylabel("held-out DPO loss drop vs base")
    ax.set_title(f"alignment over time at load {focus:g}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    files.append(save_figure(fig, f"{prefix}_alignment.png"))
    return files


# -- main ---------------------------------------------------------------------------------------


def prepare(args: argparse.Namespace, prompts: dict[str, Any], mean_tokens: float) -> dict[str, Any]:
    """What every run shares: the model (`args.model`, None = the default), the cost models,
    the tokenized preference pairs with their reference log-probabilities, and the unloaded
    figures (measured with `mean_tokens` per request) that define load and the SLOs."""
    t_setup = time.monotonic()
    torch.set_num_threads(args.threads)
    # float32: on CPUs autograd in bfloat16 is several times slower than in float32 (measured
    # here: a pair's score stage 15 s vs 2.5 s), and the DPO benchmark trains in float32 too.
    # The cost models are calibrated afresh for this run (not taken from the machine's cache,
    # which may date from a busier or quieter moment) and shared by every run.
    cost_dir = tempfile.mkdtemp(prefix="bench-coserve-costs-")
    quiet = wait_until_quiet(args.quiet_wait)
    if quiet >= 0.2:
        print(f"warning: other processes still use {quiet:.2f} cores; the unloaded figures (and so the load "
              "scale) will describe a shared machine", flush=True)
    calibration = OtherCPU()
    probe = Engine.load(args.model, dtype="float32", policy="fcfs", kv_cache_bytes=64 << 20, enable_prefix_cache=False,
                        cost_cache_dir=cost_dir)
    model, tokenizer = probe.model, probe.tokenizer
    torch.manual_seed(0)
    records = [PreferenceRecord(tuple(chat(p["prompt"])), p["chosen"], p["rejected"]) for p in prompts["preference"]]
    heldout_n = prompts["heldout"]
    train_records, heldout_records = records[:-heldout_n], records[-heldout_n:]
    stage_costs = probe.stage_costs(LORA)
    reference = ReferenceCache()
    warm = AdapterTrainer(model, tokenizer, lora=LORA, dpo=DPO, costs=stage_costs, reference_cache=reference)
    train_tokens = [warm.tokenize(r) for r in train_records]
    heldout_tokens = [warm.tokenize(r) for r in heldout_records]
    for tokens in train_tokens + heldout_tokens:  # every policy finds the same reference cache
        warm.reference_logps(tokens)
    wait_until_quiet(args.quiet_wait)
    calibration.start()
    unloaded = measure_unloaded(probe, prompts["inference"], mean_tokens, args.tbt_factor,
                                AdapterTrainer(model, tokenizer, lora=LORA, dpo=DPO, costs=stage_costs,
                                               reference_cache=reference), train_records[0])
    calibration_others = calibration.cores()
    print(f"setup {time.monotonic() - t_setup:.0f} s; unloaded (other processes {calibration_others:.2f} cores): "
          f"service {unloaded.service_s:.2f} s, decode "
          f"{unloaded.decode_s * 1000:.0f} ms, pair {unloaded.pair_s:.2f} s, TBT SLO {unloaded.slo_tbt_s * 1000:.0f} ms",
          flush=True)
    return {"model": model, "tokenizer": tokenizer, "name": probe.model_name, "unloaded": unloaded, "cost_dir": cost_dir,
            "iteration_log": bool(args.iteration_log),
            "stage_costs": stage_costs, "reference": reference, "prompts": prompts, "train_pairs": train_tokens,
            "heldout_tokens": heldout_tokens, "calibration_others": calibration_others}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--record", action="store_true", help="regenerate the trace and exit")
    parser.add_argument("--policies", default=",".join(ORDER))
    parser.add_argument("--loads", default="0.5,1,1.5", help="load sweep (x unloaded service rate)")
    parser.add_argument("--retrain-rates", default="0.05,0.15,0.3", help="retrain-rate sweep at --main-load")
    parser.add_argument("--main-rate", type=float, default=0.15, help="retrain rate of the load sweep")
    parser.add_argument("--main-load", type=float, default=1.0, help="load of the retrain-rate sweep")
    parser.add_argument("--window", type=float, default=30.0, help="seconds of trace per run")
    parser.add_argument("--drain", type=float, default=5.0, help="seconds after the window to finish work")
    parser.add_argument("--checkpoints", type=int, default=4)
    parser.add_argument("--ttft-factor", type=float, default=5.0)
    parser.add_argument("--tbt-factor", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: on a machine shared with other work, 2 OpenMP threads "
                             "measured 20x slower per decode step than 1 under contention)")
    parser.add_argument("--quiet-wait", type=float, default=300.0,
                        help="seconds to wait for other processes to fall below 0.2 cores before measuring the "
                             "unloaded figures that define load")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 policies, 1 load, short windows")
    parser.add_argument("--out", default=str(RESULTS / "bench_coserve"))
    parser.add_argument("--scenario", choices=("sweep", "memory-pressure"), default="sweep",
                        help="sweep: every policy over loads and retrain rates; memory-pressure: KV pruning off vs "
                             "on (kv_prune_when = pressure) with a KV cache below the streams' full need")
    parser.add_argument("--model", default=None, help="model folder or GGUF (default: the default model)")
    parser.add_argument("--pressure-runs", default="off,mace,window", help="pruning settings to compare")
    parser.add_argument("--pressure-policy", default="mace", help="scheduling policy of the memory-pressure runs")
    parser.add_argument("--pressure-streams", type=int, default=8)
    parser.add_argument("--pressure-tokens", type=int, default=192, help="tokens each stream generates")
    parser.add_argument("--pressure-span", type=float, default=3.0, help="seconds over which the streams arrive")
    parser.add_argument("--pressure-drain", type=float, default=300.0,
                        help="most seconds after the arrivals a run may take to answer every stream")
    parser.add_argument("--kv-fraction", type=float, default=0.35,
                        help="KV cache as a share of what every stream's full KV needs")
    parser.add_argument("--prune-capacity", type=int, default=64, help="kv_prune_capacity of the pruned runs")
    parser.add_argument("--iteration-log", default=None,
                        help="also write every run's per-iteration record (bin contents, planned vs wall "
                             "seconds, queue lengths) to this JSON file")
    args = parser.parse_args(argv)
    if args.scenario == "memory-pressure":
        if args.out == str(RESULTS / "bench_coserve"):
            args.out = str(RESULTS / "bench_coserve_pressure")
        memory_pressure(args)
        return
    trace_path = TRACES / "coserve.json"
    if args.record:
        trace = record_trace(trace_path)
        print(f"wrote {trace_path} ({len(trace['requests'])} requests)")
        return
    if args.quick:
        args.loads, args.retrain_rates, args.window, args.drain = "1", str(args.main_rate), 20.0, 3.0
    trace = json.loads(trace_path.read_text())
    prompts = json.loads((TRACES / "prompts.json").read_text())
    policies = [p for p in args.policies.split(",") if p]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        parser.error(f"unknown policies: {sorted(unknown)}")
    loads = [float(x) for x in args.loads.split(",")]
    rates = [float(x) for x in args.retrain_rates.split(",")]

    mean_tokens = statistics.mean(r["max_tokens"] for r in trace["requests"])
    ctx = prepare(args, prompts, mean_tokens)
    unloaded, calibration_others = ctx["unloaded"], ctx["calibration_others"]

    points = [(x, args.main_rate) for x in loads]
    points += [(args.main_load, r) for r in rates if (args.main_load, r) not in points]
    runs: dict[tuple[str, float, float], RunResult] = {}
    loadavgs = []
    for i, (load, rate) in enumerate(points):
        order = policies[i % len(policies):] + policies[: i % len(policies)]  # spread machine noise
        for policy in order:
            run = run_policy(policy, load, rate, trace, ctx, args.window, args.drain, args.checkpoints)
            runs[(policy, load, rate)] = run
            loadavgs.append(run.loadavg[0])
            s = summarise(run, unloaded, args.ttft_factor)
            print(f"load {load:g} rate {rate:g} {policy:12s} SLO {s['slo_attainment']:.0%} "
                  f"(TTFT-SLO {s['ttft_slo_attainment']:.0%}) TTFT p50 {fmt(s['ttft_p50_s'])} s "
                  f"TBT p50 {fmt(s['tbt_p50_s'], 1000, 0)} ms tok/s {s['tokens_per_s']:.1f} "
                  f"pairs {s['pairs_done']}/{s['pairs_offered']} sched {fmt(s['sched_overhead_mean_ms'])} ms "
                  f"load avg {run.loadavg[0]:.1f} others {run.others_cores:.2f} cores", flush=True)

    if args.iteration_log:
        Path(args.iteration_log).parent.mkdir(parents=True, exist_ok=True)
        Path(args.iteration_log).write_text(json.dumps(
            [{"policy": p, "load": x, "retrain_rate": r, "iterations": run.trace, "requests": run.requests}
             for (p, x, r), run in runs.items()]))
        print(f"wrote {args.iteration_log}", flush=True)
    t_eval = time.monotonic()
    sweep_runs = [run for (p, x, r), run in runs.items() if r == args.main_rate]
    evaluate_alignment(sweep_runs, ctx)
    base_loss = ctx["alignment_base"]["dpo_loss"]
    print(f"alignment evaluation {time.monotonic() - t_eval:.0f} s", flush=True)

    def rows_for(keys: list[tuple[float, float]]) -> list[dict[str, Any]]:
        rows = []
        for load, rate in keys:
            for policy in policies:
                run = runs[(policy, load, rate)]
                row = summarise(run, unloaded, args.ttft_factor)
                if rate == args.main_rate:
                    row["alignment"] = alignment_summary(run, base_loss)
                rows.append(row)
        return rows

    out: dict[str, Any] = {
        "machine": f"{platform_line()}, torch {torch.__version__}, "
                   f"{args.threads} torch thread(s)",
        "model": ctx["name"], "dtype": str(ctx["model"].dtype).removeprefix("torch."),
        "window_s": args.window, "drain_s": args.drain, "ttft_factor": args.ttft_factor, "tbt_factor": args.tbt_factor,
        "unloaded": asdict(unloaded), "policies": policies,
        "policy_params": {p: POLICIES[p]().describe() for p in policies},
        "dpo": {"window_tokens": DPO.window_tokens, "layers_per_group": DPO.layers_per_group,
                "learning_rate": DPO.optimizer.learning_rate, "lora_rank": LORA.rank},
        "load_sweep": rows_for([(x, args.main_rate) for x in loads]),
        "retrain_sweep": rows_for([(args.main_load, r) for r in rates]),
        "alignment_base": ctx["alignment_base"],
        "loadavg_min": min(loadavgs), "loadavg_max": max(loadavgs),
        "calibration_other_processes_cores": round(calibration_others, 3),
        "other_processes_cores_max": max(run.others_cores for run in runs.values()),
    }
    out["bar"] = evaluate_bar(out)
    overhead = RESULTS / "bench_scheduler.json"
    if overhead.is_file():
        data = json.loads(overhead.read_text())
        out["scheduler_overhead_note"] = data.get("summary", "")
    prefix = Path(args.out)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    alignment_by = {(r["policy"], r["load"]): r.get("alignment", {}) for r in out["load_sweep"]}
    out["plots"] = plot(out, alignment_by, prefix)
    write_json(f"{prefix}.json", out, default=float)
    write_report(out, Path(f"{prefix}.md"))
    print("\n".join(out["bar"]["lines"]))
    print(f"wrote {prefix}.json, {prefix}.md and {len(out['plots'])} plots")


if __name__ == "__main__":
    main()
