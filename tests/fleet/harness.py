"""A fleet on loopback for tests: the aggregator's SuperLink (TLS, SuperNode authentication), one
SuperNode per device (its own Flower home, node key and ClientApp port), run submission. Every
process runs in its own session and is stopped with its children (Flower's SuperExec and apps)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from daemon.fleet.offdevice.deploy import (
    Addresses,
    flower_env,
    make_node_key,
    make_tls,
    register_node,
    run_command,
    superlink_command,
    supernode_command,
    write_connection,
)
from daemon.fleet.offdevice.signing import write_keypair


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen, log: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on {port} after {timeout_s} s:\n{log.read_text(errors='replace')[-4000:]}")


class LoopbackFleet:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.tls = make_tls(root / "tls")
        self.addresses = Addresses(fleet=f"127.0.0.1:{free_port()}", control=f"127.0.0.1:{free_port()}",
                                   serverappio=f"127.0.0.1:{free_port()}")
        self.home = root / "aggregator"
        write_connection(self.home, self.addresses.control, self.tls.ca_cert)
        self.signing_key, self.signing_public = root / "aggregator.key", root / "aggregator.pub"
        write_keypair(self.signing_key, self.signing_public)
        self.procs: list[subprocess.Popen] = []
        self.logs: dict[str, Path] = {}
        self.nodes: dict[str, int] = {}  # device name -> its SuperNode's id on the SuperLink

    def _spawn(self, name: str, cmd: list[str], home: Path) -> subprocess.Popen:
        log = self.root / f"{name}.log"
        self.logs[name] = log
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, env=flower_env(home), stdout=out, stderr=subprocess.STDOUT,
                                    cwd=self.root, start_new_session=True)
        self.procs.append(proc)
        return proc

    def start_superlink(self) -> None:
        proc = self._spawn("superlink", superlink_command(self.tls, self.addresses), self.home)
        wait_listening(int(self.addresses.fleet.rsplit(":", 1)[1]), proc, self.logs["superlink"])
        wait_listening(int(self.addresses.control.rsplit(":", 1)[1]), proc, self.logs["superlink"])

    def join(self, name: str, node_config: dict[str, Any], *, register: bool = True,
             ca_cert: Path | None = None, max_retries: int | None = None) -> subprocess.Popen:
        """A device's SuperNode with a fresh node key (registered unless told otherwise)."""
        home = self.root / f"device-{name}"
        key, public = make_node_key(home, "node-key")
        if register:
            self.nodes[name] = register_node(self.home, public)
        config = {"aggregator-key": str(self.signing_public), **node_config}
        cmd = supernode_command(self.addresses.fleet, ca_cert or self.tls.ca_cert, key, config,
                                clientappio=f"127.0.0.1:{free_port()}", max_retries=max_retries)
        return self._spawn(f"supernode-{name}", cmd, home)

    def wait_joined(self, name: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while "SuperNode ID" not in self.log(f"supernode-{name}"):
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} did not join:\n{self.log(f'supernode-{name}')[-4000:]}")
            time.sleep(0.2)

    def run(self, run_config: dict[str, Any], timeout_s: float) -> subprocess.CompletedProcess[str]:
        config = {"signing-key": str(self.signing_key), **run_config}
        return subprocess.run(run_command(config), env=flower_env(self.home), capture_output=True, text=True,
                              timeout=timeout_s, cwd=self.root)

    def log(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            try:  # SuperExec and the apps it started share the session; end any left over
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
