"""Times the torch forward and one staged DPO pair over a GGUF's quantised blocks against the
float model de-quantised from them (issue #28: the cost of one copy of the weights), and how much
of the blocks' time is de-quantisation. Writes tools/results/quant_speed.json and .md."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from edge_runtime.model import qkernel
from edge_runtime.model.dense import dense_logits
from edge_runtime.model.gguf_load import dequantized_copy, load_llama_gguf
from edge_runtime.model.qweights import QuantWeight


def _best(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch allocations and oneDNN's kernel choice
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _dequant_seconds(model, repeats: int) -> float:
    weights = [m for m in model.modules() if isinstance(m, QuantWeight)]

    def run() -> None:
        for w in weights:
            for _, part in w.row_chunks():
                part.dequantize()
    return _best(run, repeats)


def _forwards(model, vocab: int, repeats: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    out = {}
    with torch.no_grad():
        for n in (64, 1):
            ids = torch.randint(3, vocab, (1, n), generator=gen)
            out[f"forward_{n}_s"] = _best(lambda ids=ids: dense_logits(model, ids), repeats)
    return out


def _dpo_pair_seconds(model, tokenizer_dir: Path | None, repeats: int) -> float | None:
    if tokenizer_dir is None:
        return None
    from edge_runtime.model.tokenizer import Tokenizer
    from tests.train.helpers import make_trainer, preference_records, staged_grads

    trainer = make_trainer(model, Tokenizer(tokenizer_dir), window=None, group=2)
    pair = preference_records()[:1]
    return _best(lambda: staged_grads(trainer, pair), repeats)


def _int4_kernel_probe(model, repeats: int) -> dict | None:
    """PyTorch's weight-only int4 CPU matmul on layer 0's 4-bit 32-blocks (Q4_0/Q4_1/Q4_K):
    how exactly `(q - 8) * scale + zero` holds our `scale * (q - z) + offset` (zero folds the
    offset in, rounded once in float32), and its time against de-quantise-then-linear."""
    op = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
    pack = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
    layer = model.layers[0]
    parts = [(name, p) for name in ("qkv_weight", "gate_up_weight", "o_weight", "down_weight")
             if isinstance(getattr(layer, name), QuantWeight)
             for p in getattr(layer, name).parts if p.bits == 4 and p.block == 32]
    if op is None or pack is None or not parts:
        return None
    out = {}
    for name, part in parts:
        q = part.unpacked().reshape(part.n, part.k).to(torch.int32)
        s = part.scale_per_block()
        o = part.offset_per_block()
        zero = s * float(8 - part.zero) + (0.0 if o is None else o)  # the kernel's per-group zero
        w_kernel = ((q.view(part.n, -1, 32).float() - 8) * s.unsqueeze(-1) + zero.unsqueeze(-1)).view(part.n, part.k)
        w = part.dequantize()
        packed = pack(q, 1)
        row = {"rows": part.n, "k": part.k,
               "weights_differing": int((w_kernel != w).sum()), "weight_max_abs_diff": (w_kernel - w).abs().max().item()}
        for dtype in (torch.float32, torch.bfloat16):
            sz = torch.stack((s.t(), zero.t()), -1).to(dtype).contiguous()
            for m in (1, 64):
                x = torch.randn(m, part.k).to(dtype)
                key = f"{str(dtype).split('.')[-1]}_m{m}"
                row[f"int4mm_{key}_ms"] = 1e3 * _best(lambda x=x, sz=sz, packed=packed: op(x, packed, 32, sz), 1 if dtype == torch.float32 and m == 64 else repeats)
                row[f"dequant_linear_{key}_ms"] = 1e3 * _best(lambda x=x, dtype=dtype, part=part: torch.nn.functional.linear(x, part.dequantize(dtype)), repeats)
                if dtype == torch.bfloat16:
                    row[f"int4mm_{key}_max_abs_diff_vs_dequant_linear"] = (
                        op(x, packed, 32, sz).float() - torch.nn.functional.linear(x, w.to(dtype)).float()).abs().max().item()
        out[name] = row
    return out


def _logit_diff(a, b, vocab: int) -> float:
    ids = torch.randint(3, vocab, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (dense_logits(a, ids) - dense_logits(b, ids)).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--tokenizer", type=Path, default=None, help="an HF folder with the tokenizer (for DPO)")
    parser.add_argument("--label", default="")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-float", action="store_true", help="skip the float copy (too large)")
    parser.add_argument("--probe-only", action="store_true", help="only the int4 kernel probe (large files)")
    parser.add_argument("--no-kernel", action="store_true", help="skip the int4 kernel probe")
    parser.add_argument("--out", type=Path, default=None, help="append the record to this JSON list")
    args = parser.parse_args()
    torch.set_num_threads(1)
    quant = load_llama_gguf(args.gguf)
    vocab = quant.cfg.vocab_size
    record = {"model": args.gguf.name, "label": args.label, "threads": 1,
              "loadavg": Path("/proc/loadavg").read_text().split()[:3],
              "dequantize": "compiled (qkernel)" if qkernel.available(torch.empty(0, dtype=torch.uint8))
              else "torch passes"}
    if args.probe_only:
        record["int4_kernel"] = _int4_kernel_probe(quant, args.repeats)
        print(json.dumps(record, indent=1))
        if args.out:
            records = json.loads(args.out.read_text()) if args.out.exists() else []
            args.out.write_text(json.dumps(records + [record], indent=1) + "\n")
        return
    record["blocks"] = {"dequantize_all_s": _dequant_seconds(quant, args.repeats), **_forwards(quant, vocab, args.repeats),
                        "dpo_pair_s": _dpo_pair_seconds(quant, args.tokenizer, args.repeats)}
    record["int4_kernel"] = None if args.no_kernel else _int4_kernel_probe(quant, args.repeats)
    if not args.no_float:
        floats = dequantized_copy(quant)
        record["float"] = {**_forwards(floats, vocab, args.repeats),
                           "dpo_pair_s": _dpo_pair_seconds(floats, args.tokenizer, args.repeats)}
        record["logits_max_abs_diff"] = _logit_diff(quant, floats, vocab)
    record["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    print(json.dumps(record, indent=1))
    if args.out:
        records = json.loads(args.out.read_text()) if args.out.exists() else []
        args.out.write_text(json.dumps(records + [record], indent=1) + "\n")


if __name__ == "__main__":
    main()
