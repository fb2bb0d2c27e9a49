"""TLS and SuperNode authentication between devices and the aggregator (issue #20 item 4): a
device's SuperNode joins only a SuperLink whose certificate the fleet CA signed, and only with a
node key registered there; a SuperNode without them is not even started unless a dev flag says
so. Real flower-superlink / flower-supernode processes on loopback."""

from __future__ import annotations

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


def wait_exit(proc, timeout_s: float = 60.0) -> int:
    proc.wait(timeout_s)
    return proc.returncode


def test_registered_supernode_joins_and_others_are_refused(fleet: LoopbackFleet, tmp_path: Path) -> None:
    joined = fleet.join("good", {})
    deadline = time.monotonic() + 60
    while "SuperNode ID" not in fleet.log("supernode-good"):
        assert joined.poll() is None and time.monotonic() < deadline, fleet.log("supernode-good")
        time.sleep(0.2)

    stranger = fleet.join("stranger", {}, register=False, max_retries=1)
    assert wait_exit(stranger) != 0
    assert "No SuperNode found with the given public key" in fleet.log("supernode-stranger")
    assert "Activation failed" in fleet.log("superlink")

    other_ca = make_tls(tmp_path / "other-ca")
    fooled = fleet.join("fooled", {}, ca_cert=other_ca.ca_cert, max_retries=1)
    assert wait_exit(fooled) != 0
    log = fleet.log("supernode-fooled")
    assert "handshake" in log.lower() and "SuperNode ID" not in log
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
