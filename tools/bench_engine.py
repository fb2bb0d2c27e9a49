#!/usr/bin/env python3
"""Engine benchmark on the default model: single-stream decode vs `transformers.generate()`,
aggregate decode at N concurrent streams, TTFT of a long prompt cold vs with a prefix-cache hit,
and peak RSS; for each dtype asked. Writes JSON, a markdown table and a PNG chart.

    python tools/bench_engine.py [--dtypes bfloat16,float32] [--tokens 64] [--streams 16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge_runtime import Engine, SamplingParams  # noqa: E402
from edge_runtime.model.source import resolve_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TOPICS = ["the sea", "a mountain", "a robot", "the moon", "a library", "a bakery", "a river", "winter",
          "a violin", "a garden", "a train", "the desert", "a lighthouse", "a volcano", "a forest", "a city"]


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def hf_decode_rate(model_dir: Path, dtype: torch.dtype, prompt_ids: list[int], tokens: int) -> dict:
    """transformers' own generate(): decode tokens/s from the difference of two runs, so its
    pre-fill is not counted (the same definition as ours)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=dtype).eval()
    ids = torch.tensor([prompt_ids])

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    run(4)  # warm-up
    short = min(run(1) for _ in range(2))
    full = min(run(tokens) for _ in range(2))
    return {"decode_tok_s": (tokens - 1) / (full - short), "prefill_plus_first_token_s": short}


def our_streams(engine: Engine, prompts: list, tokens: int) -> dict:
    """Start all prompts together; decode rate counts tokens after every stream has its first."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    first: dict[str, float] = {}
    start = time.perf_counter()
    ids = []
    for p in prompts:
        ids.append(engine.add_request(p, params, on_token=lambda e: first.setdefault(e.request_id, time.perf_counter())))
    while engine.has_unfinished():
        engine.step()
    end = time.perf_counter()
    all_started = max(first.values())
    return {
        "streams": len(prompts),
        "decode_tok_s": len(prompts) * (tokens - 1) / (end - all_started),
        "ttft_mean_s": sum(first[i] - start for i in ids) / len(ids),
        "wall_s": end - start,
    }


def ttft(engine: Engine, prompt: str) -> tuple[float, int]:
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    out = engine.generate(prompt, params)[0]
    return time.perf_counter() - start, out.metrics.cached_prompt_tokens


def long_document(engine: Engine, n_tokens: int) -> str:
    words = ("edge devices keep personal data local while a small model learns what each user prefers "
             "from their feedback and serves everyone else at the same time ").split()
    text = ""
    i = 0
    while len(engine.tokenizer.hf.encode(text)) < n_tokens:
        text += words[i % len(words)] + " "
        i += 1
    ids = engine.tokenizer.hf.encode(text)[:n_tokens]
    return engine.tokenizer.hf.decode(ids)


def bench_dtype(model_dir: Path, dtype_name: str, tokens: int, streams: int) -> dict:
    engine = Engine.load(str(model_dir), dtype=dtype_name, kv_cache_bytes=256 << 20)
    dtype = engine.model.dtype
    engine.generate(chat("Warm up."), SamplingParams(max_tokens=8, ignore_eos=True))
    single_prompt = chat(f"Write a short story about {TOPICS[0]}.")
    _, prompt_ids = engine.tokenizer.encode_prompt(single_prompt)
    single = our_streams(engine, [single_prompt], tokens)
    batched = our_streams(engine, [chat(f"Write a short story about {t}.") for t in (TOPICS * 4)[:streams]], tokens)
    hf = hf_decode_rate(model_dir, dtype, prompt_ids, tokens)

    doc = long_document(engine, 496)
    cold_s, cold_cached = ttft(engine, doc + " Question one: what is kept local?")
    hit_s, hit_cached = ttft(engine, doc + " Question two: who learns from feedback?")
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "single_stream_decode_tok_s": round(single["decode_tok_s"], 2),
        "transformers_generate_decode_tok_s": round(hf["decode_tok_s"], 2),
        "single_vs_transformers": round(single["decode_tok_s"] / hf["decode_tok_s"], 3),
        f"aggregate_decode_tok_s_{streams}_streams": round(batched["decode_tok_s"], 2),
        "aggregate_vs_single": round(batched["decode_tok_s"] / single["decode_tok_s"], 3),
        "ttft_512_cold_s": round(cold_s, 4),
        "ttft_512_prefix_hit_s": round(hit_s, 4),
        "prefix_hit_cached_tokens": hit_cached,
        "cold_cached_tokens": cold_cached,
        "ttft_hit_over_cold": round(hit_s / cold_s, 3),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def machine() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()}


def write_table(result: dict, path: Path, streams: int) -> None:
    rows = result["runs"]
    lines = [
        f"Default model ({result['model']}), {result['tokens']} generated tokens per stream, "
        f"{result['machine']['cores']} cores ({result['machine']['cpu']}).",
        "",
        "| dtype | ours 1 stream (tok/s) | transformers generate (tok/s) | ours "
        f"{streams} streams (tok/s) | x single | TTFT 512 cold (s) | TTFT 512 prefix hit (s) | hit/cold | peak RSS (MB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['single_stream_decode_tok_s']} | {r['transformers_generate_decode_tok_s']} | "
            f"{r[f'aggregate_decode_tok_s_{streams}_streams']} | {r['aggregate_vs_single']} | {r['ttft_512_cold_s']} | "
            f"{r['ttft_512_prefix_hit_s']} | {r['ttft_hit_over_cold']} | {r['peak_rss_mb']} |"
        )
    path.write_text("\n".join(lines) + "\n")


def plot(result: dict, path: Path, streams: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    runs = result["runs"]
    labels = ["ours, 1 stream", "transformers, 1 stream", f"ours, {streams} streams"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(runs)
    for i, r in enumerate(runs):
        vals = [r["single_stream_decode_tok_s"], r["transformers_generate_decode_tok_s"],
                r[f"aggregate_decode_tok_s_{streams}_streams"]]
        xs = [x + i * width for x in range(len(labels))]
        bars = ax.bar(xs, vals, width, label=r["dtype"])
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks([x + width * (len(runs) - 1) / 2 for x in range(len(labels))], labels)
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Decode throughput, {result['model']}, {result['machine']['cores']} CPU cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=str(RESULTS / "bench_engine.json"))
    args = ap.parse_args()
    resolved = resolve_model(args.model)
    result = {"model": resolved.name, "tokens": args.tokens, "machine": machine(), "runs": []}
    for dtype in args.dtypes.split(","):
        print(f"benchmarking {dtype} ...", flush=True)
        result["runs"].append(bench_dtype(Path(resolved.path), dtype, args.tokens, args.streams))
        print(json.dumps(result["runs"][-1], indent=1), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    write_table(result, out.with_suffix(".md"), args.streams)
    plot(result, out.with_suffix(".png"), args.streams)
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
