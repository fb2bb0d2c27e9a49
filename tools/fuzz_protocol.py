"""Long-mode protocol fuzzing of a real `maced` (the harness of tests/daemon/fuzz.py).

Sends hostile and edge-of-range frames (the sampler extremes included) from several DEALER
sockets while other clients' well-formed requests run beside them, then checks: every frame got
exactly one final reply, no other client's request failed or changed its result, the daemon is
still up. Exits 1 when any of that fails.

  .venv/bin/python tools/fuzz_protocol.py --frames 10000            # its own daemon, tiny model
  .venv/bin/python tools/fuzz_protocol.py --frames 10000 --model default
  .venv/bin/python tools/fuzz_protocol.py --endpoint ipc:///run/mace-edge/maced.sock --frames 2000

Writes tools/results/fuzz_protocol[-<tag>].json and .md.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.daemon.conftest import TINY_ENGINE_FLAGS, DaemonProcess  # noqa: E402
from tests.daemon.fuzz import run_fuzz  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=10_000, help="hostile frames in all (default 10000)")
    parser.add_argument("--sockets", type=int, default=4, help="hostile DEALER sockets")
    parser.add_argument("--seed", type=int, default=20_251_122)
    parser.add_argument("--model", default="tiny", help="'tiny' (a random llama made here), 'default', or a path")
    parser.add_argument("--endpoint", help="fuzz this running daemon instead of starting one")
    parser.add_argument("--tag", default="", help="results file suffix")
    parser.add_argument("--out", type=Path, default=REPO / "tools" / "results")
    args = parser.parse_args()

    daemon = None
    with tempfile.TemporaryDirectory(prefix="mace-fuzz-") as tmp:
        if args.endpoint:
            endpoint, alive = args.endpoint, (lambda: True)
        else:
            model: str | Path = args.model
            flags = TINY_ENGINE_FLAGS
            if args.model == "tiny":
                from edge_runtime.model.testing import make_tiny_model_dir

                model = make_tiny_model_dir(Path(tmp) / "tiny")
            elif args.model == "default":
                model, flags = "default", ["--set", "engine.num_threads=1"]
            daemon = DaemonProcess(Path(tmp), model, engine_flags=flags)
            daemon.wait_ready(300)
            endpoint = daemon.endpoint
            alive = (lambda: daemon.proc.poll() is None)  # noqa: E731
        started = time.time()
        try:
            report = run_fuzz(endpoint, frames=args.frames, sockets=args.sockets, seed=args.seed, alive=alive)
        finally:
            exit_code = daemon.stop()[0] if daemon is not None else None
    result = {"tool": "fuzz_protocol", "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
              "command": " ".join(["tools/fuzz_protocol.py", *sys.argv[1:]]), "model": str(args.model),
              "machine": {"cpus": _cpus(), "python": platform.python_version(), "platform": platform.platform()},
              "daemon_exit_status": exit_code, **report.as_dict()}
    name = "fuzz_protocol" + (f"-{args.tag}" if args.tag else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{name}.md").write_text(_table(result))
    print(_table(result))
    problems = report.problems() + ([] if exit_code in (None, 0) else [f"daemon exited {exit_code} on SIGTERM"])
    for problem in problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


def _table(r: dict) -> str:
    codes = ", ".join(f"{k} {v}" for k, v in r["codes"].items())
    rows = [
        ("hostile frames sent", r["frames"]), ("final replies", r["finals"]),
        ("missing replies", r["missing"]), ("extra final replies", r["extra_finals"]),
        ("other clients' requests", r["bystander_requests"]),
        ("collateral failures", r["collateral_failures"]), ("daemon up after the run", r["daemon_up"]),
        ("daemon exit status on SIGTERM", r["daemon_exit_status"]), ("seconds", r["elapsed_s"]),
    ]
    lines = [f"# fuzz_protocol ({r['started']})", "", f"`{r['command']}` (model: {r['model']})", "",
             "| what | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), "",
             f"Replies by code: {codes}.", "",
             "Problems: " + ("none" if not r["problems"] else "; ".join(r["problems"])), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
