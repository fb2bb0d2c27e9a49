"""TLS and SuperNode authentication between devices and the aggregator (issue #20 item 4): a
device's SuperNode joins only a SuperLink whose certificate the fleet CA signed, and only with a
node key registered there; a SuperNode without them is not even started unless a dev flag says
so. Real flower-superlink / flower-supernode processes on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from daemon.fleet.offdevice.deploy import (
    Addresses,
    FleetSetupError,
    make_tls,
    superlink_command,
    supernode_command,
)
from tests.fleet.harness import LoopbackFleet


@pytest.fixture
def fleet(tmp_path: Path):
    f = LoopbackFleet(tmp_path)
    f.start_superlink()
    yield f
    f.stop()


def wait_refused(fleet: LoopbackFleet, name: str, proc, sign: str, timeout_s: float = 120.0) -> str:
    """The refused SuperNode's log once it shows `sign` (or the process has ended). Whether Flower's
    process then exits promptly is Flower's business (a CI run once saw one linger past 60 s after
    the refusal), so a lingering one is stopped rather than waited for: the refusal is the check."""
    deadline = time.monotonic() + timeout_s
    while sign not in fleet.log(f"supernode-{name}") and proc.poll() is None:
        assert time.monotonic() < deadline, fleet.log(f"supernode-{name}")[-4000:]
        time.sleep(0.2)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    return fleet.log(f"supernode-{name}")


def test_registered_supernode_joins_and_others_are_refused(fleet: LoopbackFleet, tmp_path: Path) -> None:
    joined = fleet.join("good", {})
    deadline = time.monotonic() + 60
    while "SuperNode ID" not in fleet.log("supernode-good"):
        assert joined.poll() is None and time.monotonic() < deadline, fleet.log("supernode-good")
        time.sleep(0.2)

    stranger = fleet.join("stranger", {}, register=False, max_retries=1)
    sign = "No SuperNode found with the given public key"
    log = wait_refused(fleet, "stranger", stranger, sign)
    assert sign in log and "SuperNode ID" not in log and stranger.returncode != 0
    assert "Activation failed" in fleet.log("superlink")

    other_ca = make_tls(tmp_path / "other-ca")
    fooled = fleet.join("fooled", {}, ca_cert=other_ca.ca_cert, max_retries=1)
    log = wait_refused(fleet, "fooled", fooled, "handshake error detected")
    assert "handshake" in log.lower() and "SuperNode ID" not in log and fooled.returncode != 0
    assert joined.poll() is None  # the registered device stays connected throughout


def test_no_plaintext_or_anonymous_supernode_without_the_dev_flag(tmp_path: Path) -> None:
    key = tmp_path / "node-key"
    with pytest.raises(FleetSetupError, match="fleet CA"):
        supernode_command("127.0.0.1:9092", None, key, {})
    with pytest.raises(FleetSetupError, match="node key"):
        supernode_command("127.0.0.1:9092", tmp_path / "ca.crt", None, {})
    with pytest.raises(FleetSetupError, match="TLS"):
        superlink_command(None, Addresses())
    dev = supernode_command("127.0.0.1:9092", None, None, {"maced-endpoint": "ipc:///x"}, dev_insecure=True)
    assert "--insecure" in dev
    secure = supernode_command("127.0.0.1:9092", tmp_path / "ca.crt", key, {})
    assert "--insecure" not in secure and "--root-certificates" in secure
    assert "--auth-supernode-private-key" in secure
