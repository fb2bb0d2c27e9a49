"""Times gguf_kernel.matmul on GGUF blocks read in place (issue #28) at Llama-3.2-1B/3B and
Llama-3.1-8B layer shapes, M = 1 and 8 rows, against ONNX Runtime's MatMulNBits as our export uses
it (4-bit block-32 levels with zero points for Q4_K and Q8_0, 8-bit block-16 for Q6_K, accuracy
level 4, the same threads) and optionally torch's matmul on a float32 copy; implementations
interleaved round-robin, each call on another copy of the weights (at least COLD_BYTES in all, past
the last-level cache: a decode step streams the whole model). Also this machine's read bandwidth
(summing a 1 GiB float32 tensor on the same threads) and, with --model, one token's products: every
block matrix of a GGUF file (the head included) at M = 1. Writes tools/results/bench_gguf_kernel.{json,md}."""

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
from edge_runtime.model.gguf_kernel import row_bytes

Q = GGMLQuantizationType
RESULTS = Path(__file__).resolve().parent / "results"
# (name, N, K, type): the FFN, attention and head matrices of Llama-3.2-1B/3B and 3.1-8B as Q4_K_M keeps
# them (and a Q8_0 FFN).
SHAPES = [("1B ffn up 8192x2048", 8192, 2048, Q.Q4_K), ("1B ffn down 2048x8192", 2048, 8192, Q.Q6_K),
          ("1B head 128256x2048", 128256, 2048, Q.Q6_K), ("3B ffn up 8192x3072", 8192, 3072, Q.Q4_K),
          ("3B ffn down 3072x8192", 3072, 8192, Q.Q6_K), ("1B q/o 2048x2048", 2048, 2048, Q.Q4_K),
          ("1B k/v 512x2048", 512, 2048, Q.Q4_K), ("3B q/o 3072x3072", 3072, 3072, Q.Q4_K),
          ("3B k/v 1024x3072", 1024, 3072, Q.Q6_K), ("8B ffn up 14336x4096", 14336, 4096, Q.Q4_K),
          ("1B ffn up 8192x2048 Q8_0", 8192, 2048, Q.Q8_0)]
_ORT_LAYOUT = {Q.Q6_K: (8, 16), Q.Q8_0: (8, 32)}  # (bits, block) of our export; 4-bit block 32 otherwise
COLD_BYTES = 96 << 20  # weights each implementation cycles through (3x this machine's 32 MiB L3)
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


def ort_session(n: int, k: int, qtype: GGMLQuantizationType, threads: int, seed: int = 1):
    """A one-node MatMulNBits graph with the layout our export gives this type (random levels)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    bits, block = _ORT_LAYOUT.get(qtype, (4, 32))
    blocks = k // block
    rng = np.random.default_rng(seed)
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


def ort_bytes(n: int, k: int, qtype: GGMLQuantizationType) -> int:
    """Bytes MatMulNBits reads per product: its levels, float32 scales and zero points."""
    bits, block = _ORT_LAYOUT.get(qtype, (4, 32))
    blocks = k // block
    return n * (k * bits // 8 + 4 * blocks + (blocks if bits == 8 else (blocks + 1) // 2))


def read_bandwidth(threads: int, repeats: int = 7) -> float:
    """GB/s of summing a 1 GiB float32 tensor on `threads` threads (the best of `repeats`)."""
    torch.set_num_threads(threads)
    big = torch.ones(1 << 28, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - start)
    return round(big.numel() * 4 / best / 1e9, 2)


def bench_model(path: str, repeats: int) -> dict:
    """One token's products, M = 1: every 2-D block matrix of the GGUF file (the head included; a
    tied head is the embedding) in file order, int8 x and float x; median and min ms of `repeats`."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    mats = []
    for t in reader.tensors:
        if len(t.shape) == 2 and t.tensor_type in gguf_kernel.SUPPORTED and GGML_QUANT_SIZES[t.tensor_type][0] > 1:
            k, n = int(t.shape[0]), int(t.shape[1])
            mats.append((torch.from_numpy(np.asarray(t.data).view(np.uint8).reshape(n, -1)), t.tensor_type, k))
    if not any(t.name == "output.weight" for t in reader.tensors):  # tied: the embedding is the head
        assert any(t.name == "token_embd.weight" for t in reader.tensors)
    row = {"model": Path(path).name, "matrices": len(mats), "file_bytes_read": int(sum(r.numel() for r, _, _ in mats))}
    xs = {k: torch.randn(1, k) for _, _, k in mats}
    for key, int8 in (("int8", True), ("f32", False)):
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for raw, qtype, k in mats:
                gguf_kernel.matmul(xs[k], raw, qtype, k, int8_x=int8)
            times.append(time.perf_counter() - start)
        times = times[1:]
        row[f"{key}_token_ms_median"] = round(statistics.median(times) * 1e3, 2)
        row[f"{key}_token_ms_min"] = round(min(times) * 1e3, 2)
        row[f"{key}_GBps_median"] = round(row["file_bytes_read"] / statistics.median(times) / 1e9, 2)
    print(json.dumps(row), flush=True)
    return row


def bench_shape(name: str, n: int, k: int, qtype: GGMLQuantizationType, threads: int, repeats: int,
                rows: tuple[int, ...], with_torch: bool) -> list[dict]:
    copies = max(1, min(64, -(-COLD_BYTES // (n * row_bytes(qtype, k)))))
    raws = [random_blocks(qtype, n, k, seed=c) for c in range(copies)]
    raw = raws[0]
    sessions = [ort_session(n, k, qtype, threads, seed=1 + c) for c in range(copies)]
    dense = gguf_kernel.dequantize(raw, qtype, k) if with_torch else None
    out = []
    for m in rows:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        xn = x.numpy()
        impls = {"gguf_kernel": lambda c, x=x: gguf_kernel.matmul(x, raws[c], qtype, k, int8_x=False),
                 "gguf_kernel_int8": lambda c, x=x: gguf_kernel.matmul(x, raws[c], qtype, k, int8_x=True),
                 "ort_matmulnbits": lambda c, xn=xn: sessions[c].run(None, {"x": xn})}
        if dense is not None:
            impls["torch_fp32"] = lambda c, x=x: x @ dense.T
        times: dict[str, list[float]] = {key: [] for key in impls}
        cpu: dict[str, list[float]] = {key: [] for key in impls}
        for fn in impls.values():
            for c in range(copies):
                fn(c)  # warm-up: first touches, ORT's packing of its own copy
        for rep in range(max(repeats, min(copies, 3 * repeats))):
            for key, fn in impls.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                fn(rep % copies)
                times[key].append(time.perf_counter() - start)
                cpu[key].append(time.process_time() - start_cpu)
        row = {"shape": name, "N": n, "K": k, "type": qtype.name, "M": m, "threads": threads,
               "gguf_bytes": int(raw.numel()), "ort_bytes": ort_bytes(n, k, qtype), "copies": copies}
        for key, ts in times.items():
            row[f"{key}_ms_min"] = round(min(ts) * 1e3, 3)
            row[f"{key}_ms_median"] = round(statistics.median(ts) * 1e3, 3)
            row[f"{key}_cpu_ms_median"] = round(statistics.median(cpu[key]) * 1e3, 3)
        for key in ("gguf_kernel", "gguf_kernel_int8", "ort_matmulnbits"):
            nbytes = row["ort_bytes"] if key == "ort_matmulnbits" else row["gguf_bytes"]
            row[f"{key}_GBps_median"] = round(nbytes / statistics.median(times[key]) / 1e9, 2)
        for key in ("gguf_kernel", "gguf_kernel_int8"):
            row[f"ratio_ort_over_{key}_median"] = round(row["ort_matmulnbits_ms_median"] / row[f"{key}_ms_median"], 3)
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def markdown(result: dict) -> str:
    lines = ["# gguf_kernel.matmul on GGUF blocks vs MatMulNBits (#28)", "",
             f"`python tools/bench_gguf_kernel.py {' '.join(result['argv'])}`; CPU {result['cpu']}, "
             f"{result['threads']} threads everywhere, compiled kernels: {result['compiled']}; load average at start "
             f"`{result['loadavg_start']}`, at end `{result['loadavg_end']}`. Read bandwidth (summing a 1 GiB float32 "
             f"tensor, {result['threads']} threads): **{result['read_GBps']} GB/s**. Round-robin: each repeat runs every "
             "implementation once in turn, each call on another copy of the weights (`copies`, at least 96 MiB in all: "
             "read from memory, as in a decode step). Each cell: wall ms min / median [GB/s at the median: the file's "
             "bytes for the kernel, MatMulNBits' own bytes for it]. Ratios: MatMulNBits' median wall time over the "
             "kernel's (above 1: the kernel is faster).", "",
             "| shape | type | M | copies | kernel, int8 x | kernel, f32 x | MatMulNBits (acc. 4) | MNB / int8 x | "
             "MNB / f32 x |",
             "|---|---|---|---|---|---|---|---|---|"]

    def cell(r: dict, key: str) -> str:
        if f"{key}_ms_min" not in r:
            return "-"
        return f"{r[key + '_ms_min']} / {r[key + '_ms_median']} [{r[key + '_GBps_median']}]"

    for r in result["rows"]:
        lines.append(f"| {r['shape']} | {r['type']} | {r['M']} | {r['copies']} | {cell(r, 'gguf_kernel_int8')} | "
                     f"{cell(r, 'gguf_kernel')} | {cell(r, 'ort_matmulnbits')} | "
                     f"{r['ratio_ort_over_gguf_kernel_int8_median']} | {r['ratio_ort_over_gguf_kernel_median']} |")
    for r in result.get("models", []):
        lines += ["", f"One token's products through the kernel, M = 1, `{r['model']}`: {r['matrices']} block matrices, "
                  f"{r['file_bytes_read'] / 1e6:.1f} MB of the file: int8 x {r['int8_token_ms_median']} ms median "
                  f"({r['int8_token_ms_min']} min; {r['int8_GBps_median']} GB/s), float x {r['f32_token_ms_median']} ms "
                  f"({r['f32_token_ms_min']} min; {r['f32_GBps_median']} GB/s)."]
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
    ap.add_argument("--torch", action="store_true", help="also torch's matmul on a float32 copy (4 B a weight)")
    ap.add_argument("--model", action="append", default=[], help="a GGUF file: time one token's products (repeatable)")
    ap.add_argument("--name", default="bench_gguf_kernel")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    picked = SHAPES if args.shapes == "all" else [SHAPES[int(i)] for i in args.shapes.split(",")]
    result = {"argv": argv if argv is not None else __import__("sys").argv[1:], "cpu": _cpu(), "threads": args.threads,
              "compiled": gguf_kernel.available(), "loadavg_start": Path("/proc/loadavg").read_text().strip(),
              "read_GBps": read_bandwidth(args.threads), "rows": []}
    torch.set_num_threads(args.threads)
    for name, n, k, qtype in picked:
        repeats = max(3, args.repeats // 3) if n * k > 1e8 else args.repeats
        result["rows"] += bench_shape(name, n, k, qtype, args.threads, repeats, (1, 8), args.torch)
    result["models"] = [bench_model(path, args.repeats) for path in args.model]
    result["loadavg_end"] = Path("/proc/loadavg").read_text().strip()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / f"{args.name}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
