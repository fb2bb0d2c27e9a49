"""Prompt-lookup speculative decoding on the default model, in-process: tokens/s with and without
speculation, the same prompts alternated in one run (so both see the same machine load), on an
editing/summarising workload (the prompt holds most of the answer) and on plain chat; acceptance
rate; whether the greedy outputs are identical. Modes: off, on (always draft), auto (the
request's acceptance turns it off: edge_runtime.spec.acceptance). Writes tools/results/bench_spec.{json,md}.

    python tools/bench_spec.py [--backends torch,onnxruntime,onnxruntime-deterministic] [--rounds 2] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge_runtime import Engine, SamplingParams  # noqa: E402
from tools.report import (  # noqa: E402
    RESULTS,
    load_average,
    markdown_table,
    platform_line,
    write_json,
    write_markdown,
)

PASSAGES = [
    "The river rises in the northern hills, where melting snow feeds a dozen small streams. It flows "
    "south through farmland for two hundred kilometres, passing three market towns and an old stone "
    "bridge built in 1740. Near the coast it widens into a marsh that shelters thousands of birds each "
    "winter, before it reaches the sea at the fishing port of Hallow Bay.",
    "Our support team answers emails within one working day. Orders placed before noon ship the same "
    "day; later orders ship the next morning. Returns are free within thirty days if the item is unused "
    "and in its original box. Refunds reach the original payment method within five working days of "
    "the return arriving at our warehouse.",
    "To reset the router, hold the small button on the back for ten seconds until the light blinks "
    "orange. Wait two minutes for it to restart. Connect to the network named in the sticker under the "
    "device, open the setup page in a browser, and choose a new password of at least twelve characters.",
]
EDITING = [f"Rewrite the following text, correcting any mistakes, and keep everything else the same:\n\n{p}"
           for p in PASSAGES[:2]] + [f"Summarise this text in a few sentences, reusing its wording:\n\n{PASSAGES[2]}"]
CHAT = ["What are three good habits for a healthy morning?", "Explain what a rainbow is to a child.",
        "Give me a short plan for learning to cook."]
WORKLOADS = {"editing": EDITING, "chat": CHAT}
MODES = ("off", "on", "auto")  # "auto": drafts until the request's acceptance says it does not pay
BACKENDS = {"torch": {"backend": "torch"}, "onnxruntime": {"backend": "onnxruntime", "onnx_quantization": "q4_1"},
            # Each decode row a two-row query of its own: decode rounds as the verify chunk (docs/onnx.md)
            "onnxruntime-deterministic": {"backend": "onnxruntime", "onnx_quantization": "q4_1", "deterministic": True}}


def run_one(engine: Engine, prompt: str, mode: str, max_tokens: int) -> dict[str, Any]:
    """One request alone (one stream): its wall time, tokens and the drafter's counts it added."""
    before = dict(engine.scheduler.drafter.stats())
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, speculation=mode)
    started = time.perf_counter()
    out = engine.generate([[{"role": "user", "content": prompt}]], params)[0]
    wall = time.perf_counter() - started
    after = engine.scheduler.drafter.stats()
    cand = out.candidates[0]
    return {"mode": mode, "tokens": len(cand.token_ids), "wall_s": wall, "token_ids": cand.token_ids,
            "ttft_s": (out.metrics.first_token_time - out.metrics.arrival_time) if out.metrics else None,
            "drafted": after["drafted"] - before["drafted"], "accepted": after["accepted"] - before["accepted"],
            "verifies": after["verifies"] - before["verifies"]}


def bench_backend(name: str, rounds: int, max_tokens: int) -> dict[str, Any]:
    started = time.perf_counter()
    engine = Engine.load(None, dtype="float32", cost_profile="off", speculation="on", **BACKENDS[name])
    print(f"{name}: loaded in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    run_one(engine, CHAT[0], "off", 4)  # warm-up: graphs, allocations
    runs: list[dict[str, Any]] = []
    loads = [load_average()]
    for r in range(rounds):
        for workload, prompts in WORKLOADS.items():
            for i, prompt in enumerate(prompts):
                # Rotate which mode goes first, so a load swing does not favour one side.
                for mode in MODES[(r + i) % 3:] + MODES[: (r + i) % 3]:
                    run = run_one(engine, prompt, mode, max_tokens)
                    print(f"{name} round {r} {workload} #{i} {mode}: {run['tokens']} tokens in {run['wall_s']:.2f} s, "
                          f"{run['accepted']}/{run['drafted']} accepted", file=sys.stderr, flush=True)
                    runs.append({"round": r, "workload": workload, "prompt": i, **run})
        loads.append(load_average())
    summary = {}
    for workload in WORKLOADS:
        sides = {}
        for mode in MODES:
            mine = [x for x in runs if x["workload"] == workload and x["mode"] == mode]
            tokens, wall = sum(x["tokens"] for x in mine), sum(x["wall_s"] for x in mine)
            drafted, accepted = sum(x["drafted"] for x in mine), sum(x["accepted"] for x in mine)
            sides[mode] = {"tokens": tokens, "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 2),
                           "drafted": drafted, "accepted": accepted, "verifies": sum(x["verifies"] for x in mine),
                           "acceptance": round(accepted / drafted, 3) if drafted else None}
        pairs = {(x["round"], x["prompt"]): [] for x in runs if x["workload"] == workload}
        for x in runs:
            if x["workload"] == workload and x["mode"] != "auto":
                pairs[(x["round"], x["prompt"])].append(x["token_ids"])
        identical = sum(len(v) == 2 and v[0] == v[1] for v in pairs.values())
        # Where a pair parted: the first token index that differs (rounding, #31: docs/speculative.md)
        parted = sorted(next((j for j, (a, b) in enumerate(zip(*v, strict=False)) if a != b), min(map(len, v)))
                        for v in pairs.values() if len(v) == 2 and v[0] != v[1])
        summary[workload] = {**sides, "speedup": round(sides["on"]["tok_s"] / sides["off"]["tok_s"], 3),
                             "speedup_auto": round(sides["auto"]["tok_s"] / sides["off"]["tok_s"], 3),
                             "identical_greedy": f"{identical}/{len(pairs)}", "parted_at": parted}
    for x in runs:
        x.pop("token_ids")
    return {"backend": name, "summary": summary, "runs": runs, "load": loads,
            "deterministic": engine.stats()["deterministic"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="torch,onnxruntime")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(RESULTS / "bench_spec"))
    args = parser.parse_args()
    results = {"platform": platform_line(), "max_tokens": args.max_tokens, "rounds": args.rounds,
               "speculative_tokens": 4, "model": "default (SmolLM2-135M-Instruct), float32 / q4_1 on ONNX Runtime",
               "backends": [bench_backend(b, args.rounds, args.max_tokens) for b in args.backends.split(",")]}
    write_json(args.out + ".json", results)
    rows = []
    for b in results["backends"]:
        for workload, s in b["summary"].items():
            rows.append([b["backend"], workload, s["off"]["tok_s"], s["on"]["tok_s"], f"{s['speedup']:.2f}x",
                         s["auto"]["tok_s"], f"{s['speedup_auto']:.2f}x",
                         s["on"]["acceptance"], f"{s['on']['accepted']}/{s['on']['drafted']}",
                         s["identical_greedy"] + (f" (parted at token {s['parted_at']})" if s["parted_at"] else "")])
    lines = ["# Prompt-lookup speculative decoding (tools/bench_spec.py)", "",
             f"{results['platform']}; default model, one stream, greedy, max_tokens {args.max_tokens}, "
             f"{args.rounds} rounds, modes alternated per prompt; k = 4 draft tokens, n-grams 3..1.", ""]
    lines += markdown_table(["backend", "workload", "tok/s off", "tok/s on", "speed-up on", "tok/s auto",
                             "speed-up auto", "acceptance (on)", "accepted/drafted (on)", "identical greedy (on/off)"],
                            rows, "llrrrrrrrl")
    lines += ["", "Load average (1, 5, 15 min) per round: " + "; ".join(
        f"{b['backend']}: " + ", ".join(str(x) for x in b["load"]) for b in results["backends"]), ""]
    write_markdown(args.out + ".md", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
