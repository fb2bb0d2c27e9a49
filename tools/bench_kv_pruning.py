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
- TBT: median and p90 of the decode iterations' wall time, each method alone (one stream per
  prompt), and in those runs the most KV blocks the pool had in use and the ledger's KV entry;
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
import math
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
from edge_runtime.chat import encode_prompt  # noqa: E402
from edge_runtime.kv.cache import bytes_per_block  # noqa: E402
from edge_runtime.kv.pruning import HeadPruning, PruningSettings  # noqa: E402
from edge_runtime.memory import MemoryKind  # noqa: E402
from tools.report import RESULTS, ROOT, load_average, pyplot, save_figure, write_json  # noqa: E402


def prompts(long: bool = False) -> list[list[dict[str, str]]]:
    """The two chat prompts, or (`long`) one long prompt: the design text's first 7,000 characters,
    then the story to continue (~2,300 tokens; a budget below the prompt prunes from the first step)."""
    story = (ROOT / "tools" / "data" / "perplexity.txt").read_text()
    if long:
        design = (ROOT / "docs" / "scheduler.md").read_text()[:7000]
        return [[{"role": "user", "content": f"{design}\n\n{story}\n\nForget the design notes above. Continue "
                  "this story for many more pages, in the same style."}]]
    design = (ROOT / "docs" / "scheduler.md").read_text()[:2500]
    return [
        [{"role": "user", "content": f"{story}\n\nContinue this story for many more pages, in the same style."}],
        [{"role": "user", "content": f"{design}\n\nExplain this design in detail, part by part, with examples."}],
    ]


def decode(engine: Engine, prompt_ids: list[list[int]], tokens: int,
           configs: list[tuple[str, float]], settings: PruningSettings,
           reference: list[list[int]] | None = None) -> list[dict[str, Any]]:
    """Greedy-decode every prompt under every (method, budget) config, all in one batch, after
    the prompts' prefill has gone through once (every copy of a prompt takes its blocks from the
    prefix cache). Each pruned sequence keeps on average budget x (its prompt + tokens) positions
    per KV head. Returns per config: ids per prompt, peak KV bytes per prompt, and the decode
    iterations' wall times.

    With `reference` (the unpruned greedy ids per prompt), each config also runs teacher-forced:
    a second copy is fed the reference tokens whatever it predicts, and at each step notes
    whether its own greedy choice is the reference token and that token's NLL ("forced" in the
    result: per prompt, the agreement and exp(mean NLL)). Free-running agreement stops meaning
    much after the first divergence (the histories differ); the forced one scores every step."""
    cfg = engine.model.cfg
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    runs: list[tuple[int, Any, list[int] | None]] = []  # (config index, sequence, forced tokens)
    forced_steps: dict[int, list[tuple[bool, float]]] = {}

    def add(index: int, forced: bool) -> None:
        method, budget = configs[index]
        for p, ids in enumerate(prompt_ids):
            rid = engine.add_request(list(ids), params)
            seq = engine.requests[rid].seqs[0]
            if method != "unpruned":
                capacity = max(1, round(budget * (len(ids) + tokens)))
                seq.kv_pruning = HeadPruning(dataclasses.replace(settings, policy=method, capacity=capacity),
                                             cfg.num_layers, cfg.num_kv_heads, engine.model.device)
            if forced:
                forced_steps[seq.seq_id] = []
            runs.append((index, seq, reference[p] if forced else None))

    commit = engine._commit_tokens

    def commit_forced(seqs: list[Any], logits: torch.Tensor) -> Any:
        rows = [(r, s) for r, s in enumerate(seqs) if s.seq_id in forced_steps]
        if rows:
            logits = logits.clone()
            for r, s in rows:
                ref = forced_tokens[s.seq_id][s.num_generated]
                logp = torch.log_softmax(logits[r].float(), -1)
                forced_steps[s.seq_id].append((int(logp.argmax()) == ref, -float(logp[ref])))
                logits[r] = float("-inf")
                logits[r, ref] = 0.0
        return commit(seqs, logits)

    outputs: dict[str, Any] = {}
    peak = [0] * len(prompt_ids) * len(configs) * (2 if reference is not None else 1)
    held = [0] * len(peak)
    layer_peak = [0] * len(peak)  # the most entries one layer retained at once (what compaction packs)
    pool_steps: list[tuple[int, int]] = []  # (blocks in use, the ledger's KV bytes) per decode iteration
    step_s: list[float] = []

    def step() -> None:
        start = time.perf_counter()
        for out in engine.step():
            outputs[out.request_id] = out
        if all(s.num_computed >= s.num_prompt for _, s, _ in runs):
            step_s.append(time.perf_counter() - start)
            pool_steps.append((engine.pool.num_used, engine.ledger.entries(MemoryKind.KV).get("blocks", 0)))
            if len(step_s) % 100 == 0:
                print(f"{len(step_s)} decode iterations, median {statistics.median(step_s) * 1000:.0f} ms",
                      flush=True)
        for j, (_, s, _) in enumerate(runs):
            held[j] = max(held[j], len(s.block_table))
            if s.kv_pruning is not None:
                peak[j] = max(peak[j], s.kv_pruning.retained_entries)
                per_layer = s.kv_pruning.retained[:, :, : s.kv_pruning.length].sum((1, 2))
                layer_peak[j] = max(layer_peak[j], int(per_layer.max()) if per_layer.numel() else 0)

    # The prompts' prefill once, alone, so that every config's copy hits the prefix cache.
    warm = [engine.add_request(list(ids), SamplingParams(max_tokens=1)) for ids in prompt_ids]
    while any(r in engine.requests for r in warm):
        engine.step()
    for index in range(len(configs)):
        add(index, forced=False)
        if reference is not None:
            add(index, forced=True)
    forced_tokens = {s.seq_id: ids for _, s, ids in runs if ids is not None}
    engine._commit_tokens = commit_forced
    try:
        while engine.has_unfinished():
            step()
    finally:
        del engine._commit_tokens
    elem = torch.empty((), dtype=engine.model.dtype).element_size()
    entry = 2 * cfg.head_dim * elem  # one (layer, KV head, position)'s key and value
    per_block = bytes_per_block(cfg, engine.pool.block_size, engine.model.dtype)
    # The last iteration ends the sequences (their blocks go back): the one before is the end's.
    end = pool_steps[-2] if len(pool_steps) > 1 else (0, 0)
    pool = {"blocks_peak": max((b for b, _ in pool_steps), default=0), "blocks_end": end[0],
            "ledger_kv_bytes_peak": max((k for _, k in pool_steps), default=0), "ledger_kv_bytes_end": end[1]}
    results = [{"ids": [], "peak_kv_bytes": [], "full_kv_bytes": [], "forced": [], "peak_held_kv_bytes": [],
                "layer_kv_share": [], "tbt_ms": [t * 1000 for t in step_s], "pool": pool} for _ in configs]
    for j, (index, s, ids) in enumerate(runs):
        r = results[index]
        if ids is not None:
            steps = forced_steps[s.seq_id]
            r["forced"].append({"agreement": sum(a for a, _ in steps) / len(steps),
                                "perplexity": math.exp(statistics.mean(nll for _, nll in steps))})
            continue
        full = (s.num_tokens - 1) * cfg.num_layers * cfg.num_kv_heads  # the last token is never fed
        r["ids"].append(outputs[s.request.request_id].token_ids)
        r["peak_kv_bytes"].append((peak[j] if s.kv_pruning is not None else full) * entry)
        r["full_kv_bytes"].append(full * entry)
        r["peak_held_kv_bytes"].append(held[j] * per_block)
        full_layer = (s.num_tokens - 1) * cfg.num_kv_heads
        r["layer_kv_share"].append(round(layer_peak[j] / full_layer, 4) if s.kv_pruning is not None else 1.0)
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
    ap.add_argument("--long", action="store_true", help="one long prompt (~2,300 tokens) instead of the two chat ones")
    ap.add_argument("--prompts", type=int, default=2, help="how many of the two prompts (1: the story)")
    ap.add_argument("--tbt-tokens", type=int, default=64)
    ap.add_argument("--tbt-budget", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared machine's spin-waits "
                    "made 2 threads ~10x slower per step, measured)")
    ap.add_argument("--out", default="bench_kv_pruning")
    args = ap.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    methods = args.methods.split(",")
    load_start = load_average()
    began = time.time()

    engine = Engine.load(num_threads=args.threads, kv_cache_bytes=2 << 30, kv_cache_max_bytes=2 << 30,
                         max_num_seqs=64)
    settings = PruningSettings("mace", capacity=1, window=args.window, norm_threshold=args.tau, sinks=args.sinks)
    prompt_ids = [encode_prompt(engine.tokenizer, p)[1] for p in prompts(args.long)[: args.prompts]]
    pruned = [(m, b) for m in methods for b in budgets if b < 1.0 or m == "mace"]
    configs = [("unpruned", 1.0)] + pruned
    reference = decode(engine, prompt_ids, args.tokens, configs[:1], settings)[0]
    quality = [reference] + decode(engine, prompt_ids, args.tokens, pruned, settings, reference["ids"])
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
    tbt = {c: decode(engine, prompt_ids, args.tbt_tokens, [c], settings)[0] for c in timed}
    tbt_rows = []
    for (method, budget), run in tbt.items():
        times = sorted(run["tbt_ms"])
        tbt_rows.append({"method": method, "budget": budget, "steps": len(times),
                         "tbt_ms_median": round(statistics.median(times), 2),
                         "tbt_ms_p90": round(times[int(0.9 * (len(times) - 1))], 2),
                         **{f"pool_{key}": value for key, value in run["pool"].items()}})

    result = {
        "model": engine.model_name, "dtype": str(engine.model.dtype), "tokens": args.tokens,
        "prompt_tokens": [len(p) for p in prompt_ids], "sinks": args.sinks, "mace_window": args.window,
        "mace_tau": args.tau, "threads": torch.get_num_threads(), "machine": platform.machine(),
        "cpus": os.cpu_count(), "load_average": {"start": load_start,
                                                 "end": load_average()},
        "batch_decode_ms_median": round(statistics.median(quality[0]["tbt_ms"]), 1),
        "tbt_tokens": args.tbt_tokens, "wall_s": round(time.time() - began, 1), "rows": rows, "tbt": tbt_rows,
    }
    write_json(RESULTS / f"{args.out}.json", result)
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
        "forced_agreement": [round(f["agreement"], 4) for f in run["forced"]] or [1.0] * len(ppl),
        "forced_perplexity": [round(f["perplexity"], 4) for f in run["forced"]] or [round(p, 4) for p in ppl],
        "peak_kv_bytes": run["peak_kv_bytes"],
        "peak_kv_share": round(sum(run["peak_kv_bytes"]) / sum(run["full_kv_bytes"]), 4),
        "peak_held_kv_bytes": run["peak_held_kv_bytes"],
        "peak_held_kv_share": round(sum(run["peak_held_kv_bytes"]) / sum(reference["peak_held_kv_bytes"]), 4),
        "largest_layer_kv_share": run["layer_kv_share"],
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
        "paged blocks a sequence held at once (compacted; prompt blocks shared with the unpruned copy "
        "count), share of the unpruned sequence's. Largest layer: the most entries one layer retained "
        "at once, share of a layer's final context (MACE shares its capacity across layers; "
        "compaction packs every layer's entries into the same blocks, so the sum sets the blocks).", "",
        "Forced: the same config fed the unpruned tokens (teacher forcing): the share of steps whose "
        "greedy choice is the unpruned token, and the perplexity of the unpruned continuation under "
        "the pruned cache; every step counts, not only those before a first divergence.", "",
        "| method | budget | forced agreement (per prompt) | forced perplexity (per prompt) "
        "| free agreement (mean; per prompt) | first divergence | perplexity under unpruned "
        "| peak KV MiB (share of unpruned) | peak held KV MiB (share) | largest layer |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        kv = sum(row["peak_kv_bytes"]) / 2**20
        lines.append(
            f"| {row['method']} | {row['budget']:.0%} "
            f"| {', '.join(f'{a:.3f}' for a in row['forced_agreement'])} "
            f"| {', '.join(f'{a:.3f}' for a in row['forced_perplexity'])} "
            f"| {row['mean_agreement']:.3f} ({', '.join(f'{a:.3f}' for a in row['agreement'])}) "
            f"| {', '.join(map(str, row['first_divergence']))} "
            f"| {row['mean_perplexity']} ({', '.join(map(str, row['perplexity']))}) "
            f"| {kv:.1f} ({row['peak_kv_share']:.0%}) "
            f"| {sum(row['peak_held_kv_bytes']) / 2**20:.1f} ({row['peak_held_kv_share']:.0%}) "
            f"| {', '.join(f'{x:.0%}' for x in row['largest_layer_kv_share'])} |")
    lines += [
        "", f"The unpruned reference decoded first ({len(r['prompt_tokens'])} sequences; median iteration "
        f"{r['batch_decode_ms_median']} ms), then the {len(r['rows']) - 1} pruned configurations, each free and "
        f"teacher-forced, in one batch ({2 * len(r['prompt_tokens']) * (len(r['rows']) - 1)} sequences).", "",
        f"TBT and memory: each method alone (one stream per prompt), {r['tbt_tokens']} decode steps, its "
        "budget a share of prompt + those steps so it prunes from the first step. Pool blocks: KV "
        "blocks in use over the decode steps, the most at once (the unpruned prefill's, before the "
        "first compaction) and at the last step; ledger KV: its KV entry at the last step.", "",
        "| method | budget | steps | TBT median ms | TBT p90 ms | pool blocks peak / end | ledger KV MiB end |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in r["tbt"]:
        lines.append(f"| {t['method']} | {t['budget']:.0%} | {t['steps']} | {t['tbt_ms_median']} | {t['tbt_ms_p90']} "
                     f"| {t['pool_blocks_peak']} / {t['pool_blocks_end']} | {t['pool_ledger_kv_bytes_end'] / 2**20:.1f} |")
    lines += ["", "Pruning masks positions out of each head's attention and compaction gives the freed blocks "
              "back, but a pruned step still gathers a key per position (masked), as many as an unpruned "
              "one, so TBT shows the bookkeeping's cost, not a saving. TBT is noisy on a shared machine "
              "(see the load average).", ""]
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    unpruned = next(row for row in r["rows"] if row["method"] == "unpruned")
    for method in sorted({row["method"] for row in r["rows"]} - {"unpruned"}):
        pts = sorted([(1.0, unpruned)] + [(row["budget"], row) for row in r["rows"]
                                          if row["method"] == method and row["budget"] < 1.0],
                     key=lambda p: p[0])
        xs = [100 * b for b, _ in pts]
        axes[0].plot(xs, [row["mean_perplexity"] for _, row in pts], marker="o", label=method)
        axes[1].plot(xs, [row["mean_agreement"] for _, row in pts], marker="o", label=method)
        axes[2].plot(xs, [statistics.mean(row["forced_agreement"]) for _, row in pts], marker="o", label=method)
    axes[0].set_ylabel("perplexity under the unpruned model (lower is better)")
    axes[1].set_ylabel("greedy agreement with unpruned (free-running)")
    axes[2].set_ylabel("agreement with unpruned, teacher-forced")
    for ax in axes:
        ax.set_xlabel("KV budget (% of the final context)")
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{r['model']}: {r['tokens']} generated tokens x {len(r['prompt_tokens'])} prompts")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
