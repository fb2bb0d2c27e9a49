"""The maced half of tools/bench_e2e.py, round robin between two trees (issue #30's bar: tok/s at
1 and 8 clients before and after a change). Uses the tool's own Server, run_level and summarise
and its settings (streamed chat, greedy, ignore_eos); llama-server is left out because on the
loaded 2-core machine it answered at 0.4 tok/s and no run could finish.

    python tools/results/bench_e2e_schema_driver.py BEFORE_TREE AFTER_TREE ROUNDS
"""

import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools import bench_e2e  # noqa: E402

OUT = REPO / "tools" / "results" / "bench_e2e_schema"
LEVELS = {1: 4, 8: 1}  # clients: requests per client
MAX_TOKENS = 64


def one_run(side: str, tree: str, rnd: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-e2e-schema-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MACE_")}
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=tree)
    bench_e2e.REPO = Path(tree)  # Server starts `python -m daemon.main` in this folder
    port = bench_e2e.free_port()
    server = bench_e2e.Server("maced", [sys.executable, "-m", "daemon.main", "--model", "default",
                                        "--state-dir", str(work / "state"), "--ipc", str(work / "maced.sock"),
                                        "--http", f"127.0.0.1:{port}", "--log-format", "text"],
                              port, work / "maced.log", env)
    load_start = open("/proc/loadavg").read().split()[:3]
    result = {"side": side, "tree": tree, "round": rnd, "loadavg_start": " ".join(load_start),
              "max_tokens": MAX_TOKENS, "levels": {}}
    try:
        server.start(600)
        result["ready_s"] = server.ready_s
        asyncio.run(bench_e2e.run_level(server, 1, 1, MAX_TOKENS, 0))  # warm, at the benchmark's length
        for clients, per_client in LEVELS.items():
            samples, wall = asyncio.run(bench_e2e.run_level(server, clients, per_client, MAX_TOKENS, rnd))
            result["levels"][str(clients)] = bench_e2e.summarise(samples, wall)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    result["loadavg_end"] = " ".join(open("/proc/loadavg").read().split()[:3])
    (OUT / f"{side}-{rnd}.json").write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    before, after, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    OUT.mkdir(parents=True, exist_ok=True)
    for rnd in range(1, rounds + 1):
        for side, tree in (("before", before), ("after", after)):
            r = one_run(side, tree, rnd)
            print(time.strftime("%H:%M:%S"), side, rnd, r["loadavg_start"], r["ready_s"],
                  {c: lv["tokens_per_s"] for c, lv in r["levels"].items()}, flush=True)


if __name__ == "__main__":
    main()
