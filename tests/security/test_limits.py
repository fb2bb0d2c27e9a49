"""Limits against a real `maced` (tiny model): one request cannot queue 64 x 16 sequences, more
ZeroMQ sockets do not buy more sequences in flight, and 300 half-sent HTTP connections (under a
small LimitNOFILE) neither stop /health nor flood the log."""

from __future__ import annotations

import http.client
import json
import resource
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.sdk import RemoteError
from tests.daemon.conftest import DaemonProcess, free_tcp_port, tiny_model  # noqa: F401 - fixture


def post(port: int, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def health_s(port: int) -> float:
    start = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
    finally:
        conn.close()
    return time.monotonic() - start


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[tuple[DaemonProcess, int]]:  # noqa: F811
    port = free_tcp_port()
    d = DaemonProcess(tmp_path_factory.mktemp("limits"), tiny_model,
                      extra_args=["--http", f"127.0.0.1:{port}", "--set", "finetune.enabled=false",
                                  "--set", "limits.max_sequences_per_client=4",
                                  "--set", "limits.http_request_read_timeout_s=3"])
    # What LimitNOFILE=320 would give it: set before the daemon reaches its HTTP start.
    resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (320, 320))
    d.wait_ready()
    yield d, port
    d.stop()


def test_64_prompts_times_16_are_refused_up_front(daemon: tuple[DaemonProcess, int]) -> None:
    _, port = daemon
    status, body = post(port, "/v1/completions", {"model": "tiny", "prompt": ["hi"] * 64, "n": 16,
                                                   "max_tokens": 4})
    assert status == 400 and body["error"]["code"] == "bad_request", body
    assert "1024 sequences" in body["error"]["message"] and "max_sequences_per_request" in body["error"]["message"]


def test_more_sockets_do_not_buy_more_sequences(daemon: tuple[DaemonProcess, int]) -> None:
    d, _ = daemon
    outcomes: list[object] = []

    def one() -> None:
        with d.client(retries=0) as c:
            try:
                c.generate("go on", n=2, max_tokens=200, ignore_eos=True, timeout_s=90)
                outcomes.append("ok")
            except RemoteError as exc:
                outcomes.append(exc)

    threads = [threading.Thread(target=one) for _ in range(6)]  # six sockets, quota of 4 sequences
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    refused = [o for o in outcomes if isinstance(o, RemoteError)]
    assert refused and all(o.code == "busy" and "max_sequences_per_client" in o.message for o in refused), outcomes
    assert outcomes.count("ok") >= 1


def test_half_sent_connections_do_not_stop_health_or_flood_the_log(daemon: tuple[DaemonProcess, int]) -> None:
    d, port = daemon
    log_before = d.log_path.stat().st_size
    sockets: list[socket.socket] = []
    try:
        for i in range(300):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n"
                      if i % 2 else b"GET /health HTTP/1.1\r\nHo")
            sockets.append(s)
        time.sleep(0.5)
        worst = max(health_s(port) for _ in range(5))
        assert worst < 1.0, worst
        with d.client() as c:
            assert c.health(timeout_s=1.0)["ok"]
    finally:
        for s in sockets:
            s.close()
    assert d.proc.poll() is None
    grown = d.log_path.stat().st_size - log_before
    assert grown < 4096, d.log()[-2000:]
