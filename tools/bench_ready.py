"""Time to ready: from starting `maced` to its first answered request, with the model cache as it
is (warm: fetched and converted before) and an empty state directory (no cost calibration cached).

    python tools/bench_ready.py                       # the daemon's defaults (backend auto)
    python tools/bench_ready.py --set engine.backend=torch --name torch
    python tools/bench_ready.py --finetune --runs 1   # then train and serve one adapter: peak RSS

    # a cached start as a user has it (model, graph, remembered self-check and costs all there),
    # two source trees alternated in one run, a GGUF as the model:
    python tools/bench_ready.py --model file.gguf --keep-state --cache-dir DIR \
        --trees before=/path/main,after=. --runs 3 --name 1b

Each run starts a fresh daemon with a new state directory (with --keep-state: one per tree,
kept from run to run, so every run after the first is a cached start), sends one 8-token
generate over the client SDK as soon as the socket answers health checks, and records the wall
time until that reply, the daemon's own "ready in" figure, the start-up phases its log names
(backend choice, graph export, cost calibration) and each phase's seconds read off the log's
timestamps. With --finetune it then has one user give two preferences, waits for the adapter
version trained from them, generates with it, and reads the daemon's peak resident memory
(VmHWM). Writes tools/results/bench_ready[_NAME].{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from daemon.sdk import Client, ClientError  # noqa: E402

PHASES = {
    "ready_s": r"ready in ([\d.]+) s",
    "forward_calibration_s": r"calibrated the forward cost model in ([\d.]+) s",
    "quick_calibration_s": r"quick forward cost calibration in ([\d.]+) s",
    "export_s": r"exported \S+ in ([\d.]+) s",
    "background_calibration_s": r"in the background, ([\d.]+) s of forwards",
}


# Each phase ends at the first log line matching its pattern; it starts where the one before ended
# (the first at the process's start). A phase whose line is missing (no export, a remembered
# check) is folded into the next one.
TIMELINE = (
    ("imports", r"maced: listening on"),
    ("find model, read config", r"edge_runtime\.loading: loading "),
    ("weights, graph, session", r"onnxruntime backend: |auto backend: torch"),
    ("self-check", r"auto backend: (onnxruntime|tensorrt|torch) \("),
    ("cost calibration, engine", r"ready in [\d.]+ s"),
)
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def timeline(text: str, started_wall: float) -> dict[str, float | None]:
    """Seconds of each `TIMELINE` phase, from the text log's timestamps."""
    stamped = []
    for line in text.splitlines():
        m = _STAMP.match(line)
        if m:
            stamped.append((datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), line))
    out: dict[str, float | None] = {}
    previous = started_wall
    for name, pattern in TIMELINE:
        at = next((t for t, line in stamped if re.search(pattern, line)), None)
        out[name] = None if at is None else round(at - previous, 2)
        previous = previous if at is None else at
    return out


def one_start(args: argparse.Namespace, state: Path, run_dir: Path, tree: Path = REPO) -> dict:
    socket = run_dir / "maced.sock"
    cmd = [sys.executable, "-m", "daemon.main", "--state-dir", str(state), "--ipc", str(socket),
           "--http", "", "--log-format", "text", "--model", args.model]
    for item in args.set:
        cmd += ["--set", item]
    if args.finetune:
        cmd += ["--set", "finetune.pairs_per_version=2", "--set", "feedback.heldout_fraction=0.0"]
    log_path = state.parent / f"{state.name}.log"
    env = {k: v for k, v in os.environ.items() if k != "MACE_STATE_DIR"}
    env["PYTHONPATH"] = str(tree)
    if args.cache_dir:
        env["MACE_CACHE_DIR"] = str(args.cache_dir)
    offset = log_path.stat().st_size if log_path.exists() else 0  # a kept state's log grows
    started, started_wall = time.monotonic(), time.time()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=tree, stdout=log, stderr=subprocess.STDOUT, env=env)
    answered = None
    try:
        while time.monotonic() - started < args.timeout_s:
            if proc.poll() is not None:
                raise SystemExit(f"maced exited with {proc.returncode}:\n{log_path.read_text()}")
            if socket.exists():
                try:
                    with Client(f"ipc://{socket}", timeout_s=600, connect_timeout_s=1.0, retries=0) as c:
                        if c.health(timeout_s=1.0).get("ok"):
                            c.generate(prompt="Hello! Who are you?", max_tokens=8, temperature=0.0)
                            answered = time.monotonic() - started
                            cpu_s = cpu_seconds(proc.pid)
                            status = c.status()
                            finetune = fine_tune(c, proc.pid) if args.finetune else {}
                            break
                except ClientError:
                    pass
            time.sleep(0.05)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    if answered is None:
        raise SystemExit(f"no answer in {args.timeout_s} s:\n{log_path.read_text()}")
    text = log_path.read_bytes()[offset:].decode(errors="replace")  # this start's lines
    # CPU seconds the daemon spent until then (user + system, all threads): on a machine shared
    # with other work the wall time measures the others too; this does not.
    row = {"first_answer_s": round(answered, 2), "first_answer_cpu_s": round(cpu_s, 2)}
    for name, pattern in PHASES.items():
        found = re.findall(pattern, text)
        row[name] = round(sum(float(x) for x in found), 2) if found else None
    row["phases_s"] = timeline(text, started_wall)
    row["self_check_remembered"] = "self-check remembered" in text
    row["load_average_after"] = round(os.getloadavg()[0], 2)
    row.update(finetune)
    model = status.get("model", {})
    row.update(backend=model.get("backend"), quantization=model.get("quantization"),
               backend_reason=model.get("backend_reason"), cost_model=status.get("engine", {}).get("cost_model"))
    return row


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fine_tune(c: Client, pid: int) -> dict:
    """Two preference pairs from one user -> a new adapter version (finetune.pairs_per_version=2),
    served once; the daemon's peak RSS over its whole life so far."""
    started = time.monotonic()
    c.consent("bench")
    for prompt in ("Give me a tip for cooking rice.", "Give me a tip for sleeping well."):
        r = c.generate(prompt, max_tokens=16, n=2, temperature=1.0, seed=1, user="bench")
        c.choose("bench", r.interaction_id, 1)
    while c.status()["finetune"].get("versions_published", 0) < 1:
        if time.monotonic() - started > 900:
            raise SystemExit("no adapter version published in 900 s")
        time.sleep(1.0)
    trained_s = time.monotonic() - started
    served = c.generate("Give me a tip for cooking rice.", max_tokens=16, temperature=0.0, user="bench")
    peak = rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            peak = int(line.split()[1]) * 1024
        elif line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return {"adapter_served": served.adapter, "finetune_s": round(trained_s, 1),
            "peak_rss_mb": round(peak / 2**20, 1), "rss_after_mb": round(rss / 2**20, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--finetune", action="store_true", help="then train and serve an adapter; peak RSS")
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--trees", default="", metavar="NAME=PATH,...",
                   help="source trees to start maced from, alternated round-robin (default: this one)")
    p.add_argument("--keep-state", action="store_true",
                   help="one state directory per tree, kept across its runs (cached starts after the first)")
    p.add_argument("--cache-dir", type=Path, default=None, help="$MACE_CACHE_DIR for the daemons")
    p.add_argument("--name", default="", help="suffix of the result files")
    p.add_argument("--out", type=Path, default=REPO / "tools" / "results")
    args = p.parse_args()
    trees = [(n, Path(t).resolve()) for n, t in (x.split("=", 1) for x in args.trees.split(",") if x)] \
        or [("this", REPO)]
    root = Path(tempfile.mkdtemp(prefix="mace-ready-"))
    run_dir = Path(tempfile.mkdtemp(prefix="mr-", dir="/tmp"))
    rows = []
    try:
        for i in range(args.runs):
            for name, tree in trees:
                load = os.getloadavg()[0]
                state = root / (f"state-{name}" if args.keep_state else f"state{i}-{name}")
                row = {"tree": name, "run": i + 1, **one_start(args, state, run_dir, tree)}
                row["load_average_at_start"] = round(load, 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    stem = "bench_ready" + (f"_{args.name}" if args.name else "")
    result = {"command": " ".join(["python", "tools/bench_ready.py", *sys.argv[1:]]), "cpus": os.cpu_count(),
              "settings": args.set, "trees": {n: str(t) for n, t in trees}, "runs": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    state_words = ("one state directory per tree, kept across its runs: run 1 fills it, later runs are "
                   "cached starts") if args.keep_state else "a new empty state directory per run"
    lines = [f"# Time to ready ({stem})", "", f"`{result['command']}` ({os.cpu_count()} CPUs; warm model "
             f"cache, {state_words})", "",
             "| tree | run | load avg start / end | first answer (s) | its CPU time (s) | daemon ready (s) | "
             "graph export (s) | cost calibration before ready (s), full / quick | self-check | backend |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['tree']} | {r['run']} | {r['load_average_at_start']} / {r['load_average_after']} | "
                     f"**{r['first_answer_s']}** | {r['first_answer_cpu_s']} | {r['ready_s']} | "
                     f"{r['export_s'] or '-'} | {r['forward_calibration_s'] or '-'} / {r.get('quick_calibration_s') or '-'} | "
                     f"{'remembered' if r['self_check_remembered'] else 'run'} | {r['backend']} ({r['quantization']}) |")
    names = [name for name, _ in TIMELINE]
    lines += ["", "Phases (s, from the log's timestamps; a missing line's phase folds into the next):", "",
              "| tree | run | " + " | ".join(names) + " | first answer after ready |",
              "|---|---:|" + "---:|" * (len(names) + 1)]
    for r in rows:
        ph = r["phases_s"]
        after = None if r["ready_s"] is None else round(r["first_answer_s"] - sum(v or 0 for v in ph.values()), 2)
        lines.append(f"| {r['tree']} | {r['run']} | " + " | ".join(str(ph[n] if ph[n] is not None else "-") for n in names)
                     + f" | {after} |")
    if args.finetune:
        lines += ["", "| run | adapter served | train 2 pairs + publish (s) | peak RSS (MiB) | RSS after (MiB) |",
                  "|---:|---|---:|---:|---:|"]
        lines += [f"| {i + 1} | {r['adapter_served']} | {r['finetune_s']} | **{r['peak_rss_mb']}** | "
                  f"{r['rss_after_mb']} |" for i, r in enumerate(rows)]
    lines += ["", f"Backend choice: {rows[-1]['backend_reason']}", ""]
    (args.out / f"{stem}.md").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
