#!/usr/bin/env python3
"""TensorRT self-check for a Jetson owner: builds engines from the exported step graph and checks
them against the torch backend on this device, then times decode. Exit status 0 = all passed.

    python tools/trt_selfcheck.py [--model tiny|default|PATH] [--quantization none,int4] [--tokens 32]

Checks, in order (each prints PASS/FAIL/SKIP with numbers): tensorrt and CUDA present; the graph
parses and an engine builds (cached under <state dir>/onnx/trt); greedy output of the float
engine equals the torch backend's (fp16) on 8 prompts; decode tokens/s at 1 and 16 streams for
torch and each TensorRT engine. Report the power mode with the numbers
(`nvpmodel -q`; measure after `sudo nvpmodel -m 0 && sudo jetson_clocks`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from edge_runtime import Engine, SamplingParams  # noqa: E402
from trt_plugins.builder import TensorRTUnavailable, require_tensorrt  # noqa: E402

PROMPTS = ["Hello, how are you?", "What is the capital of France?", "Write a haiku about the sea.",
           "Explain what a GPU is.", "List three fruits.", "Why is the sky blue?", "Say something kind.",
           "Count to five."]
results: list[dict] = []


def report(check: str, status: str, **numbers) -> None:
    results.append({"check": check, "status": status, **numbers})
    extra = " ".join(f"{k}={v}" for k, v in numbers.items())
    print(f"[{status}] {check} {extra}", flush=True)


def model_path(spec: str) -> str:
    if spec == "tiny":
        from edge_runtime.model.testing import make_tiny_model_dir

        return str(make_tiny_model_dir(Path(tempfile.mkdtemp(prefix="trt-selfcheck-"))))
    if spec == "default":
        from edge_runtime.model.source import resolve_model

        return str(resolve_model(None).path)
    return spec


def greedy(engine: Engine, tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    return [o.candidates[0].token_ids for o in engine.generate(PROMPTS, params)]


def decode_rate(engine: Engine, streams: int, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    engine.generate(PROMPTS[:1], SamplingParams(max_tokens=2, ignore_eos=True))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(streams)]
    first: dict[str, float] = {}
    for p in prompts:
        engine.add_request(p, params, on_token=lambda e: first.setdefault(e.request_id, time.perf_counter()))
    while engine.has_unfinished():
        engine.step()
    end = time.perf_counter()
    return streams * (tokens - 1) / (end - max(first.values()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--quantization", default="none,int4")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    try:
        trt = require_tensorrt()
    except TensorRTUnavailable as exc:
        report("tensorrt and CUDA present", "FAIL", reason=str(exc))
        return 1
    report("tensorrt and CUDA present", "PASS", tensorrt=trt.__version__, gpu=torch.cuda.get_device_name(0))
    try:
        power = subprocess.run(["nvpmodel", "-q"], capture_output=True, text=True, timeout=10).stdout.strip()
        report("power mode", "INFO", nvpmodel=power.replace("\n", " | "))
    except (OSError, subprocess.SubprocessError):
        report("power mode", "SKIP", reason="nvpmodel not found (not a Jetson?)")

    from trt_plugins.backend import TensorRTBackend

    path = model_path(args.model)
    engine = Engine.load(path, device="cuda", dtype="float16", kv_cache_bytes=256 << 20)
    reference = greedy(engine, args.tokens)
    torch_rates = {s: decode_rate(engine, s, args.tokens) for s in (1, 16)}
    report("torch backend decode", "INFO", tok_s_1=round(torch_rates[1], 1), tok_s_16=round(torch_rates[16], 1))
    failed = False
    for quantization in args.quantization.split(","):
        label = f"tensorrt {quantization}"
        started = time.perf_counter()
        try:
            engine.backend = TensorRTBackend(engine.model, engine.cache, engine.adapters, quantization=quantization,
                                             max_batch=engine.config.max_num_seqs,
                                             max_tokens=engine.config.max_batched_tokens,
                                             max_context=engine.max_context)
        except Exception as exc:  # noqa: BLE001 - report every failure, keep checking the rest
            report(f"{label}: build engine", "FAIL", error=f"{type(exc).__name__}: {exc}")
            failed = True
            continue
        report(f"{label}: build engine", "PASS", seconds=round(time.perf_counter() - started, 1))
        ours = greedy(engine, args.tokens)
        same = sum(a == b for a, b in zip(ours, reference, strict=True))
        # Weight quantisation changes the numbers on purpose; only float engines must agree.
        status = "PASS" if same == len(PROMPTS) or quantization != "none" else "FAIL"
        failed |= status == "FAIL"
        report(f"{label}: greedy equals torch", status, identical=f"{same}/{len(PROMPTS)}")
        rates = {s: decode_rate(engine, s, args.tokens) for s in (1, 16)}
        report(f"{label}: decode", "INFO", tok_s_1=round(rates[1], 1), tok_s_16=round(rates[16], 1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
