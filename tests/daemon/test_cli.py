"""`macectl` against a running daemon: tables and --json, generate, feedback, users, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.daemon.conftest import REPO, DaemonProcess


def macectl(endpoint: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MACE_ENDPOINT": endpoint, "COLUMNS": "160"}
    return subprocess.run([sys.executable, "-m", "daemon.sdk.cli", *args], cwd=REPO, env=env, input=stdin,
                          capture_output=True, text=True, timeout=60)


def test_status_table_and_json(shared_daemon: DaemonProcess) -> None:
    table = macectl(shared_daemon.endpoint, "status")
    assert table.returncode == 0, table.stderr
    for heading in ("daemon", "model", "engine", "memory", "telemetry", "admission", "feedback store",
                    "fine-tuning"):
        assert heading in table.stdout
    assert "tiny" in table.stdout and "iteration p50 / p99" in table.stdout
    raw = macectl(shared_daemon.endpoint, "status", "--json")
    status = json.loads(raw.stdout)
    assert status["daemon"]["state"] == "serving" and status["model"]["model"] == "tiny"


def test_generate_consent_feedback_and_erasure_from_the_command_line(shared_daemon: DaemonProcess,
                                                                     tmp_path: Path) -> None:
    ep = shared_daemon.endpoint
    assert macectl(ep, "users", "consent", "frank").stdout.startswith("consent of frank granted")
    gen = macectl(ep, "generate", "Pick one", "-n", "2", "--temperature", "1", "--seed", "11", "--max-tokens", "3",
                  "--user", "frank", "--json")
    assert gen.returncode == 0, gen.stderr
    result = json.loads(gen.stdout)
    assert result["recorded"] is True and len(result["candidates"]) == 2
    iid = result["interaction_id"]
    fb = macectl(ep, "feedback", "frank", iid, "--choose", "0")
    assert fb.returncode == 0 and "1 preference pair" in fb.stdout
    edit = macectl(ep, "feedback", "frank", iid, "--edit", "-", "--candidate", "1", stdin="Better answer.")
    assert edit.returncode == 0, edit.stderr
    out = tmp_path / "frank.json"
    assert macectl(ep, "users", "export", "frank", "-o", str(out)).returncode == 0
    assert oct(out.stat().st_mode & 0o777) == "0o600"
    assert json.loads(out.read_text())["interactions"][0]["request_id"] == iid
    refused = macectl(ep, "users", "forget", "frank")  # not a terminal, no --yes: refuse
    assert refused.returncode == 2 and "--yes" in refused.stderr
    erased = macectl(ep, "users", "forget", "frank", "--yes", "--json")
    assert json.loads(erased.stdout)["interactions"] == 1


def test_streamed_generate_prints_text_and_the_interaction(shared_daemon: DaemonProcess) -> None:
    run = macectl(shared_daemon.endpoint, "generate", "hello", "--max-tokens", "4", "--chat",
                  "--system", "be brief")
    assert run.returncode == 0, run.stderr
    assert "[interaction ix-" in run.stderr and "4 tokens" in run.stderr


def test_typed_errors_and_exit_codes(shared_daemon: DaemonProcess, tmp_path: Path) -> None:
    bad = macectl(shared_daemon.endpoint, "feedback", "nobody", "ix-0", "--rate", "9")
    assert bad.returncode == 1 and bad.stderr.startswith("macectl: ")
    rollback = macectl(shared_daemon.endpoint, "adapters", "rollback", "frank", "2")
    assert rollback.returncode == 1 and "adapter_unavailable" in rollback.stderr
    assert macectl(shared_daemon.endpoint, "adapters", "list", "--json").stdout.strip() == "[]"
    assert macectl(shared_daemon.endpoint, "health").returncode == 0
    gone = macectl(f"ipc://{tmp_path}/none.sock", "--timeout", "1", "health")
    assert gone.returncode == 3 and ("cannot reach" in gone.stderr or "no reply" in gone.stderr)


def test_top_refreshes_a_live_view(shared_daemon: DaemonProcess) -> None:
    top = macectl(shared_daemon.endpoint, "top", "--count", "2", "--interval", "0.2")
    assert top.returncode == 0 and "tokens/s" in top.stdout
