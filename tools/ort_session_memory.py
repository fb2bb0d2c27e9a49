"""Where an ONNX Runtime session's resident bytes go (issue #28): opens one exported graph alone
per option set, each in a fresh process, and reads RSS split into anonymous and file-backed
pages (`/proc/self/smaps_rollup`, the data file's own pages from `/proc/self/smaps`).

    python tools/ort_session_memory.py <export dir or model.onnx> [--options default,no-arena,...]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

MIB = 1 << 20

# Each option set: SessionOptions fields and session config entries on top of what
# ort_session.open_session sets (every graph optimisation, one intra-op thread).
OPTIONS: dict[str, dict] = {
    "default": {},
    "no-arena": {"arena": False},
    "initializers-own-alloc": {"config": {"session.use_device_allocator_for_initializers": "1"}},
    "no-arena+own-alloc": {"arena": False, "config": {"session.use_device_allocator_for_initializers": "1"}},
    "no-prepack": {"config": {"session.disable_prepacking": "1"}},
    "parallel-prepack": {"config": {"session.prepack.enable_parallel": "1"}},
    "pageout": {"pageout": True},  # the data file's pages given back after opening
    # what the backend does: given back while the session opens too (mapped_weights.paging_out)
    "pageout-while-opening": {"pageout": True, "while_opening": True},
}


class PeakRss:
    """The most resident bytes (anonymous + file) seen by a thread sampling every 5 ms."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, int(Path("/proc/self/statm").read_text().split()[1]) * page)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def rollup() -> dict[str, int]:
    """Resident bytes of this process: rss, anonymous, file-backed (rss less anonymous and shmem)."""
    values = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        if rest.strip().endswith("kB"):
            values[key] = int(rest.split()[0]) * 1024
    return {"rss": values["Rss"], "anonymous": values["Anonymous"],
            "file": values["Rss"] - values["Anonymous"] - values.get("Shmem", 0)}


def mapped_file_rss(name: str) -> int:
    """Resident bytes of mappings of files whose path ends with `name`."""
    total, current = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(None, 5)
        if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:
            current = len(head) == 6 and head[5].endswith(name)
        elif current and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def probe(model: Path, option: str, threads: int) -> dict:
    """Opens `model` with `option` in this process and reports the growth."""
    import onnxruntime as ort

    # imported (torch with it) before counting, so every option's figures leave it out alike
    from edge_runtime.model.mapped_weights import page_out_file, paging_out

    spec = OPTIONS[option]
    before = rollup()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.enable_cpu_mem_arena = spec.get("arena", True)
    for key, value in spec.get("config", {}).items():
        options.add_session_config_entry(key, value)
    data = model.with_name(model.name + ".data")
    sampler = PeakRss()
    start = time.perf_counter()
    with paging_out(data) if spec.get("while_opening") else contextlib.nullcontext():
        session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    seconds = time.perf_counter() - start
    if spec.get("pageout"):
        page_out_file(data)
    peak = sampler.stop()
    opened = rollup()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    trimmed = rollup()
    result = {"option": option, "open_s": round(seconds, 1), "peak_rss_while_opening_mib": round((peak - before["rss"]) / MIB),
              "data_file_mib": round(data.stat().st_size / MIB) if data.exists() else 0,
              **{f"{k}_mib": round((opened[k] - before[k]) / MIB) for k in opened},
              **{f"trimmed_{k}_mib": round((trimmed[k] - before[k]) / MIB) for k in trimmed},
              "data_file_rss_mib": round(mapped_file_rss(data.name) / MIB)}
    del session
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--options", default=",".join(OPTIONS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child's mode
    args = parser.parse_args(argv)
    model = args.model / "model.onnx" if args.model.is_dir() else args.model
    if args.one:
        print(json.dumps(probe(model, args.options, args.threads)))
        return 0
    rows = []
    for option in args.options.split(","):
        out = subprocess.run([sys.executable, __file__, str(model), "--one", "--options", option,
                              "--threads", str(args.threads)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
