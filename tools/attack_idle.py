"""Idle-socket attack, long mode (issue #29, item 3): 2,000 idle and half-sent HTTP connections
and 200 extra ZeroMQ sockets held against a `maced` on loopback, re-opened as the daemon drops
them, while a well-formed client keeps asking /health (HTTP and ZeroMQ) and a short completion.
Reports whether the daemon stayed up, the well-formed client's worst latencies and the log's
growth; writes tools/results/attack_idle.{json,md}. Bounded in count and time; loopback only.

    python tools/attack_idle.py                     # starts its own maced on the tiny model
    python tools/attack_idle.py --http-port 8000 --endpoint ipc:///run/mace-edge/maced.sock \
        --log /var/log/maced.log --pid 1234          # an already running daemon
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.report import (  # noqa: E402
    cpu_name,
    load_average,
    markdown_table,
    percentile,
    write_json,
    write_markdown,
)

LOOPBACK = "127.0.0.1"
HALF_SENT = (b"GET /health HTTP/1.1\r\nHo",  # headers cut off
             b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             b"Content-Length: 4096\r\n\r\n{\"prompt\": ")  # body cut off


class Attackers:
    """`count` HTTP connections, a third idle and the rest half-sent, re-opened when dropped."""

    def __init__(self, port: int, count: int) -> None:
        self.port = port
        self.count = count
        self.selector = selectors.DefaultSelector()
        self.open = 0
        self.opened = 0
        self.dropped = 0
        self.refused = 0

    def fill(self, budget: int) -> None:
        """Open up to `budget` connections (the count per round bounds the attack's own rate)."""
        for _ in range(min(budget, self.count - self.open)):
            try:
                s = socket.create_connection((LOOPBACK, self.port), timeout=2)
            except OSError:
                self.refused += 1
                return
            if self.opened % 3:
                s.sendall(HALF_SENT[self.opened % 2])
            s.setblocking(False)
            self.selector.register(s, selectors.EVENT_READ)
            self.open += 1
            self.opened += 1

    def reap(self) -> None:
        """Forget the connections the daemon closed (readable: EOF, a reset, or an error reply)."""
        for key, _ in self.selector.select(timeout=0):
            s = key.fileobj
            self.selector.unregister(s)
            s.close()  # type: ignore[union-attr]
            self.open -= 1
            self.dropped += 1

    def run(self, until: float, burst: int, reopen_per_s: float) -> None:
        """Open `count` (`burst` every 10 ms), then re-open what the daemon drops at
        `reopen_per_s` at most, until `until`."""
        while self.opened < self.count and time.monotonic() < until:
            self.reap()
            self.fill(burst)
            time.sleep(0.01)
        last, credit = time.monotonic(), 0.0
        while time.monotonic() < until:
            self.reap()
            now = time.monotonic()
            credit = min(float(burst), credit + (now - last) * reopen_per_s)
            last = now
            self.fill(int(credit))
            credit -= int(credit)
            time.sleep(0.02)

    def close(self) -> None:
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self.selector.close()


class Timings:
    """The well-formed client's latencies: /health and a 4-token completion over HTTP, health over
    ZeroMQ, one of each per round."""

    def __init__(self) -> None:
        self.health: list[float] = []
        self.completion: list[float] = []
        self.zmq_health: list[float] = []

    def round(self, port: int, client: Any, failures: list[str]) -> None:
        elapsed, status = timed_http(port, "GET", "/health")
        self.health.append(elapsed)
        if status != 200:
            failures.append(f"/health answered {status}")
        elapsed, status = timed_http(port, "POST", "/v1/completions",
                                     {"model": "default", "prompt": "hello", "max_tokens": 4})
        self.completion.append(elapsed)
        if status != 200:
            failures.append(f"/v1/completions answered {status}")
        start = time.monotonic()
        try:
            client.health(timeout_s=5)
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            failures.append(f"ZeroMQ health: {exc}")
        self.zmq_health.append(time.monotonic() - start)

    def worst(self) -> float:
        return max(self.health + self.completion + self.zmq_health, default=0.0)

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, values in (("health", self.health), ("completion", self.completion),
                             ("zmq_health", self.zmq_health)):
            out[f"{name}_max_s"] = round(max(values, default=0.0), 4)
            out[f"{name}_p50_s"] = round(percentile(values, 0.5) or 0.0, 4)
            out[f"{name}_p99_s"] = round(percentile(values, 0.99) or 0.0, 4)
        return out


def timed_http(port: int, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[float, int]:
    start = time.monotonic()
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=5)
    try:
        conn.request(method, path, body=json.dumps(body) if body else None,
                     headers={"Content-Type": "application/json"} if body else {})
        response = conn.getresponse()
        response.read()
        return time.monotonic() - start, response.status
    except OSError:
        return time.monotonic() - start, 0
    finally:
        conn.close()


def start_tiny(root: Path) -> tuple[subprocess.Popen[bytes], int, str, Path]:
    from edge_runtime.model.testing import make_tiny_model_dir
    from tests.daemon.conftest import TINY_ENGINE_FLAGS, free_tcp_port

    model = make_tiny_model_dir(root / "tiny")
    port = free_tcp_port()
    sock = Path(tempfile.mkdtemp(prefix="mace-atk-")) / "maced.sock"
    log_path = root / "maced.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MACE_")}
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(
        [sys.executable, "-m", "daemon.main", "--model", str(model), "--ipc", str(sock), "--http",
         f"{LOOPBACK}:{port}", "--state-dir", str(root / "state"), "--log-format", "text",
         "--set", "finetune.enabled=false", *TINY_ENGINE_FLAGS],
        cwd=REPO, env=env, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if timed_http(port, "GET", "/health")[1] == 200:
            return proc, port, f"ipc://{sock}", log_path
        time.sleep(0.5)
    raise SystemExit(f"maced did not start:\n{log_path.read_text()[-3000:]}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import zmq

    from daemon.sdk import Client

    root = Path(tempfile.mkdtemp(prefix="attack-idle-"))
    proc = None
    if args.http_port is None:
        proc, port, endpoint, log_path = start_tiny(root)
        pid = proc.pid
    else:
        port, endpoint, log_path, pid = args.http_port, args.endpoint, Path(args.log), args.pid
    if not endpoint.startswith(("ipc://", f"tcp://{LOOPBACK}:")):
        raise SystemExit("only loopback endpoints (ipc:// or tcp://127.0.0.1) are attacked")
    log_before = log_path.stat().st_size
    context = zmq.Context()
    zmq_sockets = []
    attackers = Attackers(port, args.connections)
    failures: list[str] = []
    baseline = Timings()
    timings = Timings()
    try:
        for i in range(args.zmq_sockets):
            s = context.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
            if i % 2:
                s.send_multipart([b"\xc1"])  # not msgpack: answered bad_message, the socket stays
            zmq_sockets.append(s)
        client = Client(endpoint, timeout_s=5, connect_timeout_s=5, retries=0)
        for _ in range(5):  # warm: the first generations compile and allocate, attack or not
            timed_http(port, "POST", "/v1/completions", {"model": "default", "prompt": "hello", "max_tokens": 4})
        # The same client alone first: on a shared machine, its latencies without the attack
        # are the yardstick for those with it.
        until = time.monotonic() + args.baseline_s
        while time.monotonic() < until:
            baseline.round(port, client, [])
            time.sleep(args.every_s)
        end = time.monotonic() + args.duration_s
        # The attack runs beside the client, not between its requests: the client's latency
        # is the daemon's under a steady flood, not the wait behind the tool's own burst.
        attack = threading.Thread(target=attackers.run, args=(end, args.open_per_round, args.reopen_per_s),
                                  daemon=True)
        attack.start()
        while time.monotonic() < end:
            timings.round(port, client, failures)
            time.sleep(args.every_s)
        client.close()
        attack.join(10)
    finally:
        held = attackers.open
        attackers.close()
        for s in zmq_sockets:
            s.close()
        context.term()
    alive = proc.poll() is None if proc is not None else Path(f"/proc/{pid}").exists()
    grown = log_path.stat().st_size - log_before
    with log_path.open("rb") as f:
        f.seek(log_before)
        new_lines = f.read().decode(errors="replace").splitlines()
    # The log's growth by kind of line (digits folded), so a flood names itself.
    kinds = Counter(re.sub(r"\d+", "N", line.split(" ", 2)[-1])[:160] for line in new_lines)
    if proc is not None:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(root, ignore_errors=True)
    worst = timings.worst()
    return {
        "connections_target": args.connections, "connections_opened": attackers.opened,
        "connections_held_at_end": held, "connections_dropped_by_daemon": attackers.dropped,
        "connect_refused": attackers.refused, "reopen_per_s": args.reopen_per_s, "zmq_sockets": args.zmq_sockets, "duration_s": args.duration_s,
        "daemon_alive": alive, **timings.summary(), "client_requests": 3 * len(timings.health),
        "baseline_without_attack": {**baseline.summary(), "duration_s": args.baseline_s},
        "client_failures": failures[:20], "client_failure_count": len(failures), "log_growth_bytes": grown,
        "log_lines": len(new_lines), "log_top_lines": kinds.most_common(5),
        "passed": alive and not failures and worst < 1.0 and grown < 1 << 20,
        "machine": {"cpu": cpu_name(), "loadavg": load_average(), "tiny_model": proc is not None},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--zmq-sockets", type=int, default=200)
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--baseline-s", type=float, default=15.0, help="the client alone first, as a yardstick")
    parser.add_argument("--open-per-round", type=int, default=100,
                        help="connections opened per attack round (a round every 10 ms at most)")
    parser.add_argument("--reopen-per-s", type=float, default=200.0,
                        help="once all are open, dropped ones re-opened at this rate at most")
    parser.add_argument("--every-s", type=float, default=0.1, help="pause between the client's rounds")
    parser.add_argument("--http-port", type=int, help="attack a running maced (else start one, tiny model)")
    parser.add_argument("--endpoint", default="", help="its ZeroMQ endpoint (ipc:// or tcp://127.0.0.1)")
    parser.add_argument("--log", default="", help="its log file")
    parser.add_argument("--pid", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "tools" / "results" / "attack_idle"))
    args = parser.parse_args()
    if args.connections > 5000 or args.zmq_sockets > 1000 or args.duration_s > 600:
        raise SystemExit("bounded: at most 5,000 connections, 1,000 sockets and 600 s")
    result = run(args)
    write_json(f"{args.out}.json", result)
    rows = [[k, v] for k, v in result.items()
            if k not in ("client_failures", "machine", "log_top_lines", "baseline_without_attack")]
    rows += [[f"baseline_without_attack.{k}", v] for k, v in result["baseline_without_attack"].items()]
    write_markdown(f"{args.out}.md", ["# Idle-socket attack (tools/attack_idle.py)", "",
                                      *markdown_table(["measure", "value"], rows), "",
                                      f"Machine: {result['machine']}", ""])
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
