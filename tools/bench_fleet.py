"""What serving the fleet adapter beneath each user's costs per decode step, on the default model.

The engine serves fleet + user as one LoRA of the two ranks concatenated (rank r_f + r_u, see
docs/architecture.md). This times decode steps with S streams, every stream its own user, for:
the base model alone; each user's rank-8 adapter alone (what a fleet merged into a copy of the
base weights would cost per step: the merged copy is read like the base); the fleet alone
(rank 8, rows of users without an adapter); and fleet + user (rank 16). It also reports what
the merge alternative holds: a second copy of the base linear weights (torch and, with ONNX
Runtime, a second exported graph, whose weights are baked in) per fleet version in use, and
the time to merge a fleet into the torch copy. Median ms per decode step (best of
interleaved rounds), one thread.
Writes tools/results/bench_fleet.{json,md}.

    flock /tmp/mace-bench.lock .venv/bin/python tools/bench_fleet.py [--backends torch,onnxruntime] [--streams 1,8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from edge_runtime import Engine, SamplingParams  # noqa: E402
from edge_runtime.lora import BatchedLoraApplier, LoraSettings, LoraWeights  # noqa: E402
from edge_runtime.lora.weights import SummedLora, concat_ranks, projection_shape  # noqa: E402
from edge_runtime.model.source import resolve_model  # noqa: E402

LINEARS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
CONFIGS = ("base", "user r8", "fleet r8", "fleet + user r8+8")


def random_adapter(engine: Engine, seed: int) -> LoraWeights:
    weights = LoraWeights.init(engine.model.cfg, LoraSettings(), seed=seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    for b in weights.b.values():
        b.copy_(torch.randn(b.shape, generator=gen) * 0.01)
    return weights


def step_ms(engine: Engine, streams: int, config: str, steps: int) -> float:
    """Median wall time of `steps` decode steps once every stream has its first token."""
    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True)
    with_user = config in ("user r8", "fleet + user r8+8")
    with_fleet = config.startswith("fleet")
    for i in range(streams):
        engine.add_request(f"Tell me a short story about the number {i}.", params,
                           adapter=f"user{i}" if with_user else None, fleet=with_fleet)
    while any(not s.output_ids for r in engine.requests.values() for s in r.seqs):
        engine.step()
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:-1])


def lora_part_ms(engine: Engine, users: list[LoraWeights], fleet: LoraWeights, repeats: int) -> dict:
    """The LoRA share of one decode step alone, as the torch backend computes it: every layer's
    targeted projections for one row per user (one group per user, as in serving), with each
    user's adapter alone, fleet + user concatenated (what is served), or as two stacks (the
    fleet over all rows as one group plus the users' groups, summed)."""
    cfg = engine.model.cfg
    n = len(users)
    xs = {t: torch.randn(n, projection_shape(cfg, t)[0]) for t in fleet.settings.target_modules}
    appliers = {
        "user r8": BatchedLoraApplier.from_rows([(u, 1) for u in users]),
        "fleet + user r8+8": BatchedLoraApplier.from_rows([(concat_ranks([fleet, u]), 1) for u in users]),
        "two stacks r8, r8": SummedLora(BatchedLoraApplier.from_rows([(fleet, n)]),
                                        BatchedLoraApplier.from_rows([(u, 1) for u in users])),
    }
    out = {}
    with torch.inference_mode():
        for name, applier in appliers.items():
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                for _ in range(repeats):
                    for layer in range(cfg.num_layers):
                        for target, x in xs.items():
                            applier.delta(layer, target, x)
                best = min(best, (time.perf_counter() - start) / repeats)
            out[name] = round(1000 * best, 3)
    return out


def merge_cost(engine: Engine, fleet: LoraWeights) -> dict:
    model = engine.model
    weight_bytes = sum(getattr(layer, name).numel() * getattr(layer, name).element_size()
                       for layer in model.layers for name in LINEARS)
    copy = {id(layer): {n: getattr(layer, n).detach().clone() for n in LINEARS} for layer in model.layers}
    start = time.perf_counter()
    for (layer, target), a in fleet.a.items():
        delta = fleet.settings.scale * fleet.b[(layer, target)] @ a
        w = copy[id(model.layers[layer])]
        # q/k/v share the fused weight: rows of each projection in qkv order.
        if target in ("q_proj", "k_proj", "v_proj"):
            cfg = model.cfg
            offset = {"q_proj": 0, "k_proj": cfg.q_size, "v_proj": cfg.q_size + cfg.kv_size}[target]
            w["qkv_weight"][offset: offset + delta.shape[0]] += delta
        elif target == "o_proj":
            w["o_weight"] += delta
    merge_s = time.perf_counter() - start
    # The graph without LoRA inputs: the one a merged base would need a second export of.
    sessions = getattr(engine.backend, "_sessions", {})
    graph_bytes = sessions[False].weights_bytes if False in sessions else 0
    return {"linear_weight_bytes": weight_bytes, "merge_s": merge_s, "graph_bytes": int(graph_bytes)}


def run_backend(model_dir: Path, backend: str, streams: list[int], steps: int, threads: int, rounds: int) -> dict:
    extra = {"backend": backend}
    if backend == "onnxruntime":
        extra["onnx_quantization"] = "q4_1"  # what backend = "auto" serves on a CPU (docs/daemon.md)
    engine = Engine.load(str(model_dir), dtype="float32", kv_cache_bytes=256 << 20, num_threads=threads, **extra)
    for i in range(max(streams)):
        engine.publish_adapter(f"user{i}", random_adapter(engine, seed=100 + i))
    fleet = random_adapter(engine, seed=7)
    engine.publish_fleet(fleet)
    engine.generate("Warm up.", SamplingParams(max_tokens=4, ignore_eos=True))
    rows = []
    for s in streams:
        for config in CONFIGS:
            step_ms(engine, s, config, 4)  # warm: adapters stacked, graphs opened
        # Rounds interleave the configurations, so a drift in the machine's load hits them all.
        best = {c: step_ms(engine, s, c, steps) for c in CONFIGS}
        for _ in range(rounds - 1):
            for c in CONFIGS:
                best[c] = min(best[c], step_ms(engine, s, c, steps))
        for config in CONFIGS:
            rows.append({"streams": s, "config": config, "ms_per_step": round(best[config], 2)})
            print(backend, s, config, round(best[config], 2), flush=True)
    users = [engine.adapters.weights(engine.adapters.newest(f"user{i}")) for i in range(max(streams))]
    lora = {s: lora_part_ms(engine, users[:s], fleet, repeats=20) for s in streams} if backend == "torch" else {}
    return {"backend": engine.backend.name, "rows": rows, "merge": merge_cost(engine, fleet), "lora_part_ms": lora}


def write_table(result: dict, path: Path) -> None:
    lines = ["# Fleet adapter beneath each user's: cost per decode step (bench_fleet)", "",
             f"{result['model']}, {result['threads']} thread(s), load average "
             f"{', '.join(f'{x:.2f}' for x in result['load_average'])}. Median ms per decode step, "
             "every stream its own user; rank 8 on q/k/v/o for the fleet and for each user; best of "
             f"{result['rounds']} interleaved rounds.", ""]
    for run in result["runs"]:
        streams = sorted({r["streams"] for r in run["rows"]})
        lines += [f"## {run['backend']}", "", "| served | " + " | ".join(f"{s} stream(s)" for s in streams) + " |",
                  "|---|" + "---:|" * len(streams)]
        for config in CONFIGS:
            cells = [next(r["ms_per_step"] for r in run["rows"] if r["streams"] == s and r["config"] == config)
                     for s in streams]
            lines.append(f"| {config} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
        if run["lora_part_ms"]:
            lines += ["", "The LoRA share of a step alone (torch applier, one group per user, ms):", "",
                      "| streams | user r8 | fleet + user concatenated r16 (served) | two stacks r8 + r8 |",
                      "|---:|---:|---:|---:|"]
            for s, part in run["lora_part_ms"].items():
                lines.append(f"| {s} | {part['user r8']:.2f} | {part['fleet + user r8+8']:.2f} | "
                             f"{part['two stacks r8, r8']:.2f} |")
        m = run["merge"]
        lines += ["", f"Merging the fleet into a copy of the base instead: +{m['linear_weight_bytes'] / 2**20:.1f} MiB "
                  f"of float32 linear weights per fleet version in use (merge {m['merge_s'] * 1000:.0f} ms)"
                  + (f", and a re-export per fleet version (+{m['graph_bytes'] / 2**20:.1f} MiB of graph weights, re-quantised "
                     "from the merged weights)" if m["graph_bytes"] else "")
                  + "; its rows then cost what 'user r8' (user rows) and 'base' (rows without a user) cost.", ""]
    path.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="torch,onnxruntime")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="best of this many interleaved rounds")
    ap.add_argument("--out", type=Path, default=REPO / "tools" / "results" / "bench_fleet.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    resolved = resolve_model(None)
    streams = [int(s) for s in args.streams.split(",")]
    runs = [run_backend(resolved.path, b, streams, args.steps, args.threads, args.rounds) for b in args.backends.split(",")]
    result = {"model": resolved.path.name, "threads": args.threads, "rounds": args.rounds, "load_average": list(os.getloadavg()),
              "runs": runs}
    args.out.write_text(json.dumps(result, indent=2))
    write_table(result, args.out.with_suffix(".md"))
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
