"""Fixtures for daemon tests: the tiny model on disk, and real `maced` processes serving it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from daemon.sdk import Client, ClientError

REPO = Path(__file__).resolve().parents[2]
# The torch backend and the cost calibration before serving: daemon tests test the daemon, and
# the defaults would export and self-check an ONNX graph at every start and calibrate between
# requests, moving the timing these tests were written against (tests/daemon/test_backend_choice.py
# tests both defaults; the tiny model calibrates in well under a second).
TINY_ENGINE_FLAGS = ["--dtype", "float32", "--set", "engine.kv_cache_bytes=8388608",
                     "--set", "engine.num_threads=1", "--set", "engine.backend=torch",
                     "--set", "engine.cost_profile=auto"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from edge_runtime.model.testing import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("model") / "tiny")


class DaemonProcess:
    """One `maced` child process with its own state and socket folders."""

    def __init__(self, root: Path, model: str | Path, *, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None, engine_flags: list[str] | None = None,
                 run_dir: Path | None = None) -> None:
        self.root = root
        self.state_dir = root / "state"
        # Short path: Unix socket paths are limited to 107 bytes and pytest's tmp paths are long.
        self.run_dir = run_dir or Path(f"/tmp/mace-t-{os.getpid()}-{time.monotonic_ns() % 10**9}")
        self.socket = self.run_dir / "maced.sock"
        self.endpoint = f"ipc://{self.socket}"
        self.log_path = root / "maced.log"
        args = [sys.executable, "-m", "daemon.main", "--model", str(model), "--ipc", str(self.socket),
                "--state-dir", str(self.state_dir), "--log-format", "text",
                *(TINY_ENGINE_FLAGS if engine_flags is None else engine_flags), *(extra_args or [])]
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("MACE_")}
        # No HTTP gateway unless a test asks for one (its default port would clash between daemons).
        child_env.update({"PYTHONUNBUFFERED": "1", "MACE_TELEMETRY_INTERVAL_S": "0.5", "MACE_HTTP_BIND": ""})
        child_env.update(env or {})
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, cwd=REPO, env=child_env, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    def client(self, **kwargs: object) -> Client:
        kwargs.setdefault("timeout_s", 30.0)
        return Client(self.endpoint, **kwargs)  # type: ignore[arg-type]

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"maced exited with {self.proc.returncode}:\n{self.log()}")
            if self.socket.exists():
                try:
                    with Client(self.endpoint, timeout_s=1.0, connect_timeout_s=1.0, retries=0) as c:
                        if c.health(timeout_s=1.0).get("ok"):
                            return
                except ClientError:
                    pass
            time.sleep(0.1)
        raise AssertionError(f"maced did not become ready in {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 15.0) -> tuple[int, float]:
        """SIGTERM; returns (exit status, seconds it took)."""
        start = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return self.proc.returncode, time.monotonic() - start


@pytest.fixture
def start_daemon(tmp_path: Path, tiny_model: Path) -> Iterator:
    """Factory: start_daemon(extra_args=[...], env={...}, ready=True) -> DaemonProcess."""
    started: list[DaemonProcess] = []

    def start(*, extra_args: list[str] | None = None, env: dict[str, str] | None = None,
              ready: bool = True, model: str | Path | None = None,
              engine_flags: list[str] | None = None, run_dir: Path | None = None) -> DaemonProcess:
        root = tmp_path / f"d{len(started)}"
        root.mkdir()
        d = DaemonProcess(root, model or tiny_model, extra_args=extra_args, env=env,
                          engine_flags=engine_flags, run_dir=run_dir)
        started.append(d)
        if ready:
            d.wait_ready()
        return d

    yield start
    for d in started:
        d.stop()


@pytest.fixture(scope="session")
def shared_daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[DaemonProcess]:
    """One daemon shared by the tests that do not stop or reconfigure it (a start costs seconds)."""
    d = DaemonProcess(tmp_path_factory.mktemp("daemon"), tiny_model,
                      extra_args=["--set", "server.max_inflight_per_client=16",
                                  "--set", "finetune.enabled=false"])
    d.wait_ready()
    yield d
    code, _ = d.stop()
    assert code == 0, d.log()


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout_s: float = 60.0, every_s: float = 0.2) -> T:
    """Poll `predicate` until it returns something truthy (returned), or fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError("condition not met in time")
