"""Fleet consent over the wire (issue #20): `users.consent` takes `fleet` beside `granted` (an old
client sending only `granted` keeps working), the reply shows both, and `macectl users consent`
sets and prints it; the daemon's export carries it and erasure removes it."""

from __future__ import annotations

import json

import pytest

from daemon.sdk import RemoteError
from tests.daemon.conftest import DaemonProcess
from tests.daemon.test_cli import macectl


def test_fleet_consent_round_trip_over_zeromq(shared_daemon: DaemonProcess) -> None:
    with shared_daemon.client() as c:
        # The original form: `granted` only. Fleet consent starts off.
        old_style = c.request("users.consent", user="fleet-ann", granted=True)
        assert old_style == {"user": "fleet-ann", "granted": True, "fleet": False, "changed": True}
        assert c.consent("fleet-ann", granted=None, fleet=True) == {
            "user": "fleet-ann", "granted": True, "fleet": True, "changed": True}
        assert c.export("fleet-ann")["consent"]["fleet"]["granted"] is True
        # Withdrawing feedback consent leaves the fleet flag stored (it no longer counts).
        assert c.consent("fleet-ann", granted=False)["fleet"] is True
        assert c.consent("fleet-ann", granted=None, fleet=False)["fleet"] is False
        assert c.status()["feedback"]["fleet_users"] == 0

        with pytest.raises(RemoteError) as info:
            c.consent("fleet-nobody", granted=None, fleet=True)
        assert info.value.code == "consent_required" and "feedback collection" in info.value.message
        with pytest.raises(RemoteError) as info:
            c.consent("fleet-ann", granted=False, fleet=True)
        assert info.value.code == "bad_request" and info.value.param == "fleet"
        with pytest.raises(RemoteError) as info:
            c.request("users.consent", user="fleet-ann", fleet="yes")
        assert info.value.code == "bad_request"

        c.consent("fleet-ann", fleet=True)
        erased = c.forget("fleet-ann")
        assert erased["interactions"] == 0
        assert c.consent("fleet-ann", granted=None, fleet=False) == {
            "user": "fleet-ann", "granted": False, "fleet": False, "changed": False}


def test_macectl_users_consent_sets_and_shows_fleet_consent(shared_daemon: DaemonProcess) -> None:
    ep = shared_daemon.endpoint
    plain = macectl(ep, "users", "consent", "fleet-gus")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip() == "consent of fleet-gus granted; fleet consent off"
    both = macectl(ep, "users", "consent", "fleet-gus", "--fleet")
    assert both.stdout.strip() == "consent of fleet-gus granted; fleet consent on"
    off = macectl(ep, "users", "consent", "fleet-gus", "--withdraw-fleet", "--json")
    assert json.loads(off.stdout) == {"user": "fleet-gus", "granted": True, "fleet": False, "changed": True}
    clash = macectl(ep, "users", "consent", "fleet-gus", "--withdraw", "--fleet")
    assert clash.returncode == 2 and "not allowed with" in clash.stderr
    refused = macectl(ep, "users", "consent", "fleet-nobody", "--withdraw-fleet")
    assert refused.returncode == 0 and refused.stdout.strip().endswith("(unchanged); fleet consent off")
