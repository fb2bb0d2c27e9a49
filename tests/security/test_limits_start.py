"""What maced refuses at start (secret files others can read, loopback TCP without CURVE and
without the opt-in), the SDK's refusal of a /tmp socket someone else planted, and the pieces
of the limits (descriptor budget, once-per-interval logging, Host names) on their own."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from daemon.fronts.http.guard import host_name
from daemon.limits import EveryInterval, LimitError, LimitSettings, http_connection_cap
from daemon.wire import endpoints
from tests.daemon.conftest import REPO


def maced(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    child = {k: v for k, v in os.environ.items() if not k.startswith("MACE_")}
    child.update({"MACE_HTTP_BIND": "", **(env or {})})
    # --print-config stops after the checks maced makes before it loads anything.
    return subprocess.run([sys.executable, "-m", "daemon.main", *args], cwd=REPO, env=child,
                          capture_output=True, text=True, timeout=60)


def test_a_world_readable_curve_secret_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "server.key_secret"
    secret.write_text("not read before the mode check\n")
    secret.chmod(0o644)
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    run = maced("--tcp", "tcp://0.0.0.0:1", "--set", f"server.curve_secret_key={secret}",
                "--set", f"server.curve_authorized_keys={authorized}", "--state-dir", str(tmp_path / "s"),
                "--ipc", str(tmp_path / "sock"), "--model", str(tmp_path / "absent"))
    assert run.returncode == 2 and "chmod 600" in run.stderr, run.stderr


def test_an_api_key_file_others_can_read_is_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k" * 32 + "\n")
    keys.chmod(0o604)
    run = maced("--set", f"http.api_key_file={keys}", "--ipc", str(tmp_path / "sock"),
                "--state-dir", str(tmp_path / "s"), "--model", str(tmp_path / "absent"))
    assert run.returncode == 2 and "http.api_key_file" in run.stderr, run.stderr


def test_loopback_tcp_without_curve_needs_the_opt_in(tmp_path: Path) -> None:
    run = maced("--tcp", "tcp://127.0.0.1:1", "--ipc", str(tmp_path / "sock"),
                "--state-dir", str(tmp_path / "s"), "--model", str(tmp_path / "absent"))
    assert run.returncode == 2 and "server.tcp_without_curve" in run.stderr, run.stderr


def test_the_documented_curve_command_writes_a_private_secret(tmp_path: Path) -> None:
    import zmq.auth as zmq_auth
    doc = (REPO / "docs" / "daemon.md").read_text()
    assert "umask 077" in doc  # the command as docs/daemon.md gives it
    old = os.umask(0o077)
    try:
        _, secret = zmq_auth.create_certificates(str(tmp_path), "server")
    finally:
        os.umask(old)
    assert Path(secret).stat().st_mode & 0o077 == 0


def test_a_planted_tmp_socket_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("MACE_ENDPOINT", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    own = endpoints.default_ipc_path()
    own.parent.mkdir()
    own.write_text("")  # stands in for the socket: only owner and mode are looked at
    own.parent.chmod(0o777)  # someone else could have put it there
    with pytest.raises(endpoints.UntrustedSocket):
        endpoints.default_client_endpoint()
    own.parent.chmod(0o700)
    assert endpoints.default_client_endpoint() == f"ipc://{own}"


def test_the_http_connection_cap_leaves_the_reserve() -> None:
    limits = LimitSettings()
    assert http_connection_cap(limits, nofile=65536) == limits.http_max_connections
    assert http_connection_cap(limits, nofile=1024) == 1024 - limits.fd_reserve
    with pytest.raises(LimitError):
        http_connection_cap(limits, nofile=limits.fd_reserve + 8)


def test_a_repeating_failure_is_logged_once_per_interval() -> None:
    now = [0.0]
    every = EveryInterval(10.0, clock=lambda: now[0])
    lines = []
    for i in range(140_000):
        now[0] = i * 0.0001  # 14 s of failures
        suppressed = every.due()
        if suppressed is not None:
            lines.append(suppressed)
    assert len(lines) == 2 and lines[0] == 0 and lines[1] > 90_000


def test_host_names() -> None:
    assert host_name("LocalHost:8000") == "localhost"
    assert host_name("[::1]:8000") == "::1"
    assert host_name("127.0.0.1") == "127.0.0.1"
    assert host_name("localhost.:80") == "localhost"
    assert host_name("evil.example:8000") == "evil.example"
