"""The daemon process's life: systemd notifications, SIGHUP reload, SIGTERM drain with no
acknowledged feedback lost, admission rejection, TCP and CURVE endpoints, a model that won't load or fit its memory budget."""

from __future__ import annotations

import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import zmq
import zmq.auth

from daemon.sdk import Client, ClientError, RemoteError
from edge_runtime.feedback import FeedbackStore
from tests.daemon.conftest import free_tcp_port


class NotifyListener:
    """Plays systemd's side of NOTIFY_SOCKET: collects every datagram the daemon sends."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.lines: list[tuple[float, str]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            now = time.monotonic()
            self.lines.extend((now, line) for line in data.decode().split("\n"))

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.sock.close()

    def seen(self, prefix: str) -> list[str]:
        return [line for _, line in self.lines if line.startswith(prefix)]


def test_notify_ready_watchdog_sighup_reload_and_stop(start_daemon, tmp_path: Path) -> None:
    listener = NotifyListener(tmp_path / "notify.sock")
    config = tmp_path / "maced.toml"
    config.write_text("[server]\ndefault_max_tokens = 3\n")
    try:
        d = start_daemon(env={"NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": "1000000"},
                         extra_args=["--config", str(config)])
        time.sleep(1.2)
        assert listener.seen("READY=1") and any("serving tiny" in s for s in listener.seen("STATUS="))
        assert len(listener.seen("WATCHDOG=1")) >= 2  # every 0.5 s, from the idle engine loop

        # SIGHUP applies what is safe to change now and names what needs a restart.
        with Client(d.endpoint, timeout_s=10) as c:
            assert c.generate("x", ignore_eos=True).usage["completion_tokens"] == 3
            config.write_text("[server]\ndefault_max_tokens = 5\n[engine]\nmax_num_seqs = 8\n")
            d.signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while "SIGHUP" not in d.log() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.generate("x", ignore_eos=True).usage["completion_tokens"] == 5
        assert ("reloaded server.default_max_tokens; needs a restart to change: engine.max_num_seqs"
                in d.log())
        assert listener.seen("RELOADING=1") and len(listener.seen("READY=1")) == 2
        config.write_text("[server]\nnot_a_setting = 1\n")
        d.signal(signal.SIGHUP)
        time.sleep(0.5)
        assert "config not reloaded" in d.log() and d.proc.poll() is None

        code, took = d.stop()
        assert code == 0 and took < 10
        assert listener.seen("STOPPING=1")
    finally:
        listener.close()


def test_sigterm_drains_streams_and_loses_no_acknowledged_feedback(start_daemon) -> None:
    d = start_daemon(extra_args=["--set", "server.drain_timeout_s=1"])
    acked: list[tuple[str, int]] = []
    outcomes: list[str] = []
    with Client(d.endpoint, timeout_s=20) as c:
        c.consent("dora")
        for _ in range(5):
            r = c.generate("rate me", max_tokens=2, n=2, temperature=1.0, user="dora")
            assert r.recorded, (r, d.log())  # the note says why an interaction was not stored
            acked.append((r.interaction_id, c.choose("dora", r.interaction_id, 1)["feedback_id"]))

    def stream_forever() -> None:
        with Client(d.endpoint, timeout_s=20) as c:
            try:
                for _ in c.stream("long", max_tokens=100_000, ignore_eos=True):
                    pass
                outcomes.append("finished")
            except RemoteError as exc:
                outcomes.append(exc.code)

    threads = [threading.Thread(target=stream_forever) for _ in range(4)]
    for t in threads:
        t.start()
    survivor = Client(d.endpoint, timeout_s=5, connect_timeout_s=5, retries=3)
    first_pid = survivor.status()["daemon"]["pid"]
    time.sleep(1.0)
    code, took = d.stop()
    for t in threads:
        t.join(10)
    assert code == 0 and took < 10, d.log()
    assert outcomes == ["shutting_down"] * 4  # each stream got exactly one final reply, typed
    with FeedbackStore(d.state_dir / "feedback.sqlite3") as store:
        exported = store.export_user("dora")
    stored = {(i["request_id"], len(i["feedback"])) for i in exported["interactions"]}
    assert stored == {(iid, 1) for iid, _ in acked}

    # A client of the old process keeps working once a new daemon listens on the same socket:
    # idempotent operations are resent on a fresh connection until one answers.
    second = start_daemon(run_dir=d.run_dir, ready=False)
    deadline = time.monotonic() + 90
    while True:
        try:
            status = survivor.status()
            break
        except ClientError:
            assert time.monotonic() < deadline, second.log()
    survivor.close()
    assert status["daemon"]["pid"] not in (first_pid, None)


def test_admission_rejects_under_memory_pressure_on_a_loopback_tcp_endpoint(start_daemon) -> None:
    # A reserve larger than any machine's memory: headroom is negative, admission says reject.
    port = free_tcp_port()
    d = start_daemon(env={"MACE_TELEMETRY_MEMORY_RESERVE_MB": "100000000"},
                     extra_args=["--tcp", f"tcp://127.0.0.1:{port}", "--set", "server.tcp_without_curve=true"])
    with Client(f"tcp://127.0.0.1:{port}", timeout_s=10) as c:
        deadline = time.monotonic() + 10
        while c.health()["admission"] != "reject" and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(RemoteError) as info:
            c.generate("hello", max_tokens=2)
        status = c.status()
    assert info.value.code == "admission_rejected" and info.value.retry_after_s >= 2.0
    assert "memory headroom" in info.value.message
    assert status["admission"]["state"] == "reject"
    assert status["daemon"]["endpoints"] == [d.endpoint, f"tcp://127.0.0.1:{port}"]


def test_curve_tcp_admits_only_authorized_clients(start_daemon, tmp_path: Path) -> None:
    keys, authorized = tmp_path / "keys", tmp_path / "authorized"
    keys.mkdir()
    authorized.mkdir()
    _, server_secret = zmq.auth.create_certificates(str(keys), "server")
    Path(server_secret).chmod(0o600)  # maced refuses a secret others can read
    client_public, client_secret = zmq.auth.create_certificates(str(keys), "client")
    Path(client_public).rename(authorized / "client.key")
    port = free_tcp_port()
    start_daemon(extra_args=["--tcp", f"tcp://0.0.0.0:{port}",
                             "--set", f"server.curve_secret_key={server_secret}",
                             "--set", f"server.curve_authorized_keys={authorized}"])
    server_public, _ = zmq.auth.load_certificate(server_secret)
    allowed = zmq.auth.load_certificate(client_secret)
    with Client(f"tcp://127.0.0.1:{port}", timeout_s=10, curve_server_key=server_public,
                curve_client_keys=allowed) as c:
        assert c.health()["ok"]
    with Client(f"tcp://127.0.0.1:{port}", timeout_s=1, connect_timeout_s=1, retries=0,
                curve_server_key=server_public) as stranger:  # a fresh key the daemon never saw
        with pytest.raises(Exception) as info:
            stranger.health()
    assert type(info.value).__name__ == "DaemonUnavailable"


def test_a_missing_curve_authorized_keys_folder_refuses_to_start(start_daemon, tmp_path: Path) -> None:
    """Like a missing server key: a CURVE daemon that would admit nobody must not start."""
    keys = tmp_path / "keys"
    keys.mkdir()
    _, server_secret = zmq.auth.create_certificates(str(keys), "server")
    Path(server_secret).chmod(0o600)  # maced refuses a secret others can read
    d = start_daemon(extra_args=["--tcp", f"tcp://0.0.0.0:{free_tcp_port()}",
                                 "--set", f"server.curve_secret_key={server_secret}",
                                 "--set", f"server.curve_authorized_keys={tmp_path / 'no-such-folder'}"],
                     ready=False)
    assert d.proc.wait(60) == 1
    assert "no-such-folder is not a folder of client public keys" in d.log()


def test_a_model_that_cannot_load_exits_1(start_daemon, tmp_path: Path) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    d = start_daemon(model=broken, ready=False)
    assert d.proc.wait(60) == 1
    assert "could not be loaded" in d.log()


def test_a_memory_budget_below_the_model_exits_1_with_the_numbers(start_daemon) -> None:
    d = start_daemon(extra_args=["--set", "engine.memory_budget_bytes=65536"], ready=False)
    assert d.proc.wait(60) == 1
    log = d.log()
    assert "could not be loaded" in log and "is below what serving this model needs" in log
    assert "weights" in log and "KV cache minimum" in log
