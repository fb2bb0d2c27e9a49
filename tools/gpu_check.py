#!/usr/bin/env python3
"""The prepared GPU check of issue #33: one run on a bare GPU machine (no network) measures the
device, runs the CUDA tests, builds random-weight models there, checks graph-replayed against
eager decode, benchmarks decode against transformers and the memory roofline, and times a DPO
pair's training step. Each step runs in its own process under a timeout; a step that fails or
times out is logged and the next one still runs; results are merged after every step.

    python tools/gpu_check.py [--device cuda] [--steps env,measure,...] [--budget 500] [--out DIR]
    python tools/gpu_check.py --device cpu --smoke     # every step at the tiny shape, on the CPU

tools/gpu_check.sh is the wrapper the device run calls (carried wheels, $OUT). The model steps
(parity, bench, train) live in tools/bench_gpu_decode.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

# models before tests: converting the GGUFs into the model cache (CPU work, a minute at 1B) runs
# in the background beside the CUDA tests, and the first load waits on the cache's lock.
# kernels (the int4 helper's tools/bench_qweights_cuda.py, where the tree has it) comes last: a
# diagnostic that the bar does not need, run only with the time left.
STEPS = ("env", "measure", "models", "tests", "parity", "bench", "train", "kernels")
# Seconds each step may take at most on the device (the sum stays inside the run's 9 minutes
# with the wrapper's start); smoke mode on a CPU gets its own, smaller figures.
TIMEOUTS = {"env": 30, "measure": 30, "tests": 60, "models": 75, "parity": 70, "bench": 200,
            "train": float(os.environ.get("GPU_CHECK_TRAIN_S", 60)), "kernels": 45}
SMOKE_TIMEOUTS = {"env": 30, "measure": 30, "tests": 60, "models": 40, "parity": 60, "bench": 60, "train": 60,
                  "kernels": 60}
# The packages the engine and these tools import that a bare device image may lack (carried as
# wheels by tools/gpu_check.sh: .whl/, ignored by git).
PROJECT_IMPORTS = ("torch", "transformers", "safetensors", "tokenizers", "numpy", "gguf", "msgspec", "llguidance",
                   "zmq", "psutil", "peft", "jinja2", "msgpack", "rich", "tqdm", "triton", "matplotlib")
RESERVE_S = 5.0  # kept back from the budget for the last merge


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_step(work: Path, step: str, data: dict[str, Any]) -> None:
    """A step's results so far (the model steps call it after each row, so a timeout keeps them)."""
    path = work / f"{step}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def read_step(work: Path, step: str) -> dict[str, Any] | None:
    path = work / f"{step}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# -- step: env ----------------------------------------------------------------------------------


def step_env(args: argparse.Namespace) -> dict[str, Any]:
    import importlib

    out: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine(),
                           "cpus": os.cpu_count(), "loadavg": _loadavg(), "packages": {}, "missing": []}
    for name in PROJECT_IMPORTS:
        try:
            module = importlib.import_module(name)
            out["packages"][name] = getattr(module, "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - a missing package is the finding
            out["missing"].append(f"{name}: {type(exc).__name__}: {exc}")
    import torch

    out["torch_cuda"] = torch.version.cuda
    out["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        out["sm"] = f"{props.major}.{props.minor}"
        out["multiprocessors"] = props.multi_processor_count
    else:
        out["gpu"] = None
    if shutil.which("nvidia-smi"):
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            out["nvidia_smi"] = f"failed: {exc}"
    try:  # the project's own entry points import (a missing wheel shows here, not in a later step)
        importlib.import_module("edge_runtime")
        importlib.import_module("edge_runtime.engine")
        importlib.import_module("edge_runtime.train.trainer")
        out["project_imports"] = "ok"
    except Exception as exc:  # noqa: BLE001
        out["project_imports"] = f"{type(exc).__name__}: {exc}"
    return out


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return ""


# -- step: measure ------------------------------------------------------------------------------


def step_measure(args: argparse.Namespace) -> dict[str, Any]:
    """Copy bandwidth (a large device-to-device copy, bytes read + written, median of several)
    and the launch latency of a tiny kernel (many back to back, one sync at the end)."""
    import statistics

    import torch

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    nbytes = (64 << 20) if args.smoke else (2 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(3):
        dst.copy_(src)
    sync()
    times = []
    for _ in range(5 if args.smoke else 20):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    del src, dst
    tiny = torch.zeros(1, device=device)
    n = 200 if args.smoke else 5000
    for _ in range(100):
        tiny.add_(1)
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        tiny.add_(1)
    sync()
    launch_s = (time.perf_counter() - t0) / n
    return {"copy_bytes": nbytes, "copy_median_s": median, "copy_bandwidth_gb_s": round(2 * nbytes / median / 1e9, 1),
            "copy_samples": len(times), "launch_us": round(launch_s * 1e6, 2), "launches": n, "device": str(device),
            "loadavg": _loadavg()}


# -- step: tests --------------------------------------------------------------------------------


def gpu_test_files() -> list[str]:
    """The test files that mark tests `gpu` (collecting only these keeps the step short and away
    from test modules whose imports the device image lacks)."""
    files = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        text = path.read_text(errors="replace")
        if re.search(r"pytest\.mark\.gpu|mark\.gpu\b", text):
            files.append(str(path.relative_to(ROOT)))
    return files


def step_tests(args: argparse.Namespace) -> dict[str, Any]:
    """pytest -m gpu over the files that mark tests gpu; stopped a few seconds before the step's
    deadline so what ran is still counted (from its verbose lines when the junit file is missing)."""
    files = gpu_test_files()
    if not files:
        return {"files": [], "summary": "no test file marks tests gpu"}
    junit = args.work / "junit_gpu.xml"
    output = args.work / "pytest_gpu.txt"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu and not slow", "-v", "--tb=short", "-rfEs", "-p", "no:cacheprovider",
           f"--junitxml={junit}", "--timeout=45", *files]
    t0 = time.perf_counter()
    timed_out = False
    with open(output, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=max(10, args.deadline - time.time() - 4))
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            proc.wait()
    text = output.read_text(errors="replace")
    print(text[-20000:], flush=True)  # into the run's log
    counts = junit_counts(junit) if not timed_out else {}
    if not counts:  # killed before pytest wrote its file: count its verbose lines
        found = re.findall(r"::\S+ (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", text)
        counts = {k.lower(): found.count(k) for k in ("PASSED", "FAILED", "SKIPPED", "ERROR")}
        counts = {"tests": len(found), "passed": counts["passed"], "failures": counts["failed"],
                  "errors": counts["error"], "skipped": counts["skipped"]}
    summary = next((line for line in reversed(text.splitlines()) if " in " in line and "=" in line), "")
    return {"files": files, "returncode": proc.returncode, "timed_out": timed_out,
            "seconds": round(time.perf_counter() - t0, 1), "counts": counts,
            "summary": ("TIMED OUT; " if timed_out else "") + summary.strip("= "), "tail": text[-4000:],
            "junit": str(junit)}


def junit_counts(path: Path) -> dict[str, int]:
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suites = [root] if root.tag == "testsuite" else list(root)
    out = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for key in out:
            out[key] += int(suite.get(key, 0))
    out["passed"] = out["tests"] - out["failures"] - out["errors"] - out["skipped"]
    return out


# -- step: kernels ------------------------------------------------------------------------------


def step_kernels(args: argparse.Namespace) -> dict[str, Any]:
    """The quantised-weight kernels at Llama-3.2-1B's decode shapes against torch's bf16 GEMM
    (tools/bench_qweights_cuda.py; on the CPU its tiny shapes through Triton's interpreter)."""
    tool = ROOT / "tools" / "bench_qweights_cuda.py"
    if not tool.exists():
        return {"skipped": "tools/bench_qweights_cuda.py is not in this tree"}
    raw = args.work / "kernels_raw.json"
    cmd = [sys.executable, str(tool), "--out", str(raw)] + (["--device", "cpu"] if args.device == "cpu" else [])
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=max(5, args.deadline - time.time() - 3))
    except subprocess.TimeoutExpired as exc:
        print(exc.stdout or "", flush=True)
        return {"error": "timed out"}
    print(proc.stdout[-8000:], proc.stderr[-4000:], flush=True)
    if proc.returncode != 0 or not raw.exists():
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-500:]}"}
    return json.loads(raw.read_text())


# -- step: models -------------------------------------------------------------------------------


def model_plan(smoke: bool) -> list[dict[str, str]]:
    """(name, shape, format) of each model the later steps use, in the order they matter."""
    shapes = ("tiny",) if smoke else ("smollm2-135m", "llama-3.2-1b")
    return [{"name": f"{s} {fmt}", "shape": s, "format": fmt} for s in shapes for fmt in ("bf16", "q4_k_m")]


def step_models(args: argparse.Namespace) -> dict[str, Any]:
    """Random weights built here: each shape as a Hugging Face folder in bf16 (the default model's
    own config and tokenizer from tools/data/smollm2-135m; the others' config from make_gguf's
    table with its padded tokenizer), drawn on the check's device, and as a Q4_K_M GGUF
    (tools/make_gguf.py)."""
    import make_gguf
    from random_weights_copy import write_copy

    models_dir = args.work / "models"
    out: dict[str, Any] = {"models": []}
    for entry in model_plan(args.smoke):
        shape = make_gguf.SHAPES[entry["shape"]]
        t0 = time.perf_counter()
        try:
            if entry["format"] == "bf16":
                path = models_dir / entry["shape"]
                source = (ROOT / "tools" / "data" / "smollm2-135m" if entry["shape"] == "smollm2-135m"
                          else shape_config_dir(shape, models_dir / f"{entry['shape']}-config"))
                write_copy(source, path, dtype="bfloat16", device=args.device)
                size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
            else:
                mix = make_gguf.MIXES[entry["format"]]
                path = make_gguf.write_gguf(shape, mix, models_dir / make_gguf.file_name(shape, mix))
                size = path.stat().st_size
                convert_in_background(args, {**entry, "path": str(path)})
            entry = {**entry, "path": str(path), "bytes": size, "build_s": round(time.perf_counter() - t0, 1)}
        except Exception as exc:  # noqa: BLE001 - the next model may still build
            entry = {**entry, "error": f"{type(exc).__name__}: {exc}", "build_s": round(time.perf_counter() - t0, 1)}
        out["models"].append(entry)
        log(f"model {entry['name']}: {entry.get('error') or entry['path']} ({entry['build_s']} s)")
        write_step(args.work, "models", out)
    return out


CONVERT = """
import json, sys, time
sys.path.insert(0, {tools!r})
import argparse
from bench_gpu_decode import engine_config
from edge_runtime.loading import reads_in_place, resolve
args = argparse.Namespace(**{args!r})
model = {model!r}
t0 = time.perf_counter()
try:
    where = str(resolve(model["path"], in_place=reads_in_place(engine_config(args, model)))[0])
except Exception as exc:
    where = f"{{type(exc).__name__}}: {{exc}}"
open({out!r}, "w").write(json.dumps({{"model": model["name"], "cache": where, "seconds": time.perf_counter() - t0}}))
"""


def convert_in_background(args: argparse.Namespace, model: dict[str, Any]) -> None:
    """Start reading the GGUF into the model cache (what Engine.load does first) in a process of
    its own, which outlives this step; the loads in the later steps wait on the cache's lock."""
    plain = {"device": args.device, "smoke": args.smoke, "torch_weights": args.torch_weights}
    out = args.work / f"convert_{model['shape']}_{model['format']}.json"
    code = CONVERT.format(tools=str(ROOT / "tools"), args=plain, model=model, out=str(out))
    with open(args.work / "gpu_check_log.txt", "a") as log_file:
        subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)


def shape_config_dir(shape: Any, path: Path) -> Path:
    """config.json and the padded tokenizer of a make_gguf shape (what tools/bench_scale.py's
    folders hold, without their weights: random_weights_copy draws those)."""
    from bench_scale import hf_config
    from make_gguf import padded_tokenizer

    tokenizer = padded_tokenizer(shape.vocab_size)
    specials = tuple(tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    config = hf_config(shape, specials)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# -- the driver ---------------------------------------------------------------------------------


def run_step(args: argparse.Namespace, step: str) -> dict[str, Any]:
    """In the child process: run one step and write its results."""
    if step in ("parity", "bench", "train"):
        import bench_gpu_decode

        fn = getattr(bench_gpu_decode, f"step_{step}")
    else:
        fn = globals()[f"step_{step}"]
    return fn(args)


def child_command(args: argparse.Namespace, step: str, deadline: float) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-step", step, "--device", args.device,
           "--work", str(args.work), "--deadline", f"{deadline:.1f}", "--tokens", str(args.tokens),
           "--streams", str(args.streams), "--torch-weights", args.torch_weights]
    return cmd + (["--smoke"] if args.smoke else [])


def drive(args: argparse.Namespace) -> int:
    started = time.time()
    args.work.mkdir(parents=True, exist_ok=True)
    # The model cache and the cost profiles of this run stay in its work folder (a bare device
    # has nothing to reuse; a developer's smoke run leaves their own caches alone).
    os.environ.setdefault("MACE_CACHE_DIR", str(args.work / "cache"))
    os.environ.setdefault("MACE_STATE_DIR", str(args.work / "state"))
    timeouts = SMOKE_TIMEOUTS if args.smoke else TIMEOUTS
    steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise SystemExit(f"unknown steps {unknown}: any of {', '.join(STEPS)}")
    status: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                              "budget_s": args.budget, "smoke": args.smoke, "device": args.device, "steps": {}}
    log_path = args.work / "gpu_check_log.txt"
    with open(log_path, "a") as logfile:
        for step in steps:
            left = args.budget - (time.time() - started) - RESERVE_S
            timeout = min(timeouts[step], left)
            if timeout < 5:
                status["steps"][step] = {"status": "skipped", "why": "the run's time budget is spent"}
                log(f"{step}: skipped (budget spent)")
                continue
            deadline = time.time() + timeout
            t0 = time.perf_counter()
            logfile.write(f"\n===== {step} (timeout {timeout:.0f} s) =====\n")
            logfile.flush()
            try:
                proc = subprocess.run(child_command(args, step, deadline), stdout=logfile, stderr=subprocess.STDOUT,
                                      timeout=timeout, cwd=ROOT)
                state = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
            except subprocess.TimeoutExpired:
                state = f"timed out after {timeout:.0f} s"
            elapsed = time.perf_counter() - t0
            status["steps"][step] = {"status": state, "seconds": round(elapsed, 1), "timeout_s": round(timeout)}
            log(f"{step}: {state} in {elapsed:.1f} s")
            if state != "ok":
                logfile.flush()
                print(_tail(log_path, 25), flush=True)
            write_step(args.work, "status", status)
            try:
                merge(args)
            except Exception as exc:  # noqa: BLE001 - the results of later steps matter more
                log(f"merge failed: {type(exc).__name__}: {exc}")
    status["total_s"] = round(time.time() - started, 1)
    write_step(args.work, "status", status)
    paths = merge(args)
    for name, info in status["steps"].items():
        log(f"{name:8s} {info['status']:30s} {info.get('seconds', 0):6.1f} s")
    log(f"total {status['total_s']} s; results: {', '.join(str(p) for p in paths)}")
    print(final_table(args), flush=True)
    return 0


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def gpu_slug(name: str | None) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100' (the chip's model number), else a slug of the name."""
    if not name:
        return "cpu"
    found = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    return (found.group(1) if found else re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")).lower()


def merge(args: argparse.Namespace) -> list[Path]:
    """Every step's results so far into bench_gpu_<gpu>.json / .md (and the log, the junit file)
    in the results folder and in --out."""
    from gpu_check_report import write_markdown, write_png

    result: dict[str, Any] = {step: read_step(args.work, step) for step in ("status", *STEPS)}
    result["conversions"] = [json.loads(p.read_text()) for p in sorted(args.work.glob("convert_*.json"))]
    env = result.get("env") or {}
    slug = "smoke_" + gpu_slug(env.get("gpu")) if args.smoke else gpu_slug(env.get("gpu"))
    results_dir = args.results or (args.work / "results" if args.smoke else ROOT / "tools" / "results")
    results_dir.mkdir(parents=True, exist_ok=True)
    base = results_dir / f"bench_gpu_{slug}"
    base.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    write_markdown(result, base.with_suffix(".md"))
    paths = [base.with_suffix(".json"), base.with_suffix(".md")]
    if "bench" in result and result["bench"] and write_png(result, base.with_suffix(".png")):
        paths.append(base.with_suffix(".png"))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for path in paths + [p for p in [args.work / "junit_gpu.xml"] if p.exists()]:
            shutil.copy(path, args.out / path.name)
        log_path = args.work / "gpu_check_log.txt"
        if log_path.exists():  # its last 8 MiB: a file over 16 MiB would not come back at all
            with open(log_path, "rb") as src:
                src.seek(max(0, log_path.stat().st_size - (8 << 20)))
                (args.out / log_path.name).write_bytes(src.read())
    return paths


def final_table(args: argparse.Namespace) -> str:
    from gpu_check_report import summary_lines

    result = {step: read_step(args.work, step) for step in ("status", *STEPS)}
    return "\n".join(summary_lines(result))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for the smoke run")
    ap.add_argument("--smoke", action="store_true", help="every step at the tiny shape, few tokens (CPU, < 60 s)")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"any of {', '.join(STEPS)}, in order")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all steps together")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu_check"), help="models, step results and logs")
    ap.add_argument("--out", type=Path, default=None, help="also copy the results here (the device run's $OUT)")
    ap.add_argument("--results", type=Path, default=None,
                    help="results folder (default tools/results; <work>/results in smoke mode)")
    ap.add_argument("--tokens", type=int, default=0, help="generated tokens per stream in bench (0: 128, smoke 8)")
    ap.add_argument("--streams", type=int, default=0, help="streams of the batched rows (0: 16, smoke 4)")
    ap.add_argument("--torch-weights", default="auto", help="engine.torch_weights for the GGUF rows")
    ap.add_argument("--run-step", default="", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.tokens:
        args.tokens = 8 if args.smoke else 128
    if not args.streams:
        args.streams = 4 if args.smoke else 16
    if args.run_step:
        args.deadline = args.deadline or time.time() + 600
        data = run_step(args, args.run_step)
        write_step(args.work, args.run_step, data)
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
