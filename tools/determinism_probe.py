"""Measures what moves a request's greedy logits (#31): the same prompt prefilled in one chunk, in
chunks of 16/32/48 at several offsets, beside other requests' rows, and resuming from a prefix
hit, on torch and ONNX Runtime (the default model); prints max |dlogit| against the one-chunk run.

    python tools/determinism_probe.py [--backend torch|onnxruntime] [--steps 8] [--deterministic]

With --cost, the price of torch's row-invariant path instead: decode tok/s at 1 and 16 streams
and a long prompt's prefill, `engine.deterministic` on and off, round-robin in one process.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge_runtime import Engine, SamplingParams  # noqa: E402
from tests.backends.helpers import run_spying  # noqa: E402

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
          "combined movable metal type, oil-based ink and a wooden press. Explain in simple words why this "
          "invention changed how people in Europe learned, argued and worshipped.")
FILLER = "Tell me a short story about a lighthouse keeper and a cat who both love the sea at night."


DETERMINISTIC = {"deterministic": False}  # --deterministic: torch's row-invariant kernels


def _engine(backend: str, chunk: int, prefix: bool = False) -> Engine:
    extra = {"onnx_quantization": "q4_1"} if backend == "onnxruntime" else dict(DETERMINISTIC)
    return Engine.load(None, backend=backend, dtype="float32", device="cpu", policy="fcfs", cost_profile="off",
                       max_batched_tokens=chunk, kv_cache_bytes=64 << 20, enable_prefix_cache=prefix, **extra)


def _logits(engine: Engine, prompts: list[str], steps: int, which: int = 0) -> tuple[torch.Tensor, list[int]]:
    """Prompt `which`'s logits at each sampling step, and its tokens."""
    rows: dict[str, list[torch.Tensor]] = {}
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)

    def on_step(batch, out: torch.Tensor) -> None:
        for item, row in zip((i for i in batch.items if i.samples), out, strict=True):
            rows.setdefault(item.seq.request.request_id, []).append(row.detach().float().clone())

    outs = run_spying(engine, prompts, [None] * len(prompts), params, on_step)
    return torch.stack(rows[outs[which].request_id]), outs[which].candidates[0].token_ids


def _cost(rounds: int) -> None:
    engines = {on: Engine.load(None, backend="torch", dtype="float32", device="cpu", policy="fcfs",
                               cost_profile="off", kv_cache_bytes=128 << 20, enable_prefix_cache=False,
                               deterministic=on) for on in (False, True)}
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    long_prompt = " ".join([PROMPT] * 5)
    best: dict[tuple[str, bool], float] = {}
    for _ in range(rounds):
        for on, engine in engines.items():
            for streams in (1, 16):
                t = time.perf_counter()
                outs = engine.generate([f"{FILLER} ({i})" for i in range(streams)], params)
                rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)
                best[(f"tok/s at {streams} stream(s)", on)] = max(best.get((f"tok/s at {streams} stream(s)", on), 0),
                                                                  rate)
            t = time.perf_counter()
            engine.generate([long_prompt], SamplingParams(max_tokens=1))
            key = ("long prompt's prefill, s", on)
            best[key] = min(best.get(key, 1e9), time.perf_counter() - t)
    print(f"load average {os.getloadavg()}; best of {rounds} rounds, round-robin")
    for name in dict.fromkeys(k for k, _ in best):
        off, on = best[(name, False)], best[(name, True)]
        print(f"{name:28s} deterministic off {off:8.3f}  on {on:8.3f}  (on/off {on / off:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cost", action="store_true")
    ap.add_argument("--deterministic", action="store_true", help="torch: engine.deterministic on")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.cost:
        _cost(args.rounds)
        return
    DETERMINISTIC["deterministic"] = args.deterministic
    tok = _engine(args.backend, 512).tokenizer
    n = len(tok.hf.encode(PROMPT))
    print(f"backend {args.backend}; prompt {n} tokens (raw, before the chat template)")
    ref, ref_tokens = _logits(_engine(args.backend, 512), [PROMPT], args.steps)
    results = []

    def report(name: str, got: tuple[torch.Tensor, list[int]]) -> None:
        logits, tokens = got
        d = (logits - ref).abs().max().item()
        d0 = (logits[0] - ref[0]).abs().max().item()
        results.append((name, d0, d, tokens == ref_tokens))
        print(f"{name:36s} prefill {d0:.3e}  all steps {d:.3e}  tokens {'same' if tokens == ref_tokens else 'DIFFER'}",
              flush=True)

    report("one chunk, again", _logits(_engine(args.backend, 512), [PROMPT], args.steps))
    for chunk in (16, 32, 48):
        report(f"chunks of {chunk}", _logits(_engine(args.backend, chunk), [PROMPT], args.steps))
    for chunk, lead in ((32, 5), (32, 21), (48, 7)):
        # A shorter request that arrived first takes part of the first budget: our chunks shift.
        filler = " ".join(FILLER.split()[: lead])
        report(f"chunks of {chunk} after a {lead}-word filler",
               _logits(_engine(args.backend, chunk), [filler, PROMPT], args.steps, which=1))
    others = [" ".join(FILLER.split()[: 3 + 2 * i]) for i in range(15)]
    report("beside 15 others (one chunk)", _logits(_engine(args.backend, 4096), [PROMPT] + others, args.steps))
    report("beside 2 others (one chunk)", _logits(_engine(args.backend, 4096), [PROMPT] + others[:2], args.steps))
    engine = _engine(args.backend, 512, prefix=True)
    _logits(engine, [PROMPT[: len(PROMPT) // 2]], 1)
    report("after a prefix hit", _logits(engine, [PROMPT], args.steps))


if __name__ == "__main__":
    main()
