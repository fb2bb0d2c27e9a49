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
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.report import cpu_name, load_average, markdown_table, write_json, write_markdown  # noqa: E402

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

    def close(self) -> None:
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self.selector.close()


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
    health: list[float] = []
    completion: list[float] = []
    zmq_health: list[float] = []
    failures: list[str] = []
    try:
        for i in range(args.zmq_sockets):
            s = context.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
            if i % 2:
                s.send_multipart([b"\xc1"])  # not msgpack: answered bad_message, the socket stays
            zmq_sockets.append(s)
        client = Client(endpoint, timeout_s=5, connect_timeout_s=5, retries=0)
        end = time.monotonic() + args.duration_s
        while time.monotonic() < end:
            attackers.reap()
            attackers.fill(args.open_per_round)
            elapsed, status = timed_http(port, "GET", "/health")
            health.append(elapsed)
            if status != 200:
                failures.append(f"/health answered {status}")
            elapsed, status = timed_http(port, "POST", "/v1/completions",
                                         {"model": "default", "prompt": "hello", "max_tokens": 4})
            completion.append(elapsed)
            if status != 200:
                failures.append(f"/v1/completions answered {status}")
            start = time.monotonic()
            try:
                client.health(timeout_s=5)
            except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                failures.append(f"ZeroMQ health: {exc}")
            zmq_health.append(time.monotonic() - start)
            time.sleep(args.every_s)
        client.close()
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
    worst = max(health + completion + zmq_health)
    return {
        "connections_target": args.connections, "connections_opened": attackers.opened,
        "connections_held_at_end": held, "connections_dropped_by_daemon": attackers.dropped,
        "connect_refused": attackers.refused, "zmq_sockets": args.zmq_sockets, "duration_s": args.duration_s,
        "daemon_alive": alive, "health_max_s": round(max(health), 4), "completion_max_s": round(max(completion), 4),
        "zmq_health_max_s": round(max(zmq_health), 4), "client_requests": len(health) * 3,
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
    parser.add_argument("--open-per-round", type=int, default=400, help="new connections per client round")
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
    rows = [[k, v] for k, v in result.items() if k not in ("client_failures", "machine", "log_top_lines")]
    write_markdown(f"{args.out}.md", ["# Idle-socket attack (tools/attack_idle.py)", "",
                                      *markdown_table(["measure", "value"], rows), "",
                                      f"Machine: {result['machine']}", ""])
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
