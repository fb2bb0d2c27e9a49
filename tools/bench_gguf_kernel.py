"""Times gguf_kernel.matmul on GGUF blocks read in place (issue #28) at Llama-3.2-1B and
Llama-3.1-8B layer shapes, M = 1 and 8 rows, against ONNX Runtime's MatMulNBits as our export uses
it (4-bit block-32 levels with zero points for Q4_K, 8-bit block-16 for Q6_K, accuracy level 4, the
same threads) and torch's matmul on a float32 copy; implementations interleaved round-robin.
Writes tools/results/bench_gguf_kernel.{json,md}."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from edge_runtime.model import gguf_kernel

Q = GGMLQuantizationType
RESULTS = Path(__file__).resolve().parent / "results"
# (name, N, K, type): 1B's FFN up/gate and down, 8B's FFN up/gate, the 1B head as Q4_K_M keeps it.
SHAPES = [("1B ffn up 8192x2048", 8192, 2048, Q.Q4_K), ("1B ffn down 2048x8192", 2048, 8192, Q.Q6_K),
          ("8B ffn up 14336x4096", 14336, 4096, Q.Q4_K), ("1B head 128256x2048", 128256, 2048, Q.Q6_K)]
# Where a block's fp16 scales lie (random bytes elsewhere: every level pattern is valid).
_HALVES = {Q.Q4_K: (0, 2), Q.Q6_K: (208,), Q.Q8_0: (0,), Q.Q4_0: (0,)}


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in _HALVES[qtype]:
        raw[..., at:at + 2] = (rng.uniform(1e-3, 4e-3, (n, k // block)).astype(np.float16)
                               .view(np.uint8).reshape(n, k // block, 2))
    return torch.from_numpy(raw.reshape(n, -1))


def ort_session(n: int, k: int, qtype: GGMLQuantizationType, threads: int):
    """A one-node MatMulNBits graph with the layout our export gives this type (random levels)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    bits, block = (8, 16) if qtype == Q.Q6_K else (4, 32)
    blocks = k // block
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8)
    scales = rng.uniform(1e-3, 4e-3, n * blocks).astype(np.float32)
    zeros = (np.full((n, blocks), 32, np.uint8) if bits == 8
             else np.zeros((n, (blocks + 1) // 2), np.uint8))
    inits = [numpy_helper.from_array(a, name) for a, name in ((packed, "B"), (scales, "scales"), (zeros, "zeros"))]
    node = helper.make_node("MatMulNBits", ["x", "B", "scales", "zeros"], ["y"], domain="com.microsoft",
                            K=k, N=n, bits=bits, block_size=block, accuracy_level=4)
    graph = helper.make_graph([node], "mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def bench_shape(name: str, n: int, k: int, qtype: GGMLQuantizationType, threads: int, repeats: int,
                rows: tuple[int, ...], with_torch: bool) -> list[dict]:
    raw = random_blocks(qtype, n, k)
    sess = ort_session(n, k, qtype, threads)
    dense = gguf_kernel.dequantize(raw, qtype, k) if with_torch else None
    out = []
    for m in rows:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        xn = x.numpy()
        impls = {"gguf_kernel": lambda x=x: gguf_kernel.matmul(x, raw, qtype, k, int8_x=False),
                 "gguf_kernel_int8": lambda x=x: gguf_kernel.matmul(x, raw, qtype, k, int8_x=True),
                 "ort_matmulnbits": lambda xn=xn: sess.run(None, {"x": xn})}
        if dense is not None:
            impls["torch_fp32"] = lambda x=x: x @ dense.T
        times: dict[str, list[float]] = {key: [] for key in impls}
        cpu: dict[str, list[float]] = {key: [] for key in impls}
        for fn in impls.values():
            fn()  # warm-up: first touches, ORT's packing of its own copy
        for _ in range(repeats):
            for key, fn in impls.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                fn()
                times[key].append(time.perf_counter() - start)
                cpu[key].append(time.process_time() - start_cpu)
        row = {"shape": name, "N": n, "K": k, "type": qtype.name, "M": m, "threads": threads,
               "gguf_bytes": int(raw.numel())}
        for key, ts in times.items():
            row[f"{key}_ms_min"] = round(min(ts) * 1e3, 3)
            row[f"{key}_ms_median"] = round(statistics.median(ts) * 1e3, 3)
            row[f"{key}_cpu_ms_median"] = round(statistics.median(cpu[key]) * 1e3, 3)
        row["gguf_GBps_min_time"] = round(raw.numel() / min(times["gguf_kernel"]) / 1e9, 2)
        for key in ("gguf_kernel", "gguf_kernel_int8"):
            row[f"ratio_ort_over_{key}_median"] = round(row["ort_matmulnbits_ms_median"] / row[f"{key}_ms_median"], 3)
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def markdown(result: dict) -> str:
    lines = ["# gguf_kernel.matmul on GGUF blocks vs MatMulNBits and torch fp32 (#28)", "",
             f"`python tools/bench_gguf_kernel.py {' '.join(result['argv'])}`; CPU {result['cpu']}, "
             f"{result['threads']} threads everywhere, compiled kernels: {result['compiled']}; load average at start "
             f"`{result['loadavg_start']}`, at end `{result['loadavg_end']}`. Round-robin: each repeat runs every "
             "implementation once in turn. Each cell: wall ms min / median, then [CPU ms median of the whole "
             "process, all threads]. Ratios: MatMulNBits' median wall time over the kernel's (above 1: the "
             "kernel is faster).", "",
             "| shape | type | M | kernel, f32 x | kernel, int8 x | MatMulNBits (acc. 4) | torch fp32 copy | "
             "MatMulNBits / f32 x | MatMulNBits / int8 x |",
             "|---|---|---|---|---|---|---|---|---|"]

    def cell(r: dict, key: str) -> str:
        if f"{key}_ms_min" not in r:
            return "-"
        return f"{r[key + '_ms_min']} / {r[key + '_ms_median']} [{r[key + '_cpu_ms_median']}]"

    for r in result["rows"]:
        lines.append(f"| {r['shape']} | {r['type']} | {r['M']} | {cell(r, 'gguf_kernel')} | {cell(r, 'gguf_kernel_int8')} | "
                     f"{cell(r, 'ort_matmulnbits')} | {cell(r, 'torch_fp32')} | {r['ratio_ort_over_gguf_kernel_median']} | "
                     f"{r['ratio_ort_over_gguf_kernel_int8_median']} |")
    return "\n".join(lines) + "\n"


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--shapes", default="all", help="comma-separated indices into SHAPES, or all")
    ap.add_argument("--no-torch", action="store_true", help="skip the float32 copy (it is 4 B a weight)")
    ap.add_argument("--name", default="bench_gguf_kernel")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    picked = SHAPES if args.shapes == "all" else [SHAPES[int(i)] for i in args.shapes.split(",")]
    result = {"argv": argv if argv is not None else __import__("sys").argv[1:], "cpu": _cpu(), "threads": args.threads,
              "compiled": gguf_kernel.available(), "loadavg_start": Path("/proc/loadavg").read_text().strip(),
              "rows": []}
    for name, n, k, qtype in picked:
        repeats = max(3, args.repeats // 3) if n * k > 1e8 else args.repeats
        result["rows"] += bench_shape(name, n, k, qtype, args.threads, repeats, (1, 8), not args.no_torch)
    result["loadavg_end"] = Path("/proc/loadavg").read_text().strip()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / f"{args.name}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
