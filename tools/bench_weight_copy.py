"""Two copies of the base weights on the auto backend, or one: what each costs.

The auto backend serves the ONNX graph's 4-bit `q4_1` weights while the staged trainer (and the
self-check's torch reference) reads float32 torch weights. One copy (QLoRA-style) would keep only
the 4-bit blocks and de-quantise each layer's linears on the fly in every training pass. This
measures both sides on the default model: the bytes the float32 linears take beside their q4_1
blocks, and the time to de-quantise every linear once in torch (best of 3, one thread), set
against the train time per DPO pair that `tools/bench_alignment.py --backend auto` recorded. A
staged pair reads every linear weight at least three times (reference forward, forward,
backward). Writes tools/results/bench_weight_copy.{json,md}.

    .venv/bin/python tools/bench_weight_copy.py [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from edge_runtime.backends.quantize import pack_q4_offsets  # noqa: E402
from edge_runtime.model.source import resolve_model  # noqa: E402
from edge_runtime.model.weights import load_llama  # noqa: E402

LINEARS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
PASSES_PER_PAIR = 3  # reference forward, forward, backward: each reads every linear weight


def dequantize(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] of q4_1 blocks (packed [N, K/32, 16] nibbles)."""
    n, blocks, _ = packed.shape
    q = torch.stack(((packed & 0x0F), (packed >> 4)), dim=-1).reshape(n, blocks, 32).to(torch.float32)
    return ((q - 8) * scales[..., None] + offsets[..., None]).reshape(n, blocks * 32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=REPO / "tools" / "results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    resolved = resolve_model(None)
    model = load_llama(resolved.path, dtype=torch.float32, device=torch.device("cpu"))
    float_bytes = block_bytes = 0
    blocks = []
    for layer in model.layers:
        for name in LINEARS:
            weight = getattr(layer, name).detach()
            float_bytes += weight.numel() * weight.element_size()
            p = pack_q4_offsets(weight.numpy())
            packed = torch.from_numpy(p.nbits.packed)
            scales = torch.from_numpy(p.nbits.scales.reshape(p.nbits.n, -1))
            offsets = torch.from_numpy(p.offsets)
            assert torch.equal(dequantize(packed, scales, offsets), weight)  # the default model: exact
            block_bytes += packed.numel() + 4 * (scales.numel() + offsets.numel())
            blocks.append((packed, scales, offsets))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for packed, scales, offsets in blocks:
            dequantize(packed, scales, offsets)
        times.append(time.perf_counter() - start)
    pass_s = min(times)
    alignment = REPO / "tools" / "results" / "bench_alignment_auto.json"
    train_s = json.loads(alignment.read_text())["summary"].get("train_s_per_pair") if alignment.exists() else None
    result = {
        "model": resolved.name, "threads": args.threads, "load_average": os.getloadavg(),
        "float32_linear_mib": round(float_bytes / 2**20, 1), "q4_1_block_mib": round(block_bytes / 2**20, 1),
        "saved_mib_with_one_copy": round((float_bytes - block_bytes) / 2**20, 1),
        "dequantize_all_linears_s": round(pass_s, 3), "passes_per_pair": PASSES_PER_PAIR,
        "added_s_per_pair_with_one_copy": round(PASSES_PER_PAIR * pass_s, 2),
        "train_s_per_pair_two_copies": train_s,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_weight_copy.json").write_text(json.dumps(result, indent=1) + "\n")
    slower = f"{(train_s + result['added_s_per_pair_with_one_copy']) / train_s:.1f}x" if train_s else "n/a"
    md = [
        "# One copy of the base weights or two (bench_weight_copy)", "",
        f"{resolved.name}, {args.threads} thread(s), load average {', '.join(f'{x:.2f}' for x in result['load_average'])}.",
        "", "| | two copies (today) | one copy (QLoRA-style, de-quantised per pass) |", "|---|---|---|",
        f"| linear weights in memory | {result['float32_linear_mib']} MiB float32 + {result['q4_1_block_mib']} MiB "
        f"q4_1 | {result['q4_1_block_mib']} MiB q4_1 |",
        f"| train time per DPO pair | {train_s} s (bench_alignment_auto) | + {PASSES_PER_PAIR} x "
        f"{result['dequantize_all_linears_s']} s de-quantising = {slower} |", "",
        f"One copy would save {result['saved_mib_with_one_copy']} MiB and cost "
        f"{result['added_s_per_pair_with_one_copy']} s of CPU per pair.",
    ]
    (args.out / "bench_weight_copy.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
