"""Times the Triton kernels that read quantised blocks on a GPU (`edge_runtime.model.qweights_cuda`)
at Llama-3.2-1B's decode shapes, 1 and 16 rows, against torch's F.linear on a float copy (bfloat16),
each call replayed from a CUDA graph (as decode runs it), with the bytes each reads and the
bandwidth that makes against a device-to-device copy measured in the same run. Writes JSON to
--out. `--device cpu` runs tiny shapes through Triton's interpreter (a check of the tool itself).

    python tools/bench_qweights_cuda.py --out tools/results/bench_qweights_cuda.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (name, N, K, format): q|k|v, o, gate|up and down of a layer as a Q4_K_M file keeps them (some
# layers' down in Q6_K), and the tied head in Q6_K.
SHAPES = [("qkv", 3072, 2048, "q4_k"), ("o", 2048, 2048, "q4_k"), ("gate_up", 16384, 2048, "q4_k"),
          ("down", 2048, 8192, "q4_k"), ("down q6_k", 2048, 8192, "q6_k"), ("lm_head", 128256, 2048, "q6_k"),
          ("gate_up q8_0", 16384, 2048, "q8_0")]
TINY = [("qkv", 48, 512, "q4_k"), ("down", 37, 256, "q6_k"), ("head", 40, 256, "q8_0")]


def random_blocks(fmt: str, n: int, k: int, device: str, seed: int = 0):  # noqa: ANN201 - a Blocks
    """Random well-formed blocks of a format (Q4_K, Q6_K, Q8_0 as `gguf_blocks` keeps them)."""
    from edge_runtime.model.qweights import Blocks

    gen = torch.Generator(device=device).manual_seed(seed)

    def ints(lo: int, hi: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=gen, device=device, dtype=torch.int32).to(dtype)

    def halves(shape: tuple[int, ...], size: float) -> torch.Tensor:
        return (torch.rand(shape, generator=gen, device=device) * size).half()

    if fmt == "q4_k":
        nb = k // 32
        return Blocks(levels=ints(0, 256, (n, nb, 16), torch.uint8), scales=halves((n, nb // 8), 0.01),
                      scale_steps=ints(0, 64, (n, nb), torch.uint8), offsets=-halves((n, nb // 8), 0.01),
                      offset_steps=ints(0, 64, (n, nb), torch.uint8), zero=0, bits=4)
    if fmt == "q6_k":
        nb = k // 16
        return Blocks(levels=ints(0, 256, (n, nb, 8), torch.uint8), high=ints(0, 256, (n, nb, 4), torch.uint8),
                      scales=halves((n, nb // 16), 0.001), scale_steps=ints(-128, 128, (n, nb), torch.int8),
                      offsets=None, zero=32, bits=6)
    if fmt == "q8_0":
        nb = k // 32
        return Blocks(levels=ints(-128, 128, (n, nb, 32), torch.int8), scales=halves((n, nb), 0.01),
                      offsets=None, zero=0, bits=8)
    raise ValueError(f"unknown format {fmt!r}: q4_k, q6_k or q8_0")


def per_call_us(fn, calls: int, device: str) -> float:  # noqa: ANN001
    """Microseconds per call of `fn`: on CUDA `calls` calls captured in one graph and replayed (no
    launch gaps, as decode replays its steps), the best of three replays; on the CPU wall time."""
    if device != "cuda":
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls * 1e6
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    best = float("inf")
    for _ in range(3):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, begin.elapsed_time(end) * 1e3 / calls)
    return best


def copy_bandwidth(device: str) -> float | None:
    """A device-to-device copy of 256 MiB: GB/s counting the bytes read and those written."""
    if device != "cuda":
        return None
    src = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    us = per_call_us(lambda: dst.copy_(src), 10, device)
    return 2 * src.numel() / us / 1e3


def run(device: str, tiny: bool, rows_list: list[int]) -> dict:
    from edge_runtime.model import qweights_cuda
    from edge_runtime.model.qweights import QuantWeight

    if qweights_cuda.unavailable():
        raise SystemExit(f"the kernels cannot run: {qweights_cuda.unavailable()}")
    copy = copy_bandwidth(device)
    results = []
    calls = 2 if device != "cuda" else 20
    for name, n, k, fmt in TINY if tiny else SHAPES:
        part = random_blocks(fmt, n, k, device)
        weight = QuantWeight([part])
        dense = part.dequantize_torch(torch.bfloat16) if device == "cuda" else part.dequantize_torch()
        for rows in rows_list:
            dtype = torch.bfloat16 if device == "cuda" else torch.float32
            x = torch.randn(rows, k, device=device, dtype=dtype)
            ours = qweights_cuda.linear(weight.parts, x, None)
            if ours is None:
                raise SystemExit(f"{name}: the kernel declined {rows} rows (see the log)")
            float_weight = dense.to(dtype)
            want = torch.nn.functional.linear(x, float_weight)
            err = ((ours.float() - want.float()).abs().max() / want.float().abs().max()).item()
            kernel_us = per_call_us(lambda x=x, w=weight: qweights_cuda.linear(w.parts, x, None), calls, device)
            torch_us = per_call_us(lambda x=x, d=float_weight: torch.nn.functional.linear(x, d), calls, device)
            gemv_us = None
            if rows == 1:  # the float32 GEMV a single row could take instead of the tl.dot tile
                out = torch.empty(1, n, device=device, dtype=dtype)
                gemv_us = round(per_call_us(lambda x=x, p=part, o=out: qweights_cuda.matmul_into(x, p, o, gemv=True),
                                            calls, device), 2)
            read = part.nbytes + x.numel() * x.element_size() + rows * n * x.element_size()
            gbps = read / kernel_us / 1e3
            results.append({"name": name, "n": n, "k": k, "format": fmt, "rows": rows, "kernel_us": round(kernel_us, 2),
                            "torch_us": round(torch_us, 2), "gemv_us": gemv_us,
                            "torch_GBps": round((float_weight.numel() * float_weight.element_size() + read - part.nbytes)
                                                / torch_us / 1e3, 1), "dtype": str(dtype).removeprefix("torch."), "bytes": read, "kernel_GBps": round(gbps, 1),
                            "of_copy": None if copy is None else round(gbps / copy, 3),
                            "max_rel_err_vs_torch": err})
            print(f"{name:14s} {fmt:5s} M={rows:2d}: {kernel_us:8.2f} us ({gbps:7.1f} GB/s"
                  + ("" if copy is None else f", {gbps / copy:.0%} of copy") + f"), torch {torch_us:8.2f} us," + ("" if gemv_us is None else f" gemv {gemv_us:8.2f} us,") +
                  f" rel err {err:.1e}", flush=True)
    props = torch.cuda.get_device_properties(device) if device == "cuda" else None
    return {"device": props.name if props else "cpu (Triton interpreter)", "torch": torch.__version__,
            "triton": __import__("triton").__version__, "copy_GBps_read_plus_write": copy,
            "timing": "CUDA graph of 20 calls, best of 3 replays" if device == "cuda" else "wall time",
            "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--rows", default="1,16", help="comma-separated row counts (at most 16)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (always on the CPU)")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' module is imported
    elif not torch.cuda.is_available():
        parser.error("no CUDA device (use --device cpu to check the tool on tiny shapes)")
    started = time.perf_counter()
    report = run(args.device, args.tiny or args.device == "cpu", [int(r) for r in args.rows.split(",")])
    report["seconds"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out} in {report['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
