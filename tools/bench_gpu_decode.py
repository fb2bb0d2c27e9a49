#!/usr/bin/env python3
"""The model steps of the prepared GPU check (tools/gpu_check.py runs each in its own process):
parity of graph-replayed against eager decode, decode throughput against transformers' compiled
static-cache generate and the memory-bandwidth roofline, and a DPO pair's staged training step
with its peak GPU memory against the ledger's estimates. Each writes its rows as it goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import torch
from gpu_check import log, read_step, write_step

PROMPTS = ["Write a short story about the sea.", "What is the capital of France?", "List three colours.",
           "Explain photosynthesis briefly.", "Count from one to ten.", "Describe a mountain at dawn.",
           "Give me a recipe for bread.", "Why is the sky blue?"]


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def built_models(args: argparse.Namespace) -> list[dict[str, Any]]:
    models = (read_step(args.work, "models") or {}).get("models", [])
    return [m for m in models if "path" in m]


def time_left(args: argparse.Namespace) -> float:
    return args.deadline - time.time()


def has_field(name: str) -> bool:
    from edge_runtime.config import EngineConfig

    return name in {f.name for f in dataclasses.fields(EngineConfig)}


def engine_config(args: argparse.Namespace, model: dict[str, Any], **extra: Any) -> Any:
    """The engine's settings for one model of the check: torch backend on the check's device,
    nominal costs (no calibration forwards), a fixed KV budget; the GGUF rows with
    --torch-weights. Settings this build lacks (cuda_graphs before it lands) are left out."""
    from edge_runtime.config import EngineConfig

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    settings: dict[str, Any] = {"model": model["path"], "device": args.device, "backend": "torch",
                                "cost_profile": "off", "kv_cache_bytes": (64 << 20) if args.smoke else (1 << 30),
                                "dtype": "bfloat16" if args.device != "cpu" else "float32"}
    if model["format"] != "bf16":
        settings["torch_weights"] = args.torch_weights
    settings.update(extra)
    return EngineConfig().replace(**{k: v for k, v in settings.items() if k in fields})


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graph_stats(engine: Any) -> Any:
    stats = engine.stats()
    return stats.get("cuda_graphs", "absent from stats()")


# -- parity -------------------------------------------------------------------------------------


def greedy(engine: Any, prompts: list[str], tokens: int, logprobs: int | None = None) -> list[Any]:
    from edge_runtime import SamplingParams

    params = SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=logprobs)
    return engine.generate([chat(p) for p in prompts], params)


def compare(replayed: list[Any], eager: list[Any]) -> dict[str, Any]:
    """Token lists equal or not; where they part, the eager side's top-2 margin (a flip at a
    near-tie is rounding, not a wrong graph); the largest |log-prob difference| of the chosen
    tokens while the streams agree (log-probs are the logits less one logsumexp per step)."""
    same, first, max_lp, margins = 0, [], 0.0, []
    for a, b in zip(replayed, eager, strict=True):
        ta, tb = a.token_ids, b.token_ids
        if ta == tb:
            same += 1
        lps_a, lps_b = a.candidates[0].logprobs or [], b.candidates[0].logprobs or []
        split = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), None)
        first.append(split)
        agree = len(ta) if split is None else split
        for la, lb in list(zip(lps_a, lps_b, strict=False))[:agree]:
            max_lp = max(max_lp, abs(la.logprob - lb.logprob))
        if split is not None and split < len(lps_b) and len(lps_b[split].top) >= 2:
            margins.append(round(lps_b[split].top[0][1] - lps_b[split].top[1][1], 6))
    return {"streams": len(eager), "identical_streams": same, "identical": same == len(eager),
            "first_divergence": first, "eager_top2_margin_at_divergence": margins,
            "max_abs_logprob_diff": round(max_lp, 6)}


def step_parity(args: argparse.Namespace) -> dict[str, Any]:
    """Each model loaded once; two engines over it, graphs on and off; greedy 32 tokens for 8
    prompts together, and the first prompt alone (the one-stream graph)."""
    from edge_runtime.engine import Engine
    from edge_runtime.loading import load_model

    out: dict[str, Any] = {"rows": [], "cuda_graphs_setting": has_field("cuda_graphs")}
    tokens, prompts = (6, PROMPTS[:4]) if args.smoke else (32, PROMPTS)
    # The bf16 folders and the 1B GGUF first: the default shape's GGUF holds 32-wide fallback
    # types (576-wide rows) that a GPU kernel may not take, and its slow path must not starve the rest.
    order = ["smollm2-135m bf16", "llama-3.2-1b bf16", "llama-3.2-1b q4_k_m", "smollm2-135m q4_k_m"]
    models = sorted(built_models(args), key=lambda m: order.index(m["name"]) if m["name"] in order else 0)
    for model in models:
        if time_left(args) < 15:
            out["rows"].append({"model": model["name"], "skipped": "out of time"})
            continue
        row: dict[str, Any] = {"model": model["name"]}
        t0 = time.perf_counter()
        try:
            on = engine_config(args, model, cuda_graphs=True)
            net, tokenizer, name = load_model(on)
            row["load_s"] = round(time.perf_counter() - t0, 1)
            replay = Engine(net, tokenizer, on, name=name)
            eager = Engine(net, tokenizer, engine_config(args, model, cuda_graphs=False), name=name)
            # Plain greedy first (a request asking for log-probs might be one a graph cannot
            # replay); then the same with log-probs, for their differences and the margins.
            for label, batch in (("8 streams", prompts), ("1 stream", prompts[:1])):
                row[label] = compare(greedy(replay, batch, tokens), greedy(eager, batch, tokens))
            row["graphs_on_stats_plain"] = graph_stats(replay)
            if time_left(args) > 20:
                row["8 streams, logprobs"] = compare(greedy(replay, prompts, tokens, 2),
                                                     greedy(eager, prompts, tokens, 2))
            row["graphs_on_stats"] = graph_stats(replay)
            row["graphs_off_stats"] = graph_stats(eager)
            row["dtype"] = str(net.dtype).removeprefix("torch.")
            del replay, eager, net
        except Exception as exc:  # noqa: BLE001 - the next model still runs
            row["error"] = f"{type(exc).__name__}: {exc}"
            log(f"parity {model['name']}: {row['error']}")
        row["seconds"] = round(time.perf_counter() - t0, 1)
        out["rows"].append(row)
        write_step(args.work, "parity", out)
        _free()
    return out


def _free() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- bench --------------------------------------------------------------------------------------


def weight_bytes_per_token(model: Any) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer once (the block
    tensors of a 4-bit model as stored), the rotary tables left out, and the embedding left out
    where it is not also the LM head (a token reads one row of it)."""
    head = model.lm_head_weight()
    head_tensors = [*head.parameters(), *head.buffers()] if isinstance(head, torch.nn.Module) else [head]
    head_storages = {_storage(t) for t in head_tensors}
    seen: set[int] = set()
    total = 0
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        key = _storage(t)
        if name.startswith("ropes.") or (name.startswith("embed") and key not in head_storages) or key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)


def our_rate(args: argparse.Namespace, engine: Any, streams: int, tries: int) -> dict[str, Any]:
    """Best of `tries` runs of `streams` streams started together; a run that took long (a slow
    path) is not repeated, so one slow row cannot use up the step."""
    from bench_engine import TOPICS, our_streams

    prompts = [chat(f"Write a short story about {t}.") for t in (TOPICS * 4)[:streams]]
    runs = []
    for _ in range(tries):
        t0 = time.perf_counter()
        runs.append(our_streams(engine, prompts, args.tokens))
        if time.perf_counter() - t0 > 10 or time_left(args) < 30:
            break
    best = max(runs, key=lambda r: r["decode_tok_s"])
    return {"decode_tok_s": round(best["decode_tok_s"], 2), "all": [round(r["decode_tok_s"], 2) for r in runs],
            "ttft_mean_s": round(best["ttft_mean_s"], 4)}


def weight_bytes_by_dtype(model: Any) -> dict[str, int]:
    """What the model's tensors hold, per dtype (a second copy of the weights, a repacked one
    beside the blocks, shows here)."""
    out: dict[str, int] = {}
    for _, t in [*model.named_parameters(), *model.named_buffers()]:
        key = str(t.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out


def bench_ours(args: argparse.Namespace, model: dict[str, Any], bandwidth: float | None) -> dict[str, Any]:
    from edge_runtime import Engine, SamplingParams

    device = torch.device(args.device)
    t0 = time.perf_counter()
    engine = Engine.load(config=engine_config(args, model))
    row: dict[str, Any] = {"model": model["name"], "runtime": "ours", "load_s": round(time.perf_counter() - t0, 1),
                           "dtype": str(engine.model.dtype).removeprefix("torch.")}
    engine.generate(chat("Warm up."), SamplingParams(max_tokens=8, ignore_eos=True))
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    row["weight_bytes_per_token"] = weight_bytes_per_token(engine.model)
    row["tensor_bytes_by_dtype"] = weight_bytes_by_dtype(engine.model)
    if bandwidth:
        row["roofline_tok_s"] = round(bandwidth * 1e9 / row["weight_bytes_per_token"], 1)
    tries = 1 if args.smoke else 2
    row["1"] = our_rate(args, engine, 1, tries)
    if time_left(args) > 20:
        row[str(args.streams)] = our_rate(args, engine, args.streams, tries)
    if bandwidth:
        row["roofline_pct_1"] = round(100 * row["1"]["decode_tok_s"] / row["roofline_tok_s"], 1)
    row["cuda_graphs"] = graph_stats(engine)
    row["sampling"] = engine.stats().get("sampling")
    row["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if device.type == "cuda" else None
    del engine
    if model["name"].startswith("smollm2-135m bf16") and time_left(args) > 40:
        # The same model with every step eager: the "today" of the bar's 10x, on this GPU.
        eager = Engine.load(config=engine_config(args, model, cuda_graphs=False))
        eager.generate(chat("Warm up."), SamplingParams(max_tokens=8, ignore_eos=True))
        row["eager_1"] = our_rate(args, eager, 1, 1)
        del eager
    return row


def hf_compiled_rate(args: argparse.Namespace, model: dict[str, Any]) -> dict[str, Any]:
    """transformers' generate with its static cache, the decode step compiled (torch.compile,
    transformers' CompileConfig: mode reduce-overhead); decode tok/s from the difference of a
    short and a full run (its pre-fill not counted); the first run's compile time apart."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation import CompileConfig

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(model["path"], local_files_only=True, dtype=dtype).to(device).eval()
    tok = AutoTokenizer.from_pretrained(model["path"], local_files_only=True)
    ids = tok.apply_chat_template(chat("Write a short story about the sea."), add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"].to(device)
    load_s = time.perf_counter() - t0
    tokens = args.tokens
    compile_config = CompileConfig(fullgraph=False, mode="reduce-overhead")

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id,
                        cache_implementation="static", compile_config=compile_config)
        sync(device)
        return time.perf_counter() - start

    # The static cache is sized by the first run (the longest) and reused by shorter ones, so
    # the compiled step is not recompiled for them.
    first = run(tokens)
    run(2)  # the short run's own first call (transformers makes a new static cache per call)
    second = run(tokens)
    short = min(run(2) for _ in range(2))
    full = min(second, run(tokens))
    # A difference that is not positive (noise, a recompile in a short run) would make no rate:
    # then the full run's whole time counts, pre-fill included (an underestimate, marked so).
    rate = (tokens - 2) / (full - short) if full > short else tokens / full
    row = {"model": model["name"], "runtime": "transformers generate, static cache, torch.compile",
           "load_s": round(load_s, 1), "compile_s": round(first - full, 1), "first_run_s": round(first, 2),
           "1": {"decode_tok_s": round(rate, 2)}, "short_s": round(short, 4), "full_s": round(full, 4),
           "rate_from": "difference of runs" if full > short else "full run (pre-fill included)",
           # transformers keeps the compiled step it made for generate here (None: it ran eager)
           "compiled": getattr(hf, "_compiled_call", None) is not None,
           "dtype": str(dtype).removeprefix("torch.")}
    return row


def step_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Ours at 1 and N streams for every model (the order matters: the bar's rows first), then
    transformers' compiled generate on the bf16 folders (the 1B one first); rows that would not
    finish in the step's time are skipped and say so."""
    measure = read_step(args.work, "measure") or {}
    bandwidth = measure.get("copy_bandwidth_gb_s")
    out: dict[str, Any] = {"tokens": args.tokens, "streams": args.streams, "bandwidth_gb_s": bandwidth, "rows": []}
    models = {m["name"]: m for m in built_models(args)}
    order = ["smollm2-135m bf16", "llama-3.2-1b q4_k_m", "llama-3.2-1b bf16", "hf:llama-3.2-1b bf16",
             "smollm2-135m q4_k_m", "hf:smollm2-135m bf16"]
    if args.smoke:
        order = ["tiny bf16", "tiny q4_k_m", "hf:tiny bf16"]
    need = {"ours": 12 if args.smoke else 30, "hf": 10 if args.smoke else 75}
    for key in order:
        hf = key.startswith("hf:")
        model = models.get(key.removeprefix("hf:"))
        if model is None:
            continue
        if time_left(args) < need["hf" if hf else "ours"]:
            out["rows"].append({"model": model["name"], "runtime": "transformers" if hf else "ours",
                                "skipped": f"{time_left(args):.0f} s left in the step"})
            continue
        t0 = time.perf_counter()
        try:
            row = hf_compiled_rate(args, model) if hf else bench_ours(args, model, bandwidth)
            if hf and bandwidth:
                ours = next((r for r in out["rows"] if r.get("model") == model["name"] and "weight_bytes_per_token" in r),
                            None)
                if ours:
                    row["roofline_pct_1"] = round(100 * row["1"]["decode_tok_s"] / ours["roofline_tok_s"], 1)
        except Exception as exc:  # noqa: BLE001 - the next row still runs
            row = {"model": model["name"], "runtime": "transformers" if hf else "ours",
                   "error": f"{type(exc).__name__}: {exc}"}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        row["loadavg"] = Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").exists() else ""
        log(f"bench {key}: {row.get('error') or row.get('1')}")
        out["rows"].append(row)
        write_step(args.work, "bench", out)
        _free()
    return out


# -- train --------------------------------------------------------------------------------------


def train_pair(args: argparse.Namespace, model: dict[str, Any]) -> dict[str, Any]:
    """One DPO pair's staged update through the engine's scheduler; per stage the ledger's
    estimate (peak: transient beyond what the task holds; held: what it keeps after) against
    what the allocator saw (peak allocated during the stage less allocated at its start; allocated
    after it less allocated when the pair started)."""
    from bench_scale import text_of_tokens

    from edge_runtime import Engine
    from edge_runtime.train import staged
    from edge_runtime.train.pairs import PreferenceRecord
    from edge_runtime.train.trainer import AdapterTrainer

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    engine = Engine.load(config=engine_config(args, model, finetune_memory_bytes=(8 << 30) if cuda else (1 << 30)))
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    costs = engine.stage_costs()
    profile_s = time.perf_counter() - t0
    n = 16 if args.smoke else 64
    vocab = engine.tokenizer
    pair = PreferenceRecord((chat(text_of_tokens(vocab, n))[0],), text_of_tokens(vocab, n, 3),
                            text_of_tokens(vocab, n, 11), pair_id="gpu-check")
    trainer = AdapterTrainer(engine.model, engine.tokenizer, costs=costs)
    task = trainer.task(pair, score=False)
    stages: list[dict[str, Any]] = []
    original = staged.Stage.run
    allocated = (lambda: torch.cuda.memory_allocated(device)) if cuda else (lambda: 0)
    trace = None
    if cuda and os.environ.get("MACE_GPU_TRACE_MEMORY"):
        # What holds each stage's peak (the allocator's history, per frame of our code).
        from gpu_memory_trace import StageTrace

        trace = StageTrace(device)
        trace.start()
    sync(device)
    pair_start = allocated()

    def measured_run(self: staged.Stage) -> float:
        est = self.estimate()
        sync(device)
        if trace is not None:
            trace.mark()
        before = allocated()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        seconds = original(self)
        sync(device)
        peak = torch.cuda.max_memory_allocated(device) if cuda else 0
        stages.append({"stage": self.name, "kind": self.kind.value, "seconds": round(seconds, 4),
                       "est_peak_mib": round(est.peak_bytes / 2**20, 2), "est_held_mib": round(est.held_bytes / 2**20, 2),
                       "peak_over_start_mib": round((peak - before) / 2**20, 2) if cuda else None,
                       "held_after_mib": round((allocated() - pair_start) / 2**20, 2) if cuda else None,
                       "peak_over_pair_start_mib": round((peak - pair_start) / 2**20, 2) if cuda else None})
        if trace is not None:
            stages[-1]["peak_holders"] = trace.holders()
        return seconds

    staged.Stage.run = measured_run  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        engine.add_finetune(task, user="gpu-check")
        while engine.has_unfinished():
            engine.step()
        sync(device)
        seconds = time.perf_counter() - t0
    finally:
        staged.Stage.run = original  # type: ignore[method-assign]
        if trace is not None:
            trace.stop()
    job = engine.scheduler.finetune.finished[-1] if engine.scheduler.finetune.finished else None
    # The ledger's view of the whole pair: at each stage, what the task held before it (the
    # previous stage's estimate) plus the stage's transient estimate.
    held, predicted = 0.0, 0.0
    for s in stages:
        predicted = max(predicted, held + s["est_peak_mib"])
        held = s["est_held_mib"]
    measured = max((s["peak_over_pair_start_mib"] or 0.0) for s in stages) if cuda and stages else None
    row = {"model": model["name"], "dtype": str(engine.model.dtype).removeprefix("torch."), "load_s": round(load_s, 1),
           "stage_cost_profile_s": round(profile_s, 1), "pair_tokens_each": n, "seconds": round(seconds, 2),
           "stages": stages, "error": getattr(job, "error", None),
           "loss": None if task.result is None else round(float(task.result.loss), 4),
           "predicted_pair_peak_mib": round(predicted, 1), "measured_pair_peak_mib": measured,
           "measured_over_predicted": round(measured / predicted, 3) if measured and predicted else None,
           "peak_gpu_mib_total": round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if cuda else None,
           "ledger_activations_mib": round(engine.ledger.held(_kind("ACTIVATIONS")) / 2**20, 1)}
    del engine
    return row


def _kind(name: str) -> Any:
    from edge_runtime.memory import MemoryKind

    return MemoryKind[name]


def step_train(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"rows": []}
    names = ["tiny bf16", "tiny q4_k_m"] if args.smoke else ["llama-3.2-1b bf16", "llama-3.2-1b q4_k_m"]
    models = {m["name"]: m for m in built_models(args)}
    for name in names:
        if name not in models:
            continue
        if time_left(args) < (10 if args.smoke else 25):
            out["rows"].append({"model": name, "skipped": f"{time_left(args):.0f} s left in the step"})
            continue
        try:
            row = train_pair(args, models[name])
        except Exception as exc:  # noqa: BLE001 - the 4-bit row may still run
            row = {"model": name, "error": f"{type(exc).__name__}: {exc}"}
        log(f"train {name}: {row.get('error') or (row['seconds'], row['measured_over_predicted'])}")
        out["rows"].append(row)
        write_step(args.work, "train", out)
        _free()
    return out
