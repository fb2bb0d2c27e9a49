"""The 8B Q4_K_M file loaded on ONNX Runtime in-process (no self-check, nominal costs): peak RSS
to ready (VmHWM), then resident while serving a few greedy tokens (issue #28, helper `ortmem`).

    MACE_CACHE_DIR=<warm cache> python tools/results/bench_scale_ortmem_start8b.py [GGUF]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from edge_runtime import SamplingParams
from edge_runtime.engine import Engine

FILE = "/tmp/mace-random-gguf/llama-3.1-8b-random-q4_k_m.gguf"


def status() -> dict[str, int]:
    """This process's VmRSS, RssAnon, RssFile and VmHWM in MiB."""
    keys = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
    lines = Path("/proc/self/status").read_text().splitlines()
    return {line.split(":")[0]: int(line.split()[1]) // 1024 for line in lines if line.startswith(keys)}


def main() -> None:
    started = time.time()
    engine = Engine.load(sys.argv[1] if len(sys.argv) > 1 else FILE, backend="onnxruntime",
                         onnx_quantization="q4_1", dtype="float32", num_threads=2, cost_profile="off")
    ready = {"ready_s": round(time.time() - started, 1), **status()}
    print("ready", ready, flush=True)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on: serving only
    started = time.time()
    out = engine.generate("Give me a tip for cooking rice.", SamplingParams(max_tokens=4, ignore_eos=True))[0]
    serving = {"tok_s": round(len(out.candidates[0].token_ids) / (time.time() - started), 3), **status()}
    print(json.dumps({"ready": ready, "serving": serving, "loadavg": Path("/proc/loadavg").read_text().strip()}))


if __name__ == "__main__":
    main()
