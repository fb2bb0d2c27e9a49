#!/usr/bin/env python3
"""Host work per decode step of the ONNX Runtime backend (int4, dense KV layout, default model):
wall time of `engine.step()` minus the graph run it contains, at 1 and N streams, with the
backend's steady-decode shortcut on and off (off = every step through the general planner and
the indexed copy to the paged cache, as before the shortcut), alternating rounds in one
process so the machine's drift hits both alike. Also splits the shortcut's steps into parts.

    .venv/bin/python tools/bench_onnx_host.py [--streams 1,16] [--rounds 4] [--tokens 100]

Writes tools/results/bench_onnx_host.{json,md}. Run it alone (e.g. under the benchmark lock):
the graph run is measured, the host share is what is left of each step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import edge_runtime.backends.dense_kv as dense_kv  # noqa: E402
from edge_runtime import Engine, SamplingParams  # noqa: E402
from tools.bench_engine import machine, story_prompts  # noqa: E402

RESULTS = ROOT / "tools" / "results"


class _TimedSession:
    """The ONNX Runtime session, with the time spent inside its runs added up."""

    def __init__(self, inner, acc: dict) -> None:
        self.inner, self.acc = inner, acc

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run_with_iobinding(self, binding) -> None:
        start = time.perf_counter()
        self.inner.run_with_iobinding(binding)
        self.acc["graph run"] += time.perf_counter() - start


def _timed(obj, name: str, label: str, acc: dict) -> None:
    inner = getattr(obj, name)

    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            acc[label] += time.perf_counter() - start

    setattr(obj, name, call)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--out", default=str(RESULTS / "bench_onnx_host.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine = Engine.load(None, kv_cache_bytes=256 << 20, num_threads=1, dtype="float32", backend="onnxruntime",
                         onnx_quantization="int4")
    backend = engine.backend
    engine.generate([{"role": "user", "content": "Warm up."}], SamplingParams(max_tokens=8, ignore_eos=True))
    acc: dict[str, float] = defaultdict(float)
    session = backend._session(lora=False)
    session.inference = _TimedSession(session.inference, acc)
    shortcut, per_token = backend._decode_step, dense_kv.PER_TOKEN_COPY_MAX
    modes = {"shortcut on": (shortcut, per_token), "shortcut off": (lambda items, refs: None, 0)}
    _timed(engine.scheduler, "schedule", "scheduler.schedule", acc)
    _timed(engine.scheduler, "commit_inference", "scheduler.commit_inference", acc)
    _timed(engine, "_commit_tokens", "engine._commit_tokens (sampling, detokenising, streaming)", acc)
    _timed(backend, "execute", "backend.execute", acc)
    _timed(backend.dense, "copy_to_cache", "dense.copy_to_cache", acc)
    result = {"machine": machine(), "tokens": args.tokens, "rounds": args.rounds,
              "load_average_at_start": os.getloadavg()[0], "runs": []}
    for streams in (int(s) for s in args.streams.split(",")):
        samples: dict[str, list[dict]] = defaultdict(list)
        for _ in range(args.rounds):
            for mode, (decode_step, copy_max) in modes.items():
                backend._decode_step, dense_kv.PER_TOKEN_COPY_MAX = decode_step, copy_max
                for prompt in story_prompts(streams):
                    engine.add_request(prompt, SamplingParams(max_tokens=args.tokens, ignore_eos=True))
                for _ in range(8):  # past the prefill
                    engine.step()
                acc.clear()
                steps, start = 0, time.perf_counter()
                while engine.has_unfinished():
                    engine.step()
                    steps += 1
                wall = time.perf_counter() - start
                parts = {k: v / steps * 1e6 for k, v in acc.items()}
                parts["host (step minus graph run)"] = (wall - acc["graph run"]) / steps * 1e6
                parts["step"] = wall / steps * 1e6
                samples[mode].append(parts)
        backend._decode_step, dense_kv.PER_TOKEN_COPY_MAX = shortcut, per_token
        for mode, rounds in samples.items():
            row = {"streams": streams, "mode": mode}
            for key in rounds[0]:
                row[key + " us"] = round(statistics.median(r[key] for r in rounds), 1)
            row["host us, every round"] = [round(r["host (step minus graph run)"], 1) for r in rounds]
            result["runs"].append(row)
            print(json.dumps(row), flush=True)
    result["load_average_at_end"] = os.getloadavg()[0]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    write_table(result, out.with_suffix(".md"))
    print(out.with_suffix(".md").read_text())


def write_table(result: dict, path: Path) -> None:
    m = result["machine"]
    lines = [
        f"ONNX Runtime int4, dense KV, default model, {result['tokens']} greedy tokens per stream, 1 thread, "
        f"{m['cores']} cores ({m['cpu']}); load average {result['load_average_at_start']:.1f} at start, "
        f"{result['load_average_at_end']:.1f} at end. Median of {result['rounds']} alternating rounds, "
        "microseconds per decode step (parts overlap: backend.execute contains the graph run and the copy).",
        "",
    ]
    keys = [k for k in result["runs"][0] if k.endswith(" us")]
    lines.append("| streams | mode | " + " | ".join(k.removesuffix(" us") for k in keys) + " |")
    lines.append("|---" * (len(keys) + 2) + "|")
    for r in result["runs"]:
        lines.append(f"| {r['streams']} | {r['mode']} | " + " | ".join(f"{r.get(k, float('nan')):.0f}" for k in keys) + " |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
