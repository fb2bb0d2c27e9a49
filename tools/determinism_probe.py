"""Measures what moves a request's greedy logits (#31): the same prompt prefilled in one chunk, in
chunks of 16/32/48 at several offsets, with its last row alone, under `mace` as the model-level
test runs it, beside other requests' rows, and resuming from a prefix hit, on torch and ONNX
Runtime (the default model); prints max |dlogit| against the one-chunk run and each case's chunk
layout (start:rows of every forward that fed the prompt), so a moving case can be replayed.

    python tools/determinism_probe.py [--backend torch|onnxruntime] [--steps 8] [--deterministic]

With --throughput, what the grid costs: tok/s (prefill included) at 1 and 8 concurrent chats of
~200 prompt tokens under `mace` on the backend; run it on two trees, alternated, to compare.

With --op, ONNX Runtime's GroupQueryAttention alone: a prompt's rows computed in one call
against the same rows computed over a past (1 query row: the decode kernel; 2 or more: the
prompt's).

With --beside, torch's decode rows beside a longer context (what the key tiles fixed): a
2-token prompt beside a 57-token one and a 337-token one beside a 673-token one, max |dlogit|
of the first prompt's every step against it alone, engine.deterministic off and on.

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


def _engine(backend: str, chunk: int, prefix: bool = False, **overrides) -> Engine:
    extra = {"onnx_quantization": "q4_1"} if backend == "onnxruntime" else dict(DETERMINISTIC)
    settings = dict(dtype="float32", device="cpu", policy="fcfs", cost_profile="off", max_batched_tokens=chunk,
                    kv_cache_bytes=64 << 20, enable_prefix_cache=prefix)
    return Engine.load(None, backend=backend, **{**settings, **extra, **overrides})


def _logits(engine: Engine, prompts: list[str], steps: int, which: int = 0) -> tuple[torch.Tensor, list[int], str]:
    """Prompt `which`'s logits at each sampling step, its tokens, and its prefill's chunk layout."""
    rows: dict[str, list[torch.Tensor]] = {}
    chunks: dict[str, list[str]] = {}
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)

    def on_step(batch, out: torch.Tensor) -> None:
        for item in batch.items:
            if item.seq.num_computed < item.seq.num_prompt:
                chunks.setdefault(item.seq.request.request_id, []).append(f"{item.seq.num_computed}:{item.num_tokens}")
        for item, row in zip((i for i in batch.items if i.samples), out, strict=True):
            rows.setdefault(item.seq.request.request_id, []).append(row.detach().float().clone())

    outs = run_spying(engine, prompts, [None] * len(prompts), params, on_step)
    rid = outs[which].request_id
    return torch.stack(rows[rid]), outs[which].candidates[0].token_ids, " ".join(chunks[rid])


def _gqa_op() -> None:
    """GroupQueryAttention on random inputs at the default model's head shape: rows of one
    37-token prompt in one call against the same rows over a past."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    heads, kv_heads, d, n = 14, 2, 64, 37
    f, vi = TensorProto.FLOAT, helper.make_tensor_value_info
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens_k", "total"],
                            ["out", "k_out", "v_out"], domain="com.microsoft", num_heads=heads,
                            kv_num_heads=kv_heads, scale=d ** -0.5)
    graph = helper.make_graph([node], "gqa", [
        vi("q", f, [1, "s", heads * d]), vi("k", f, [1, "s", kv_heads * d]), vi("v", f, [1, "s", kv_heads * d]),
        vi("pk", f, [1, kv_heads, "p", d]), vi("pv", f, [1, kv_heads, "p", d]),
        vi("seqlens_k", TensorProto.INT32, [1]), vi("total", TensorProto.INT32, [])],
        [vi("out", f, [1, "s", heads * d]), vi("k_out", f, None), vi("v_out", f, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, n, h * d), np.float32) for h in (heads, kv_heads, kv_heads))

    def run(past: int) -> np.ndarray:
        pk, pv = (np.ascontiguousarray(x.reshape(1, n, kv_heads, d).transpose(0, 2, 1, 3)[:, :, :past]) for x in (k, v))
        return session.run(["out"], {"q": q[:, past:], "k": k[:, past:], "v": v[:, past:], "pk": pk, "pv": pv,
                                     "seqlens_k": np.array([n - 1], np.int32), "total": np.array(n, np.int32)})[0]

    whole = run(0)
    print(f"onnxruntime {ort.__version__}: GroupQueryAttention, {n}-token prompt, rows over a past vs one call")
    for past in (16, 32, 35, 36):
        print(f"  past {past:2d}, {n - past:2d} query row(s): max |d| {np.abs(run(past) - whole[:, past:]).max():.3e}")


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


def _beside() -> None:
    words = FILLER.split()
    for on in (False, True):
        DETERMINISTIC["deterministic"] = on
        engine = _engine("torch", 1024)
        for short, long_ in ((words[0], " ".join(words * 3)), (" ".join(words * 17), " ".join(words * 34))):
            alone, _, _ = _logits(engine, [short], 3)
            both, _, _ = _logits(engine, [short, long_], 3)
            n = [len(engine.tokenizer.hf.encode(p)) for p in (short, long_)]
            print(f"deterministic {on!s:5s}: {n[0]:4d} tokens beside {n[1]:4d}: max |d| "
                  f"{(alone - both).abs().max().item():.3e}  (load {os.getloadavg()[0]:.1f})", flush=True)


def _throughput(backend: str, rounds: int) -> None:
    extra = {"onnx_quantization": "q4_1"} if backend == "onnxruntime" else {}
    engine = Engine.load(None, backend=backend, dtype="float32", device="cpu", policy="mace", cost_profile="off",
                         kv_cache_bytes=128 << 20, enable_prefix_cache=False, **extra)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    best: dict[int, float] = {}
    for _ in range(rounds):
        for streams in (1, 8):
            prompts = [f"{PROMPT} {FILLER} ({i})" * 2 for i in range(streams)]
            t = time.perf_counter()
            outs = engine.generate(prompts, params)
            best[streams] = max(best.get(streams, 0.0),
                                sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t))
    print(f"load average {os.getloadavg()}; best of {rounds}: "
          + "  ".join(f"{k} stream(s) {v:.2f} tok/s" for k, v in best.items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cost", action="store_true")
    ap.add_argument("--beside", action="store_true", help="torch decode rows beside a longer context")
    ap.add_argument("--deterministic", action="store_true", help="torch: engine.deterministic on")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--op", action="store_true", help="ONNX Runtime's GroupQueryAttention alone")
    ap.add_argument("--throughput", action="store_true", help="tok/s at 1 and 8 chats under mace")
    args = ap.parse_args()
    if args.throughput:
        _throughput(args.backend, args.rounds)
        return
    if args.op:
        _gqa_op()
        return
    if args.cost:
        _cost(args.rounds)
        return
    if args.beside:
        _beside()
        return
    DETERMINISTIC["deterministic"] = args.deterministic
    tok = _engine(args.backend, 512).tokenizer
    n = len(tok.hf.encode(PROMPT))
    print(f"backend {args.backend}; prompt {n} tokens (raw, before the chat template)")
    ref, ref_tokens, layout = _logits(_engine(args.backend, 512), [PROMPT], args.steps)
    print(f"one chunk: {layout}")
    results = []

    def report(name: str, got: tuple[torch.Tensor, list[int], str]) -> None:
        logits, tokens, layout = got
        d = (logits - ref).abs().max().item()
        d0 = (logits[0] - ref[0]).abs().max().item()
        results.append((name, d0, d, tokens == ref_tokens))
        print(f"{name:36s} prefill {d0:.3e}  all steps {d:.3e}  tokens {'same' if tokens == ref_tokens else 'DIFFER'}"
              f"  chunks {layout}", flush=True)

    report("one chunk, again", _logits(_engine(args.backend, 512), [PROMPT], args.steps))
    for chunk in (16, 32, 48):
        report(f"chunks of {chunk}", _logits(_engine(args.backend, chunk), [PROMPT], args.steps))
    # A budget one row short of the prompt: before the grid its last row ran alone (the decode path).
    rows = int(layout.split(":")[1])
    report(f"max_batched_tokens {rows - 1} (prompt - 1)", _logits(_engine(args.backend, rows - 1), [PROMPT], args.steps))
    # A budget under the grid's chunk: rows one at a time, each through the decode path.
    report("chunks of 1 (max_batched_tokens 1)", _logits(_engine(args.backend, 1), [PROMPT], args.steps))
    # The model-level test's setting (tests/engine/test_determinism.py): a 10 ms TBT SLO with
    # calibration off packs a few rows per iteration; before the grid its last chunk was one row.
    report("mace, calibration off, 10 ms TBT", _logits(_engine(args.backend, 512, policy="mace", slo_tbt_ms=10.0),
                                                       [PROMPT], args.steps))
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
