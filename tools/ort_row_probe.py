"""Whether a position's logits on ONNX Runtime depend on how many rows its sequence has in the step
(#31): each decode step's logits, one stream and several, against the same positions computed in
one prefill chunk (`score`), on the default model, q4_1, both KV layouts. With --op, the ops alone:
GroupQueryAttention at one query row (and padded to two) and MatMulNBits at M = 1..33.

    python tools/ort_row_probe.py [--op] [--steps 24] [--layouts dense,paged] [--deterministic]

--deterministic: `engine.deterministic`, where each decode row runs as a two-row query of its own.
With --cost, what that costs: decode tok/s at 1 and 16 streams, on and off, round-robin in one
process (dense layout).

Run it on two trees (PYTHONPATH) to compare a change.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge_runtime import Engine, SamplingParams  # noqa: E402
from tests.backends.helpers import run_spying  # noqa: E402

PROMPTS = ["The history of the printing press begins in the fifteenth century. Explain why it mattered.",
           "Write a short poem about the sea at night.", "What is the capital of Italy? Answer in one sentence."]


def _session(nodes, inputs, outputs, inits=()):
    import onnxruntime as ort
    from onnx import helper

    graph = helper.make_graph(nodes, "probe", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _ops() -> None:
    """The default model's attention shape (9 heads, 3 KV heads, d 64) on random inputs: rows of one
    70-token prompt computed in one call against the same rows over a past, with and without a
    duplicate of the last query row; MatMulNBits (576 -> 1536, 4-bit, block 32) row 0 at M rows
    against M = 16."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    heads, kv_heads, d, n = 9, 3, 64, 70
    f, vi = TensorProto.FLOAT, helper.make_tensor_value_info
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens_k", "total"],
                            ["out", "k_out", "v_out"], domain="com.microsoft", num_heads=heads,
                            kv_num_heads=kv_heads, scale=d ** -0.5)
    gqa = _session([node], [
        vi("q", f, [1, "s", heads * d]), vi("k", f, [1, "s", kv_heads * d]), vi("v", f, [1, "s", kv_heads * d]),
        vi("pk", f, [1, kv_heads, "p", d]), vi("pv", f, [1, kv_heads, "p", d]),
        vi("seqlens_k", TensorProto.INT32, [1]), vi("total", TensorProto.INT32, [])],
        [vi("out", f, [1, "s", heads * d]), vi("k_out", f, None), vi("v_out", f, None)])
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, n, h * d), np.float32) for h in (heads, kv_heads, kv_heads))

    def run(past: int, rows: int, pad: int) -> np.ndarray:
        pk, pv = (np.ascontiguousarray(x.reshape(1, n, kv_heads, d).transpose(0, 2, 1, 3)[:, :, :past]) for x in (k, v))
        qq, kk, vv = (np.concatenate([x[:, past:past + rows]] + [x[:, past + rows - 1:past + rows]] * pad, axis=1)
                      for x in (q, k, v))
        t = past + rows + pad
        out = gqa.run(["out"], {"q": qq, "k": kk, "v": vv, "pk": pk, "pv": pv,
                                "seqlens_k": np.array([t - 1], np.int32), "total": np.array(t, np.int32)})[0]
        return out[:, :rows]

    whole = run(0, n, 0)
    print(f"onnxruntime {ort.__version__}: GroupQueryAttention rows over a past vs the same rows in one {n}-row call")
    for past, rows in ((40, 1), (40, 2), (40, 5), (64, 1), (65, 1), (65, 5), (69, 1)):
        for pad in (0, 1):
            got = np.abs(run(past, rows, pad) - whole[:, past:past + rows]).max()
            print(f"  past {past}, {rows} query row(s){' + 1 duplicate' if pad else '            '}: max |d| {got:.3e}")
    k_in, n_out, block = 576, 1536, 32
    levels = rng.integers(0, 16, (n_out, k_in // block, block), dtype=np.uint8)
    packed = (levels[..., 0::2] | (levels[..., 1::2] << 4)).astype(np.uint8)
    scales = (rng.random(n_out * k_in // block) * 0.01).astype(np.float32)
    x = rng.standard_normal((33, k_in)).astype(np.float32)
    for level in (0, 4):
        node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=k_in, N=n_out, bits=4,
                                block_size=block, accuracy_level=level)
        mm = _session([node], [vi("x", f, ["m", k_in])], [vi("y", f, ["m", n_out])], [
            helper.make_tensor("w", TensorProto.UINT8, packed.shape, packed.tobytes(), raw=True),
            helper.make_tensor("s", f, scales.shape, scales)])
        ref = mm.run(["y"], {"x": x[:16]})[0][0]
        worst = {m: float(np.abs(mm.run(["y"], {"x": x[:m]})[0][0] - ref).max()) for m in (1, 2, 3, 5, 8, 17, 33)}
        print(f"MatMulNBits accuracy_level {level}: row 0 at M rows vs M = 16: "
              + ", ".join(f"M={m} {e:.1e}" for m, e in worst.items()))


def _model(layout: str, steps: int, deterministic: bool) -> None:
    engine = Engine.load(None, backend="onnxruntime", onnx_quantization="q4_1", onnx_kv_layout=layout, policy="fcfs",
                         cost_profile="off", speculation="off", enable_prefix_cache=False, deterministic=deterministic)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    for streams in (1, len(PROMPTS)):
        rows: dict[str, list[torch.Tensor]] = {}

        def on_step(batch, out: torch.Tensor, rows: dict = rows) -> None:
            for item, row in zip((i for i in batch.items if i.samples), out, strict=True):
                rows.setdefault(item.seq.request.request_id, []).append(row.float().clone())

        outs = run_spying(engine, PROMPTS[:streams], [None] * streams, params, on_step)
        worst, flips = 0.0, 0
        for out in outs:
            got = torch.stack(rows[out.request_id])  # the prefill's last row, then one decode row a step
            ids = out.prompt_token_ids
            generated = out.candidates[0].token_ids
            ref = engine.backend.score(list(ids) + generated[:-1])[len(ids) - 1:]
            diff = (got - ref).abs().amax(dim=1)
            worst = max(worst, float(diff[1:].max()))
            flips += int((ref.argmax(dim=1) != got.argmax(dim=1)).sum())
        print(f"{layout:5s} {streams} stream(s): decode rows vs the same positions in one prefill chunk: "
              f"max |dlogit| {worst:.3e}, argmax differs at {flips} of {streams * steps} positions")


def _cost(rounds: int, tokens: int) -> None:
    import time

    engines = {on: Engine.load(None, backend="onnxruntime", onnx_quantization="q4_1", cost_profile="off",
                               speculation="off", enable_prefix_cache=False, deterministic=on) for on in (False, True)}
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    best: dict[tuple[int, bool], float] = {}
    for _ in range(rounds):
        for streams in (1, 16):
            for on, engine in engines.items():
                prompts = [PROMPTS[i % len(PROMPTS)] for i in range(streams)]
                for p in prompts:
                    engine.add_request(p, params)
                sched = engine.scheduler
                while sched.waiting or any(seq.in_prefill for seq in sched.running):  # decode alone is timed
                    engine.step()
                before = sum(len(seq.token_ids) - seq.num_prompt for seq in sched.running)
                start = time.perf_counter()
                while engine.has_unfinished():
                    engine.step()
                rate = (streams * tokens - before) / (time.perf_counter() - start)
                best[(streams, on)] = max(best.get((streams, on), 0.0), rate)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"decode tok/s, best of {rounds} round-robin rounds, {tokens} tokens a stream, load {' '.join(load)}")
    for streams in (1, 16):
        off, on = best[(streams, False)], best[(streams, True)]
        print(f"  {streams:2d} stream(s): deterministic off {off:7.1f}, on {on:7.1f} ({on / off:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", action="store_true", help="the ops alone, on random inputs")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--layouts", default="dense,paged")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--cost", action="store_true", help="decode tok/s with and without engine.deterministic")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.op:
        _ops()
        return
    if args.cost:
        _cost(args.rounds, args.steps)
        return
    for layout in args.layouts.split(","):
        _model(layout, args.steps, args.deterministic)


if __name__ == "__main__":
    main()
