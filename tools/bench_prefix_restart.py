"""Time to first token of the first request after a restart, when its ~1,000-token system prompt
was reused before the restart (its KV blocks read back from the state dir), against the first
request after a restart of the same state dir with the disk tier off (the prefix computed again);
`maced` on the default model as a user runs it. Writes tools/results/prefix_restart.{json,md}.

    python tools/bench_prefix_restart.py [--rounds 2] [--set section.key=value ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from daemon.sdk import Client  # noqa: E402
from daemon.sdk.results import ClientError  # noqa: E402
from tools.report import (  # noqa: E402
    RESULTS,
    ROOT,
    load_average,
    markdown_table,
    platform_line,
    write_json,
    write_markdown,
)

TOPICS = ["billing", "privacy", "shipping", "returns", "accounts", "warranty", "security", "support"]


def system_prompt(sentences: int) -> str:
    """A support assistant's long instructions (the kind of prefix apps resend with every turn)."""
    lines = ["You are the help desk assistant of Northwind Outfitters. Follow every rule below."]
    for i in range(sentences):
        topic = TOPICS[i % len(TOPICS)]
        lines.append(f"Rule {i + 1} ({topic}): when a customer asks about {topic}, answer in two short "
                     f"sentences, cite policy section {i % 17 + 1}.{i % 5}, and never promise a date.")
    return "\n".join(lines)


class Daemon:
    def __init__(self, state: Path, extra: list[str]) -> None:
        self.run_dir = Path(tempfile.mkdtemp(prefix="mace-pr-", dir="/tmp"))
        self.socket = self.run_dir / "maced.sock"
        self.log_path = state.parent / f"{state.name}.log"
        cmd = [sys.executable, "-m", "daemon.main", "--state-dir", str(state), "--ipc", str(self.socket),
               "--http", "", "--log-format", "text"]
        for item in extra:
            cmd += ["--set", item]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MACE_")}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.started = time.monotonic()

    def client(self) -> Client:
        return Client(f"ipc://{self.socket}", timeout_s=600, connect_timeout_s=1.0, retries=0)

    def wait_ready(self, timeout_s: float) -> float:
        while time.monotonic() - self.started < timeout_s:
            if self.proc.poll() is not None:
                raise SystemExit(f"maced exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            if self.socket.exists():
                try:
                    with self.client() as c:
                        if c.health(timeout_s=1.0).get("ok"):
                            return time.monotonic() - self.started
                except ClientError:
                    pass
            time.sleep(0.05)
        raise SystemExit(f"maced not ready in {timeout_s} s:\n{self.log_path.read_text()}")

    def stop(self) -> float:
        t0 = time.monotonic()
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return time.monotonic() - t0


def ask(d: Daemon, system: str, question: str, tokens: int) -> dict[str, Any]:
    """One streamed greedy chat turn: time to first token, the text, the prompt's cached tokens."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    with d.client() as c:
        t0 = time.perf_counter()
        first = None
        stream = c.stream(messages=messages, max_tokens=tokens, temperature=0.0, ignore_eos=True, user="bench")
        for _ in stream:
            if first is None:
                first = time.perf_counter() - t0
        result = stream.result
        engine = c.status()["engine"]
    usage = result.usage if result is not None else {}
    return {"ttft_s": round(first or 0.0, 3), "text": result.text if result is not None else "",
            "prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": usage.get("cached_prompt_tokens"),
            "restored_blocks": engine.get("prefix_store_restored_blocks"),
            "stored_blocks": engine.get("prefix_store_blocks")}


def one_round(work: Path, system: str, args: argparse.Namespace) -> dict[str, Any]:
    question = "A parcel arrived damaged. What do I do?"
    # Before the restart: the system prompt is used twice (the second use is the reuse that
    # stores its blocks), then the daemon stops as systemd stops it.
    warm_state = work / "warm" / "state"
    warm_state.mkdir(parents=True)
    d = Daemon(warm_state, args.set)
    d.wait_ready(args.timeout_s)
    ask(d, system, "Hello, who are you?", 4)
    before = ask(d, system, "How do refunds work?", 4)
    stop_s = d.stop()
    d = Daemon(warm_state, args.set)
    ready_s = d.wait_ready(args.timeout_s)
    restarted = ask(d, system, question, args.tokens)
    d.stop()
    # The same state dir (calibration, everything else alike) restarted with the tier off: what
    # the first answer cost before this tier existed.
    d = Daemon(warm_state, [*args.set, "engine.prefix_store_bytes=0"])
    cold_ready_s = d.wait_ready(args.timeout_s)
    cold = ask(d, system, question, args.tokens)
    d.stop()
    return {"before_restart": before, "stop_s": round(stop_s, 2), "restart_ready_s": round(ready_s, 2),
            "restarted": restarted, "cold_ready_s": round(cold_ready_s, 2), "cold": cold,
            "ttft_ratio": round(restarted["ttft_s"] / cold["ttft_s"], 3) if cold["ttft_s"] else None,
            "same_answer": restarted["text"] == cold["text"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sentences", type=int, default=30, help="rules in the system prompt (~33 tokens each)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens generated by the measured request")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--out", default=str(RESULTS / "prefix_restart.json"))
    args = parser.parse_args(argv)
    system = system_prompt(args.sentences)
    load_start = load_average()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="mace-prefix-restart-") as tmp:
        for i in range(args.rounds):
            work = Path(tmp) / f"round{i}"
            rounds.append(one_round(work, system, args))
            print(f"round {i + 1}: restarted TTFT {rounds[-1]['restarted']['ttft_s']} s, "
                  f"cold {rounds[-1]['cold']['ttft_s']} s", flush=True)
    ratios = sorted(r["ttft_ratio"] for r in rounds if r["ttft_ratio"] is not None)
    result = {"machine": platform_line(), "loadavg_start": load_start, "loadavg_end": load_average(),
              "settings": args.set, "system_prompt_tokens": rounds[0]["cold"]["prompt_tokens"],
              "rounds": rounds, "ttft_ratio_median": ratios[len(ratios) // 2] if ratios else None}
    out = Path(args.out)
    write_json(out, result)
    rows = [[i + 1, r["cold"]["prompt_tokens"], r["restarted"]["cached_tokens"], r["restarted"]["restored_blocks"],
             r["cold"]["ttft_s"], r["restarted"]["ttft_s"], r["ttft_ratio"], r["same_answer"]]
            for i, r in enumerate(rounds)]
    lines = ["# First request after a restart: prefix read back from disk vs computed again", "",
             f"`python tools/bench_prefix_restart.py --rounds {args.rounds}`; {result['machine']}; "
             f"load average {load_start} at the start, {result['loadavg_end']} at the end.", "",
             *markdown_table(["round", "prompt tokens", "cached after restart", "blocks read back",
                              "tier off: TTFT (s)", "tier on: TTFT (s)", "ratio", "same greedy answer"], rows),
             "", f"Median ratio: **{result['ttft_ratio_median']}** (the issue's target: at most 0.3)."]
    write_markdown(out.with_suffix(".md"), lines)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
