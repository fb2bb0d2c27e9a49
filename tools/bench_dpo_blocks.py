"""One DPO pair's staged update timed on a GGUF's 4-bit blocks (the one copy serving reads) and on
a float32 copy de-quantised from them, alternating in one process (#28's blocks-vs-float line, as
`tools/bench_scale.py`'s `dpo_copies` measures it), with `--layers` to cut the model for quick runs
and `--only blocks` to time (or profile) the blocks path alone with its peak RSS."""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
from pathlib import Path

# Appended, so a PYTHONPATH (another checkout's code: a before/after run) comes first.
sys.path.append(str(Path(__file__).resolve().parent.parent))
sys.path.append(str(Path(__file__).resolve().parent))  # tools/bench_scale.py

import edge_runtime  # noqa: E402,F401  (before torch: it sets OMP_WAIT_POLICY, read when libgomp loads)

GGUF = "/tmp/mace-random-gguf/llama-3.2-1b-random-q4_k_m.gguf"


def vm_hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    import torch
    from bench_scale import time_pair

    from edge_runtime.loading import resolve
    from edge_runtime.model.gguf_load import dequantized_copy
    from edge_runtime.model.tokenizer import Tokenizer
    from edge_runtime.model.weights import load_llama

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gguf", default=GGUF)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16, help="tokens of the prompt and of each answer")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=0, help="keep only the first N layers (0: all)")
    ap.add_argument("--only", choices=("both", "blocks", "float"), default="both")
    ap.add_argument("--prompt", default="Say something about the device and the user who runs it.")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path, _ = resolve(args.gguf)
    blocks = load_llama(path, dtype=torch.float32)
    if args.layers:
        blocks.layers = blocks.layers[:args.layers]
        blocks.cfg = dataclasses.replace(blocks.cfg, num_layers=args.layers)
    tokenizer = Tokenizer(path)
    loaded_mib = vm_hwm_mib()
    models = {"blocks": blocks}
    if args.only != "blocks":
        models["float"] = dequantized_copy(blocks)
    if args.only == "float":
        del models["blocks"]
    n = args.tokens
    runs: dict[str, list[dict]] = {k: [] for k in models}
    for r in range(args.rounds):
        for name, model in models.items():
            load = Path("/proc/loadavg").read_text().split()[0]
            runs[name].append({**time_pair(model, tokenizer, args.prompt, n, r), "load": load,
                               "hwm_mib": round(vm_hwm_mib(), 1)})
            print(f"{name} round {r + 1}: {runs[name][-1]}", flush=True)
    best = {k: min(x["s"] for x in v) for k, v in runs.items()}
    best_cpu = {k: min(x["cpu_s"] for x in v) for k, v in runs.items()}
    out = {"code": edge_runtime.__file__, "runs": runs, "best_s": best, "best_cpu_s": best_cpu, "loaded_hwm_mib": round(loaded_mib, 1),
           "layers": args.layers or "all",
           "loadavg": Path("/proc/loadavg").read_text().strip()}
    if len(best) == 2:
        out["blocks_over_float"] = round(best["blocks"] / best["float"], 3)
        out["cpu_blocks_over_float"] = round(best_cpu["blocks"] / best_cpu["float"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
