#!/usr/bin/env python3
"""Decode KV cache pruning on the default model: quality and memory at KV budgets, MACE's
norm-guided per-head pruning beside a sliding window with sinks (StreamingLLM) and H2O.

    python tools/bench_kv_pruning.py [--tokens 1000] [--budgets 1,0.75,0.5,0.25]
                                     [--methods mace,window,h2o] [--sinks 4] [--window 0] [--tau 0] [--prompts 2]

Two long chat prompts (tools/data/perplexity.txt, to continue; docs/scheduler.md's opening, to
explain) decode `--tokens` tokens greedily, together in one batch (the engine's output does not
depend on the batch), EOS ignored. A budget is a share of each sequence's final context
(prompt + tokens): every KV head keeps on average that many positions (kv_prune_capacity), so
the retained keys/values peak at the budget's share of the unpruned ones. Per method and budget:
- perplexity of each generated continuation under the unpruned model (a forward over it after
  the prompt's keys/values, computed once per prompt);
- greedy agreement with the unpruned decoding: the share of positions with the same token, and
  the first position where they differ (after it the histories differ);
- TBT: median and p90 of the decode iterations' wall time, each method alone (one stream per prompt);
- peak KV bytes: the most (head, position) entries retained at once x bytes per entry, per
  sequence;
- peak held KV bytes: the most paged blocks the sequence's table held at once x bytes per block:
  what the pool and the ledger count once compaction (edge_runtime.kv.compaction) has packed the
  retained entries (prompt blocks a pruned copy shares with the unpruned one count for both).
Budget 1.0 runs MACE only: every method then keeps everything (tests/engine/test_kv_pruning.py
shows it bit-identical), so it measures the bookkeeping's cost. Writes
tools/results/bench_kv_pruning.{json,md,png}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from edge_runtime import Engine, SamplingParams  # noqa: E402
from edge_runtime.kv.cache import bytes_per_block  # noqa: E402
from edge_runtime.kv.pruning import HeadPruning, PruningSettings  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "tools" / "results"


def prompts() -> list[list[dict[str, str]]]:
    story = (ROOT / "tools" / "data" / "perplexity.txt").read_text()
    design = (ROOT / "docs" / "scheduler.md").read_text()[:2500]
    return [
        [{"role": "user", "content": f"{story}\n\nContinue this story for many more pages, in the same style."}],
        [{"role": "user", "content": f"{design}\n\nExplain this design in detail, part by part, with examples."}],
    ]


def decode(engine: Engine, prompt_ids: list[list[int]], tokens: int,
           configs: list[tuple[str, float]], settings: PruningSettings) -> list[dict[str, Any]]:
    """Greedy-decode every prompt under every (method, budget) config, all in one batch: the
    unpruned sequences first, through their prefill, so every other copy of a prompt takes its
    blocks from the prefix cache. Each pruned sequence keeps on average budget x (its prompt +
    tokens) positions per KV head. Returns per config: ids per prompt, peak KV bytes per prompt,
    and the decode iterations' wall times."""
    cfg = engine.model.cfg
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    runs: list[tuple[int, Any]] = []  # (config index, sequence)

    def add(index: int) -> None:
        method, budget = configs[index]
        for ids in prompt_ids:
            rid = engine.add_request(list(ids), params)
            seq = engine.requests[rid].seqs[0]
            if method != "unpruned":
                capacity = max(1, round(budget * (len(ids) + tokens)))
                seq.kv_pruning = HeadPruning(dataclasses.replace(settings, policy=method, capacity=capacity),
                                             cfg.num_layers, cfg.num_kv_heads, engine.model.device)
            runs.append((index, seq))

    outputs: dict[str, Any] = {}
    peak = [0] * len(prompt_ids) * len(configs)
    held = [0] * len(peak)
    step_s: list[float] = []

    def step() -> None:
        start = time.perf_counter()
        for out in engine.step():
            outputs[out.request_id] = out
        if all(s.num_computed >= s.num_prompt for _, s in runs):
            step_s.append(time.perf_counter() - start)
            if len(step_s) % 100 == 0:
                print(f"{len(step_s)} decode iterations, median {statistics.median(step_s) * 1000:.0f} ms",
                      flush=True)
        for j, (_, s) in enumerate(runs):
            held[j] = max(held[j], len(s.block_table))
            if s.kv_pruning is not None:
                peak[j] = max(peak[j], s.kv_pruning.retained_entries)

    add(0)  # configs[0] is unpruned
    while any(s.num_computed < s.num_prompt for _, s in runs):
        step()
    for index in range(1, len(configs)):
        add(index)
    while engine.has_unfinished():
        step()
    elem = torch.empty((), dtype=engine.model.dtype).element_size()
    entry = 2 * cfg.head_dim * elem  # one (layer, KV head, position)'s key and value
    per_block = bytes_per_block(cfg, engine.pool.block_size, engine.model.dtype)
    results = [{"ids": [], "peak_kv_bytes": [], "full_kv_bytes": [], "peak_held_kv_bytes": [],
                "tbt_ms": [t * 1000 for t in step_s]} for _ in configs]
    for j, (index, s) in enumerate(runs):
        full = (s.num_tokens - 1) * cfg.num_layers * cfg.num_kv_heads  # the last token is never fed
        r = results[index]
        r["ids"].append(outputs[s.request.request_id].token_ids)
        r["peak_kv_bytes"].append((peak[j] if s.kv_pruning is not None else full) * entry)
        r["full_kv_bytes"].append(full * entry)
        r["peak_held_kv_bytes"].append(held[j] * per_block)
    return results


class _PromptKV:
    """Causal attention that keeps the prompt's keys/values per layer (first pass) and lets a
    continuation attend to them (later passes): every continuation of a prompt is scored
    without recomputing the prompt."""

    lora = None

    def __init__(self, past: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        self.past = past
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.past is None:
            self.kv.append((k, v))
        else:
            k, v = torch.cat([self.past[layer][0], k]), torch.cat([self.past[layer][1], v])
        t, keys = q.shape[0], k.shape[0]
        mask = torch.ones(t, keys, dtype=torch.bool, device=q.device).tril(keys - t)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
            enable_gqa=True)
        return out[0].transpose(0, 1).reshape(t, -1)


@torch.inference_mode()
def prompt_state(engine: Engine, prompt: list[int]) -> tuple[Any, torch.Tensor]:
    """The unpruned model's keys/values over the prompt, and its logits for the first new token."""
    model = engine.model
    keep = _PromptKV()
    ids = torch.tensor(prompt, device=model.device)
    hidden = model.run_layers(model.embed_tokens(ids), torch.arange(len(prompt), device=model.device), keep)
    return keep.kv, model.logits(hidden[-1:]).float()


@torch.inference_mode()
def perplexity(engine: Engine, prompt: tuple[Any, torch.Tensor], prompt_len: int, continuation: list[int]) -> float:
    """exp(mean NLL) of `continuation` after the prompt, under the unpruned model."""
    model = engine.model
    kv, first = prompt
    ids = torch.tensor(continuation[:-1], device=model.device)
    positions = torch.arange(prompt_len, prompt_len + len(ids), device=model.device)
    hidden = model.run_layers(model.embed_tokens(ids), positions, _PromptKV(kv))
    logits = torch.cat([first, model.logits(hidden).float()])
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(continuation, device=logits.device))
    return float(torch.exp(nll))


def agreement(ids: list[int], reference: list[int]) -> tuple[float, int]:
    same = [a == b for a, b in zip(ids, reference, strict=True)]
    first = next((i for i, s in enumerate(same) if not s), len(same))
    return sum(same) / len(same), first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--budgets", default="1,0.75,0.5,0.25")
    ap.add_argument("--methods", default="mace,window,h2o")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=0, help="MACE's W (0 = no idle rule)")
    ap.add_argument("--tau", type=float, default=0.0, help="MACE's norm threshold (0 = no norm rule)")
    ap.add_argument("--prompts", type=int, default=2, help="how many of the two prompts (1: the story)")
    ap.add_argument("--tbt-tokens", type=int, default=64)
    ap.add_argument("--tbt-budget", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared machine's spin-waits "
                    "made 2 threads ~10x slower per step, measured)")
    ap.add_argument("--out", default="bench_kv_pruning")
    args = ap.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    methods = args.methods.split(",")
    load_start = [round(x, 2) for x in os.getloadavg()]
    began = time.time()

    engine = Engine.load(num_threads=args.threads, kv_cache_bytes=2 << 30, kv_cache_max_bytes=2 << 30,
                         max_num_seqs=64)
    settings = PruningSettings("mace", capacity=1, window=args.window, norm_threshold=args.tau, sinks=args.sinks)
    prompt_ids = [engine.tokenizer.encode_prompt(p)[1] for p in prompts()[: args.prompts]]
    configs = [("unpruned", 1.0)] + [(m, b) for m in methods for b in budgets if b < 1.0 or m == "mace"]
    quality = decode(engine, prompt_ids, args.tokens, configs, settings)
    print(f"decoded {len(configs)} configs in {time.time() - began:.0f} s", flush=True)

    reference = quality[0]
    states = [prompt_state(engine, p) for p in prompt_ids]
    rows = []
    for config, run in zip(configs, quality, strict=True):
        rows.append({"method": config[0], "budget": config[1], **summarise(engine, prompt_ids, states, run, reference)})
        print(json.dumps(rows[-1]), flush=True)
    # TBT: each method alone (one stream per prompt), its budget a share of prompt + tbt_tokens so that it
    # prunes from the first step.
    timed = [("unpruned", 1.0), ("mace", 1.0)] + [(m, args.tbt_budget) for m in methods]
    tbt = {c: decode(engine, prompt_ids, args.tbt_tokens, [c], settings)[0]["tbt_ms"] for c in timed}
    tbt_rows = []
    for (method, budget), times in tbt.items():
        times = sorted(times)
        tbt_rows.append({"method": method, "budget": budget, "steps": len(times),
                         "tbt_ms_median": round(statistics.median(times), 2),
                         "tbt_ms_p90": round(times[int(0.9 * (len(times) - 1))], 2)})

    result = {
        "model": engine.model_name, "dtype": str(engine.model.dtype), "tokens": args.tokens,
        "prompt_tokens": [len(p) for p in prompt_ids], "sinks": args.sinks, "mace_window": args.window,
        "mace_tau": args.tau, "threads": torch.get_num_threads(), "machine": platform.machine(),
        "cpus": os.cpu_count(), "load_average": {"start": load_start,
                                                 "end": [round(x, 2) for x in os.getloadavg()]},
        "batch_decode_ms_median": round(statistics.median(quality[0]["tbt_ms"]), 1),
        "tbt_tokens": args.tbt_tokens, "wall_s": round(time.time() - began, 1), "rows": rows, "tbt": tbt_rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / f"{args.out}.md").write_text(markdown(result))
    plot(result, RESULTS / f"{args.out}.png")


def summarise(base: Engine, prompt_ids: list[list[int]], prompt_states: list[Any], run: dict[str, Any],
              reference: dict[str, Any]) -> dict[str, Any]:
    ppl = [perplexity(base, state, len(p), ids)
           for state, p, ids in zip(prompt_states, prompt_ids, run["ids"], strict=True)]
    agree = [agreement(ids, ref) for ids, ref in zip(run["ids"], reference["ids"], strict=True)]
    return {
        "perplexity": [round(p, 3) for p in ppl],
        "mean_perplexity": round(statistics.mean(ppl), 3),
        "agreement": [round(a, 4) for a, _ in agree],
        "mean_agreement": round(statistics.mean(a for a, _ in agree), 4),
        "first_divergence": [f for _, f in agree],
        "peak_kv_bytes": run["peak_kv_bytes"],
        "peak_kv_share": round(sum(run["peak_kv_bytes"]) / sum(run["full_kv_bytes"]), 4),
        "peak_held_kv_bytes": run["peak_held_kv_bytes"],
        "peak_held_kv_share": round(sum(run["peak_held_kv_bytes"]) / sum(reference["peak_held_kv_bytes"]), 4),
    }


def markdown(r: dict[str, Any]) -> str:
    lines = [
        "# Decode KV cache pruning (tools/bench_kv_pruning.py)", "",
        f"{r['model']} ({r['dtype']}), {r['machine']}, {r['threads']} torch threads on {r['cpus']} shared "
        f"cores; load average {r['load_average']['start']} at start, {r['load_average']['end']} at end; "
        f"{r['wall_s']} s in all.",
        f"{len(r['prompt_tokens'])} chat prompt(s) of {r['prompt_tokens']} tokens, {r['tokens']} greedy tokens each (EOS ignored), "
        f"decoded together. Sinks: {r['sinks']}; MACE W = {r['mace_window'] or 'off'}, "
        f"tau = {r['mace_tau'] or 'off'}. Budget = share of the final context each KV head keeps on "
        "average. Perplexity: of the generated continuation under the unpruned model. Agreement: share "
        "of positions equal to the unpruned greedy tokens; first divergence per prompt. Peak KV: the most "
        "retained (head, position) keys+values at once, share of the unpruned peak. Held KV: the most "
        "paged blocks a sequence held at once (compacted), share of the unpruned sequence's.", "",
        "| method | budget | perplexity (mean; per prompt) | agreement (mean; per prompt) | first divergence "
        "| peak KV MiB (share of unpruned) | peak held KV MiB (share) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        kv = sum(row["peak_kv_bytes"]) / 2**20
        lines.append(
            f"| {row['method']} | {row['budget']:.0%} | {row['mean_perplexity']} "
            f"({', '.join(map(str, row['perplexity']))}) "
            f"| {row['mean_agreement']:.3f} ({', '.join(f'{a:.3f}' for a in row['agreement'])}) "
            f"| {', '.join(map(str, row['first_divergence']))} | {kv:.1f} ({row['peak_kv_share']:.0%}) "
            f"| {sum(row['peak_held_kv_bytes']) / 2**20:.1f} ({row['peak_held_kv_share']:.0%}) |")
    lines += [
        "", f"All {len(r['rows'])} configurations decoded in one batch ({len(r['prompt_tokens']) * len(r['rows'])} sequences; "
        f"median iteration {r['batch_decode_ms_median']} ms).", "",
        f"TBT: each method alone (one stream per prompt), {r['tbt_tokens']} decode steps, its "
        "budget a share of prompt + those steps so it prunes from the first step:", "",
        "| method | budget | steps | TBT median ms | TBT p90 ms |", "|---|---|---|---|---|",
    ]
    for t in r["tbt"]:
        lines.append(f"| {t['method']} | {t['budget']:.0%} | {t['steps']} | {t['tbt_ms_median']} | {t['tbt_ms_p90']} |")
    lines += ["", "Pruning masks positions out of each head's attention and compaction gives the freed blocks "
              "back, but a pruned step still gathers a key per position (masked), as many as an unpruned "
              "one, so TBT shows the bookkeeping's cost, not a saving. TBT is noisy on a shared machine "
              "(see the load average).", ""]
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    unpruned = next(row for row in r["rows"] if row["method"] == "unpruned")
    for method in sorted({row["method"] for row in r["rows"]} - {"unpruned"}):
        pts = sorted([(1.0, unpruned)] + [(row["budget"], row) for row in r["rows"]
                                          if row["method"] == method and row["budget"] < 1.0],
                     key=lambda p: p[0])
        xs = [100 * b for b, _ in pts]
        axes[0].plot(xs, [row["mean_perplexity"] for _, row in pts], marker="o", label=method)
        axes[1].plot(xs, [row["mean_agreement"] for _, row in pts], marker="o", label=method)
    axes[0].set_ylabel("perplexity under the unpruned model (lower is better)")
    axes[1].set_ylabel("greedy agreement with unpruned")
    for ax in axes:
        ax.set_xlabel("KV budget (% of the final context)")
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{r['model']}: {r['tokens']} generated tokens x {len(r['prompt_tokens'])} prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
