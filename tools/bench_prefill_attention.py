"""Times the compiled prefill attention alone (kv/attention.c `prefill_attention`) at Llama-3.2-1B's
shape (32 heads over 8 KV heads of 64, float32 cache): chunks of 16, 64 and 256 rows over pasts of 0 to
8,192 keys, this tree's build against another git ref's attention.c (default main: the A/B in one run,
same load, interleaved), with torch's `attend` (the GEMM path a chunk takes without the kernel) for
reference; and decode rows (`decode_attention`, which shares the kernel's pass) of 1 and 8 sequences over
the same contexts, before and after. Checks the two builds' rows are the same bits. Writes
tools/results/bench_prefill_attention.{json,md}."""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from edge_runtime.kv import attention_kernel
from edge_runtime.kv.paged_attention import attend
from edge_runtime.model.qkernel import build_library

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
HEADS, KV_HEADS, D, BLOCK = 32, 8, 64, 16


def library_at(ref: str) -> ctypes.CDLL:
    """`ref`'s attention.c built as the engine builds it (same flags)."""
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{ref}:edge_runtime/kv/attention.c"], check=True,
                            capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory(prefix="bench-prefill-attn-") as tmp:
        path = Path(tmp) / "attention.c"
        path.write_text(source)
        lib = build_library(path, attention_kernel._FLAGS)
    lib.prefill_attention.argtypes = attention_kernel._library().prefill_attention.argtypes
    lib.prefill_attention.restype = ctypes.c_int
    return lib


def chunk(n: int, past: int, seed: int = 0):
    """Caches holding the chunk's and its past's keys in shuffled blocks of 16 slots, q [n, heads, d],
    and the rows' (slots, starts, lens, rows): each its causal prefix."""
    g = torch.Generator().manual_seed(seed)
    ctx = past + n
    blocks = -(-ctx // BLOCK)
    k_cache, v_cache = (torch.randn(blocks * BLOCK, KV_HEADS, D, generator=g) for _ in range(2))
    order = torch.randperm(blocks, generator=g)
    slots = (order[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:ctx].contiguous()
    q = torch.randn(n, HEADS, D, generator=g)
    lens = torch.arange(past + 1, ctx + 1)
    return k_cache, v_cache, q, slots, torch.zeros(n, dtype=torch.long), lens, torch.arange(n)


def compiled(lib: ctypes.CDLL, k_cache, v_cache, q, slots, starts, lens, rows, out) -> None:
    n, width = q.shape[0], int(lens.max())
    scratch = attention_kernel.prefill_scratch(HEADS, D, width)  # the larger of the two builds' formulas
    rc = lib.prefill_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                               starts.data_ptr(), lens.data_ptr(), rows.data_ptr(), 0, n, width, HEADS, KV_HEADS, D,
                               D ** -0.5, 0.0, out.data_ptr(), out.stride(0), 0, scratch.data_ptr())
    assert rc == 0


def torch_attend(k_cache, v_cache, q, slots, past: int) -> torch.Tensor:
    """The chunk through torch's `attend` as PagedContext runs it without the kernel (GQA folded)."""
    n, group = q.shape[0], HEADS // KV_HEADS
    qh = q.view(n, KV_HEADS, group, D).permute(1, 2, 0, 3).reshape(KV_HEADS, group * n, D)
    kh = k_cache.index_select(0, slots).transpose(0, 1)
    vh = v_cache.index_select(0, slots).transpose(0, 1)
    mask = torch.ones(n, past + n, dtype=torch.bool).tril(past)
    o = attend(qh, kh, vh, mask.repeat(group, 1))
    return o.view(KV_HEADS, group, n, D).permute(2, 0, 1, 3).reshape(n, HEADS * D)


def timed(impls: dict, repeats: int) -> dict:
    """Each call once to warm up, then `repeats` rounds of them all in turn: ms median and min of each, and
    before over after."""
    times: dict[str, list[float]] = {key: [] for key in impls}
    for fn in impls.values():
        fn()
    for _ in range(repeats):
        for key, fn in impls.items():
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    row = {}
    for key, ts in times.items():
        row[f"{key}_ms_median"] = round(statistics.median(ts) * 1e3, 3)
        row[f"{key}_ms_min"] = round(min(ts) * 1e3, 3)
    row["speedup_median"] = round(row["before_ms_median"] / row["after_ms_median"], 2)
    row["speedup_min"] = round(row["before_ms_min"] / row["after_ms_min"], 2)
    return row


def bench_cell(before: ctypes.CDLL, after: ctypes.CDLL, n: int, past: int, repeats: int) -> dict:
    """One chunk of n rows over `past` keys: the two builds and torch, interleaved."""
    args = chunk(n, past)
    k_cache, v_cache, q, slots = args[:4]
    outs = {key: torch.empty(n, HEADS * D) for key in ("before", "after")}
    impls = {"before": lambda: compiled(before, *args, outs["before"]),
             "after": lambda: compiled(after, *args, outs["after"]),
             "torch": lambda: torch_attend(k_cache, v_cache, q, slots, past)}
    row = {"rows": n, "past": past, **timed(impls, repeats)}
    row["same_bits"] = bool(torch.equal(outs["before"], outs["after"]))
    print(json.dumps(row), flush=True)
    return row


def decode_cell(before: ctypes.CDLL, after: ctypes.CDLL, batch: int, context: int, repeats: int) -> dict:
    """`batch` decode rows, each its own sequence of `context` keys (shuffled blocks): the two builds."""
    g = torch.Generator().manual_seed(batch)
    blocks = context // BLOCK
    k_cache, v_cache = (torch.randn(batch * blocks * BLOCK, KV_HEADS, D, generator=g) for _ in range(2))
    index = torch.stack([(torch.randperm(batch * blocks, generator=g)[:blocks, None] * BLOCK
                          + torch.arange(BLOCK)).flatten() for _ in range(batch)])
    q = torch.randn(batch, HEADS, D, generator=g)
    lens, rows = torch.full((batch,), context), torch.arange(batch)
    scratch = torch.empty(HEADS * (2 * D + context + 1) + D)  # decode_attention's formula
    outs = {key: torch.empty(batch, HEADS * D) for key in ("before", "after")}

    def call(lib: ctypes.CDLL, out: torch.Tensor) -> None:
        rc = lib.decode_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), index.data_ptr(),
                                  None, 0, lens.data_ptr(), rows.data_ptr(), batch, context, HEADS, KV_HEADS, D,
                                  D ** -0.5, 0.0, None, None, out.data_ptr(), out.stride(0), 0, scratch.data_ptr())
        assert rc == 0

    row = {"decode_rows": batch, "context": context,
           **timed({"before": lambda: call(before, outs["before"]), "after": lambda: call(after, outs["after"])},
                   repeats)}
    row["same_bits"] = bool(torch.equal(outs["before"], outs["after"]))
    print(json.dumps(row), flush=True)
    return row


def bench(rows: list[int], pasts: list[int], repeats: int, ref: str) -> tuple[list[dict], list[dict]]:
    before, after = library_at(ref), attention_kernel._library()
    before.decode_attention.argtypes = after.decode_attention.argtypes
    prefill = [bench_cell(before, after, n, past, repeats) for n in rows for past in pasts]
    decode = [decode_cell(before, after, b, ctx, repeats) for b in (1, 8) for ctx in pasts if ctx >= BLOCK]
    return prefill, decode


def markdown(result: dict) -> str:
    lines = ["# Compiled prefill attention alone: several rows a pass over the keys vs one", "",
             f"`python tools/bench_prefill_attention.py {' '.join(result['argv'])}`; 1B shape ({HEADS} heads over "
             f"{KV_HEADS} KV heads of {D}), float32 cache in shuffled blocks of {BLOCK} slots, {result['threads']} "
             f"thread(s), before = `{result['ref']}`'s attention.c, after = this tree's (`PREFILL_ROWS` "
             f"{attention_kernel.PREFILL_ROWS}); interleaved, {result['repeats']} repeats; load average at start "
             f"`{result['loadavg_start']}`, at end `{result['loadavg_end']}`. Cells: ms min / median. same bits: the "
             "two builds' outputs equal bit for bit.", "",
             "| rows | past keys | before | after | before / after (min; median) | torch attend | same bits |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['rows']} | {r['past']} | {r['before_ms_min']} / {r['before_ms_median']} | "
                     f"{r['after_ms_min']} / {r['after_ms_median']} | {r['speedup_min']}; {r['speedup_median']} | "
                     f"{r['torch_ms_min']} / {r['torch_ms_median']} | {r['same_bits']} |")
    lines += ["", "Decode rows (`decode_attention`), each its own sequence of `context` keys:", "",
              "| decode rows | context | before | after | before / after (min) | same bits |", "|---|---|---|---|---|---|"]
    for r in result["decode"]:
        lines.append(f"| {r['decode_rows']} | {r['context']} | {r['before_ms_min']} / {r['before_ms_median']} | "
                     f"{r['after_ms_min']} / {r['after_ms_median']} | {r['speedup_min']} | {r['same_bits']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16,64,256", help="chunk rows, comma-separated")
    ap.add_argument("--pasts", default="0,512,2048,8192", help="keys before the chunk, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch's threads (the compiled calls run on one)")
    ap.add_argument("--ref", default="main", help="git ref whose attention.c is 'before'")
    ap.add_argument("--out", default=str(RESULTS / "bench_prefill_attention.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_start = Path("/proc/loadavg").read_text().strip()
    with torch.no_grad():
        rows, decode = bench([int(x) for x in args.rows.split(",")], [int(x) for x in args.pasts.split(",")],
                             args.repeats, args.ref)
    result = {"argv": sys.argv[1:], "threads": args.threads, "ref": args.ref,
              "repeats": args.repeats, "loadavg_start": load_start,
              "loadavg_end": Path("/proc/loadavg").read_text().strip(), "rows": rows, "decode": decode}
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
