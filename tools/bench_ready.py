"""Time to ready: from starting `maced` to its first answered request, with the model cache as it
is (warm: fetched and converted before) and an empty state directory (no cost calibration cached).

    python tools/bench_ready.py                       # the daemon's defaults (backend auto)
    python tools/bench_ready.py --set engine.backend=torch --name torch
    python tools/bench_ready.py --finetune --runs 1   # then train and serve one adapter: peak RSS

Each run starts a fresh daemon with a new state directory, sends one 8-token generate over the
client SDK as soon as the socket answers health checks, and records the wall time until that
reply, the daemon's own "ready in" figure, and the start-up phases its log names (backend
choice, graph export, cost calibration). With --finetune it then has one user give two
preferences, waits for the adapter version trained from them, generates with it, and reads the
daemon's peak resident memory (VmHWM). Writes tools/results/bench_ready[_NAME].{json,md}.
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


def one_start(args: argparse.Namespace, state: Path, run_dir: Path) -> dict:
    socket = run_dir / "maced.sock"
    cmd = [sys.executable, "-m", "daemon.main", "--state-dir", str(state), "--ipc", str(socket),
           "--http", "", "--log-format", "text", "--model", args.model]
    for item in args.set:
        cmd += ["--set", item]
    if args.finetune:
        cmd += ["--set", "finetune.pairs_per_version=2", "--set", "feedback.heldout_fraction=0.0"]
    log_path = state.parent / f"{state.name}.log"
    env = {k: v for k, v in os.environ.items() if k != "MACE_STATE_DIR"}
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
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
    text = log_path.read_text(errors="replace")
    # CPU seconds the daemon spent until then (user + system, all threads): on a machine shared
    # with other work the wall time measures the others too; this does not.
    row = {"first_answer_s": round(answered, 2), "first_answer_cpu_s": round(cpu_s, 2)}
    for name, pattern in PHASES.items():
        found = re.findall(pattern, text)
        row[name] = round(sum(float(x) for x in found), 2) if found else None
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
    p.add_argument("--name", default="", help="suffix of the result files")
    p.add_argument("--out", type=Path, default=REPO / "tools" / "results")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="mace-ready-"))
    run_dir = Path(tempfile.mkdtemp(prefix="mr-", dir="/tmp"))
    rows = []
    try:
        for i in range(args.runs):
            load = os.getloadavg()[0]
            row = one_start(args, root / f"state{i}", run_dir)
            row["load_average_at_start"] = round(load, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    stem = "bench_ready" + (f"_{args.name}" if args.name else "")
    result = {"command": " ".join(["python", "tools/bench_ready.py", *sys.argv[1:]]), "cpus": os.cpu_count(),
              "settings": args.set, "runs": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# Time to ready ({stem})", "", f"`{result['command']}` ({os.cpu_count()} CPUs; warm model "
             "cache, a new empty state directory per run)", "",
             "| run | load avg | first answer (s) | its CPU time (s) | daemon ready (s) | graph export (s) | "
             "cost calibration before ready (s), full / quick | backend |",
             "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for i, r in enumerate(rows):
        lines.append(f"| {i + 1} | {r['load_average_at_start']} | **{r['first_answer_s']}** | "
                     f"{r['first_answer_cpu_s']} | {r['ready_s']} | "
                     f"{r['export_s'] or '-'} | {r['forward_calibration_s'] or '-'} / {r.get('quick_calibration_s') or '-'} | "
                     f"{r['backend']} ({r['quantization']}) |")
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
