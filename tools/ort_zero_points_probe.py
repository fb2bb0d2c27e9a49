"""Probe (issue #28): a Q4_K weight's per-block offsets as MatMulNBits' float zero points
(zp = 8 - offset / scale, so scale * (q - zp) = scale * (q - 8) + offset) against the exported
form (a 4-bit MatMulNBits plus a float32 MatMul of the input's block sums with the offsets):
whether onnxruntime accepts it at `accuracy_level` 4, the bytes a session packs, speed at 1 and
16 rows (interleaved), and the error against the exact product, on a GGUF's real Q4_K blocks.

    python tools/ort_zero_points_probe.py FILE.gguf [--tensor blk.0.ffn_up.weight] [--rounds 5]
    python tools/ort_zero_points_probe.py --whole-graph {offsets,float-zp} DIR   (a tiny Q4_K_M-like
        model's decode tok/s at 1 and 16 streams; run the two alternately, each in its own process)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MIB = 1 << 20
FORMS = ("offsets-matmul", "float-zero-points", "offsets-matmul-fp16", "offsets-nbits8")


def q4k_part(gguf: str, name: str):
    """The tensor's centred MatMulNBits part (onnx_blocks.block_part: levels, scales, offsets)."""
    from gguf import GGUFReader

    from edge_runtime.backends.onnx_blocks import block_part
    from edge_runtime.model.gguf_blocks import read_blocks, tensor_type

    tensor = next(t for t in GGUFReader(gguf).tensors if t.name == name)
    if tensor_type(tensor) != "Q4_K":
        raise SystemExit(f"{name} is {tensor_type(tensor)}, not Q4_K")
    return block_part(read_blocks(tensor))


def build(part, form: str, folder: Path) -> Path:
    """One-node (or three-node) graph of `form` with external data in `folder`."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nb = part.nbits
    n, k, block = nb.n, nb.k, nb.block_size
    blocks = k // block
    inits, nodes = [], []

    def init(name: str, array: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    ins = ["x", init("qweight", nb.packed), init("scales", nb.scales)]
    if form == "float-zero-points":
        scales = nb.scales.reshape(n, blocks)
        ins.append(init("zeros", (np.float32(8) - part.offsets / scales).astype(np.float32).reshape(-1)))
    nodes.append(helper.make_node("MatMulNBits", ins, ["y" if form == "float-zero-points" else "base"],
                                  domain="com.microsoft", K=k, N=n, bits=4, block_size=block, accuracy_level=4))
    if form != "float-zero-points":
        sum_mat = np.kron(np.eye(blocks, dtype=np.float32), np.ones((block, 1), np.float32))  # [K, K / block]
        init("block_sum", sum_mat)
        offsets = part.offsets.T
        if form == "offsets-nbits8":  # the offsets as 8-bit blocks of 16 along K / block
            from edge_runtime.backends.quantize import pack_nbits

            o8 = pack_nbits(np.ascontiguousarray(part.offsets), 8, block_size=16, symmetric=True)
            nodes.append(helper.make_node("MatMul", ["x", "block_sum"], ["sums"]))
            nodes.append(helper.make_node(
                "MatMulNBits", ["sums", init("offsets.q", o8.packed), init("offsets.scales", o8.scales)], ["shift"],
                domain="com.microsoft", K=blocks, N=n, bits=8, block_size=16, accuracy_level=4))
        elif form == "offsets-matmul-fp16":
            init("offsets", offsets.astype(np.float16))
            nodes.append(helper.make_node("Cast", ["sums32"], ["sums"], to=TensorProto.FLOAT16))
            nodes.append(helper.make_node("MatMul", ["x", "block_sum"], ["sums32"]))
            nodes.append(helper.make_node("MatMul", ["sums", "offsets"], ["shift16"]))
            nodes.append(helper.make_node("Cast", ["shift16"], ["shift"], to=TensorProto.FLOAT))
        else:
            init("offsets", offsets)
            nodes.append(helper.make_node("MatMul", ["x", "block_sum"], ["sums"]))
            nodes.append(helper.make_node("MatMul", ["sums", "offsets"], ["shift"]))
        nodes.append(helper.make_node("Add", ["base", "shift"], ["y"]))
    graph = helper.make_graph(nodes, form, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    path = folder / f"{form}.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location=f"{form}.onnx.data")
    return path


def anon() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) * 1024
    return 0


def open_bytes(path: str) -> dict:
    """In this (fresh) process: anonymous bytes the session's opening adds, or its error."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    before = anon()
    try:
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - a refusal is the answer
        return {"error": f"{type(exc).__name__}: {exc}"[:400]}
    after = anon()
    del session
    return {"anon_mib": round((after - before) / MIB, 1)}


def whole_graph(variant: str, root: Path) -> dict:
    """Decode tok/s of the tiny Q4_K_M-like model's q4_1 graph as exported (`offsets`) or with
    its 4-bit parts' offsets as float zero points (`float-zp`), one thread."""
    from edge_runtime import Engine, SamplingParams
    from edge_runtime.backends import onnx_ort, onnx_spec
    from tests.model.quant_helpers import Q4_K_M_LIKE, tiny_quant_gguf

    if variant == "float-zp":
        exported = onnx_ort.OrtStepWriter.block_matmul

        def block_matmul(self, x, part, name):  # type: ignore[no-untyped-def]
            nb = part.nbits
            if part.offsets is None or nb.bits != 4 or nb.zero_points is not None:
                return exported(self, x, part, name)
            zeros = (np.float32(8) - part.offsets / nb.scales.reshape(nb.n, -1)).astype(np.float32).reshape(-1)
            ins = [x, self.g.init(f"{name}.qweight", nb.packed), self.g.init(f"{name}.scales", nb.scales),
                   self.g.init(f"{name}.zero_points", zeros)]
            return self.g.op("MatMulNBits", ins, domain="com.microsoft", K=nb.k, N=nb.n, bits=4,
                             block_size=nb.block_size, accuracy_level=self.spec.accuracy_level), None

        onnx_ort.OrtStepWriter.block_matmul = block_matmul
        onnx_spec.GRAPH_VERSION = 999  # a key of its own in the probe's cache
    model = root / "model"
    gguf = model / "gguf" / "tiny.gguf"
    if not gguf.exists():
        gguf = tiny_quant_gguf(model, Q4_K_M_LIKE, num_layers=4)[1]
    engine = Engine.load(str(gguf), backend="onnxruntime", onnx_quantization="q4_1", dtype="float32",
                         device="cpu", onnx_cache_dir=str(root / f"onnx-{variant}"), cost_profile="off",
                         speculation="off", num_threads=1)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine.generate([list(range(5, 20))], params)  # warm-up
    rates = {}
    for streams in (1, 16):
        t0 = time.perf_counter()
        outs = engine.generate([list(range(5 + i, 20 + i)) for i in range(streams)], params)
        rates[streams] = round(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0), 1)
    return {"variant": variant, "tok_s": rates, "greedy": outs[0].token_ids[:12],
            "loadavg": Path("/proc/loadavg").read_text().strip()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", nargs="?", default="")
    ap.add_argument("--whole-graph", nargs=2, metavar=("VARIANT", "DIR"))
    ap.add_argument("--tensor", default="blk.0.ffn_up.weight")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--open-bytes", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.open_bytes:
        print(json.dumps(open_bytes(args.open_bytes)))
        return
    if args.whole_graph:
        print(json.dumps(whole_graph(args.whole_graph[0], Path(args.whole_graph[1]))))
        return
    import onnxruntime as ort

    part = q4k_part(args.gguf, args.tensor)
    nb = part.nbits
    result: dict = {"onnxruntime": ort.__version__, "tensor": args.tensor, "n": nb.n, "k": nb.k,
                    "loadavg_start": Path("/proc/loadavg").read_text().strip()}
    # The exact weight in float64: scale * (q - 8) + offset per block, levels unpacked.
    q = np.empty((nb.n, nb.k // 32, 32), np.float64)
    q[..., 0::2], q[..., 1::2] = nb.packed & 0x0F, nb.packed >> 4
    w = ((q - 8) * nb.scales.reshape(nb.n, -1, 1) + part.offsets[..., None]).reshape(nb.n, nb.k)
    rng = np.random.default_rng(0)
    xs = {rows: rng.standard_normal((rows, nb.k)).astype(np.float32) for rows in (1, 16)}
    exact = {rows: xs[rows].astype(np.float64) @ w.T for rows in xs}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {form: build(part, form, Path(tmp)) for form in FORMS}
        result["data_mib"] = {form: round(Path(str(p) + ".data").stat().st_size / MIB, 1) for form, p in paths.items()}
        result["open"] = {}
        for form, path in paths.items():
            out = subprocess.run([sys.executable, __file__, args.gguf, "--open-bytes", str(path)],
                                 capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            result["open"][form] = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 \
                else {"error": out.stderr[-400:]}
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        sessions = {form: ort.InferenceSession(str(p), options, providers=["CPUExecutionProvider"])
                    for form, p in paths.items() if "error" not in result["open"][form]}
        result["error"], result["ms"] = {}, {f"{form}/{rows}": [] for form in sessions for rows in xs}
        for form, s in sessions.items():
            for rows, x in xs.items():
                y = s.run(None, {"x": x})[0].astype(np.float64)
                d = np.abs(y - exact[rows])
                result["error"][f"{form}/{rows}"] = {
                    "max_abs": float(d.max()), "max_rel_to_range": float(d.max() / np.ptp(exact[rows])),
                    "mean_abs": float(d.mean())}
        for _ in range(args.rounds):  # round-robin: the machine's load falls on every form alike
            for form, s in sessions.items():
                for rows, x in xs.items():
                    s.run(None, {"x": x})
                    t0 = time.perf_counter()
                    reps = 20 if rows == 1 else 5
                    for _ in range(reps):
                        s.run(None, {"x": x})
                    result["ms"][f"{form}/{rows}"].append(round((time.perf_counter() - t0) / reps * 1e3, 3))
    result["ms_best"] = {key: min(v) for key, v in result["ms"].items() if v}
    result["loadavg_end"] = Path("/proc/loadavg").read_text().strip()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
