"""Giving memory back (engine.keep_alive, issue #34 item 2): the idle daemon's resident memory
after it unloads, against loaded and against an empty process, and the time of a reload.

    python tools/bench_keep_alive.py                  # the default model, the daemon's defaults
    python tools/bench_keep_alive.py --set engine.backend=torch --name torch

Starts one `maced` with `engine.keep_alive` short (2 s), sends a greedy 8-token generate, and
reads its resident memory (the kernel's RSS of its pid) loaded; waits until `status` says
unloaded and reads it again; then, `--rounds` times, sends the same generate to the unloaded
daemon (it reloads: the daemon's own `last_reload_s`, and the client's wall time to the whole
answer against the same request warm) and checks the answer is the same; last, a burst of
`--burst` concurrent generates sent while it is unloaded, every one answered. The empty process is
`python` with the daemon's imports (and the backend's runtime) and no model. Writes
tools/results/keep_alive[_NAME].{json,md}, with /proc/loadavg before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from daemon.sdk import Client, ClientError  # noqa: E402

PROMPT = "Give me three tips for a long hike."
MIB = 1 << 20
# What a daemon imports before any model is loaded: the fronts, the service, the engine, the
# runtimes its backends use (an unloaded daemon still has them all imported).
EMPTY_IMPORTS = ("daemon.main", "daemon.service", "daemon.fronts.zmq_server", "daemon.fronts.http",
                 "edge_runtime.engine", "edge_runtime.backends.auto")


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


def greedy(c: Client) -> tuple[str, float]:
    start = time.monotonic()
    result = c.generate(prompt=PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)
    return result.candidates[0].text, time.monotonic() - start


def wait_state(c: Client, state: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        keep = c.status()["keep_alive"]
        if keep["state"] == state:
            return keep
        time.sleep(0.1)
    raise SystemExit(f"the daemon never became {state} in {timeout_s} s")


def empty_process_rss(backend: str) -> int:
    imports = list(EMPTY_IMPORTS) + (["onnxruntime"] if backend == "onnxruntime" else [])
    code = (f"import {', '.join(imports)}, psutil; "
            "print(psutil.Process().memory_info().rss)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    return int(out.stdout.strip().splitlines()[-1])


# In a fresh process: the engine as the daemon builds it, one answer, then the engine dropped and
# collected, then glibc's malloc_trim(0): what each step gives back (why the unload calls both).
TRIM_CHECK = """
import gc, json, sys, tempfile, ctypes, psutil
from edge_runtime.engine import Engine
from edge_runtime.config import EngineConfig
rss = lambda: psutil.Process().memory_info().rss
base = rss()
config = EngineConfig(backend="auto", onnx_quantization="auto", cost_profile="background",
                      adapters_root=tempfile.mkdtemp())
for item in sys.argv[1:]:
    key, _, value = item.partition("=")
    config = config.replace(**{key.removeprefix("engine."): type(getattr(config, key.removeprefix("engine.")))(value)})
engine = Engine.load(None, config)
engine.generate("Give me three tips for a long hike.")
loaded = rss()
del engine
gc.collect()
collected = rss()
ctypes.CDLL("libc.so.6").malloc_trim(0)
print(json.dumps({"imports_bytes": base, "loaded_bytes": loaded, "after_gc_bytes": collected, "after_trim_bytes": rss()}))
"""


def trim_effect(settings: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", TRIM_CHECK, *settings], cwd=REPO, capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def burst(endpoint: str, count: int) -> list[object]:
    answers: list[object] = []
    gate = threading.Barrier(count)

    def one() -> None:
        with Client(endpoint, timeout_s=600) as c:
            gate.wait()
            try:
                answers.append(greedy(c)[0])
            except ClientError as exc:
                answers.append(f"{type(exc).__name__}: {exc}")

    workers = [threading.Thread(target=one) for _ in range(count)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(900)
    return answers


def run(args: argparse.Namespace) -> dict:
    root = Path(tempfile.mkdtemp(prefix="bench-keep-"))
    socket = root / "maced.sock"
    endpoint = f"ipc://{socket}"
    cmd = [sys.executable, "-m", "daemon.main", "--state-dir", str(root / "state"), "--ipc", str(socket),
           "--http", "", "--log-format", "text", "--model", args.model,
           "--set", f"engine.keep_alive={args.keep_alive_s:g}", "--set", "finetune.enabled=false"]
    for item in args.set:
        cmd += ["--set", item]
    env = {k: v for k, v in os.environ.items() if k != "MACE_STATE_DIR"}
    log_path = root / "maced.log"
    load_before = loadavg()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + args.timeout_s
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"maced exited with {proc.returncode}:\n{log_path.read_text()}")
            if time.monotonic() > deadline:
                raise SystemExit("maced did not become ready")
            try:
                with Client(endpoint, timeout_s=2, connect_timeout_s=1.0, retries=0) as c:
                    if c.health(timeout_s=1.0).get("ok"):
                        break
            except ClientError:
                pass
            time.sleep(0.2)
        with Client(endpoint, timeout_s=900) as c:
            expected, cold_first_s = greedy(c)
            _, warm_s = greedy(c)
            status = c.status()
            model = status["model"]
            time.sleep(0.5)
            loaded_rss = rss(proc.pid)
            wait_state(c, "unloaded", args.timeout_s)
            time.sleep(0.5)
            unloaded_rss = rss(proc.pid)
            rounds = []
            for _ in range(args.rounds):
                wait_state(c, "unloaded", args.timeout_s)
                text, first_s = greedy(c)
                _, again_s = greedy(c)
                keep = c.status()["keep_alive"]
                rounds.append({"daemon_reload_s": keep["last_reload_s"], "client_first_answer_s": round(first_s, 3),
                               "client_warm_answer_s": round(again_s, 3), "same_answer": text == expected})
                wait_state(c, "unloaded", args.timeout_s)
                rounds[-1]["rss_unloaded_bytes"] = rss(proc.pid)
            answers = burst(endpoint, args.burst)
            keep = c.status()["keep_alive"]
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    empty_rss = empty_process_rss(str(model.get("backend")))
    trim = trim_effect(args.set)
    shutil.rmtree(root, ignore_errors=True)
    reloads = [r["daemon_reload_s"] for r in rounds]
    return {
        "model": model.get("model"), "backend": model.get("backend"), "dtype": model.get("dtype"),
        "quantization": model.get("quantization"), "weights_bytes": model.get("weights_bytes"),
        "keep_alive_s": args.keep_alive_s, "settings": args.set,
        "rss_loaded_bytes": loaded_rss, "rss_unloaded_bytes": unloaded_rss, "rss_empty_process_bytes": empty_rss,
        "rss_given_back_bytes": loaded_rss - unloaded_rss,
        "unloaded_above_empty_bytes": unloaded_rss - empty_rss,
        "first_answer_after_start_s": round(cold_first_s, 3), "warm_answer_s": round(warm_s, 3),
        "rounds": rounds, "reload_s_min": min(reloads), "reload_s_max": max(reloads),
        "burst_sent": args.burst, "burst_answered_same": sum(a == expected for a in answers),
        "burst_answers_other": [a for a in answers if a != expected],
        "daemon_keep_alive": {k: keep[k] for k in ("unloads", "reloads", "reload_failures",
                                                   "released_engine_referenced")},
        "loadavg_before": load_before, "loadavg_after": loadavg(), "cpus": os.cpu_count(),
        "empty_process_imports": list(EMPTY_IMPORTS), "in_process_trim_check": trim,
    }


def markdown(r: dict) -> str:
    def mib(n: int) -> str:
        return f"{n / MIB:,.0f} MiB"

    lines = [
        f"# keep_alive: memory given back and reload time ({r['model']}, {r['backend']}, {r['dtype']})",
        "",
        f"`python tools/bench_keep_alive.py {' '.join('--set ' + s for s in r['settings'])}`".replace("  ", " "),
        f"keep_alive {r['keep_alive_s']:g} s; loadavg before {r['loadavg_before']}, after {r['loadavg_after']} "
        f"({r['cpus']} CPUs, a shared machine).",
        "",
        "| resident memory (RSS) | MiB |",
        "|---|---:|",
        f"| loaded (after two answers) | {mib(r['rss_loaded_bytes'])} |",
        f"| unloaded (idle) | {mib(r['rss_unloaded_bytes'])} |",
        f"| empty process (the daemon's imports, no model) | {mib(r['rss_empty_process_bytes'])} |",
        f"| given back | {mib(r['rss_given_back_bytes'])} |",
        f"| unloaded above empty | {mib(r['unloaded_above_empty_bytes'])} |",
        f"| the model's weights (status) | {mib(r['weights_bytes'] or 0)} |",
        "",
        "| round | reload (daemon) s | first answer after unload s | warm answer s | same answer | RSS unloaded again |",
        "|---:|---:|---:|---:|---|---:|",
    ]
    for i, row in enumerate(r["rounds"], 1):
        lines.append(f"| {i} | {row['daemon_reload_s']} | {row['client_first_answer_s']} | "
                     f"{row['client_warm_answer_s']} | {row['same_answer']} | {mib(row['rss_unloaded_bytes'])} |")
    lines += ["", f"Burst of {r['burst_sent']} concurrent generates sent while unloaded: "
              f"{r['burst_answered_same']} answered with the same greedy text"
              + (f"; others: {r['burst_answers_other']}" if r["burst_answers_other"] else "") + ".",
              f"Daemon counters: {r['daemon_keep_alive']}.", ""]
    t = r["in_process_trim_check"]
    lines += ["Why the unload calls `malloc_trim(0)` after collecting (one engine built as the daemon builds it, "
              "in a fresh process; RSS):", "",
              "| imports only | loaded, one answer | engine dropped + gc.collect() | then malloc_trim(0) |",
              "|---:|---:|---:|---:|",
              f"| {mib(t['imports_bytes'])} | {mib(t['loaded_bytes'])} | {mib(t['after_gc_bytes'])} | "
              f"{mib(t['after_trim_bytes'])} |", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--keep-alive-s", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--burst", type=int, default=8)
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--name", default="", help="suffix of the result files")
    p.add_argument("--out", type=Path, default=REPO / "tools" / "results")
    args = p.parse_args()
    result = run(args)
    stem = "keep_alive" + (f"_{args.name}" if args.name else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
