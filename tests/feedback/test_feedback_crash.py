"""Crash safety: a writer process SIGKILLed at random points never loses acknowledged feedback
and never leaves a database that fails `PRAGMA integrity_check`."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edge_runtime.feedback import FeedbackStore

ROOT = Path(__file__).resolve().parents[2]
WRITER = Path(__file__).with_name("crash_writer.py")
ROUNDS = 20


def _acknowledged(path: Path) -> set[str]:
    if not path.exists():
        return set()
    return {line for line in path.read_text().split("\n")[:-1]}  # only complete lines


def _check_database(db: Path) -> set[str]:
    """Reopen as a fresh process would (WAL recovery), check integrity, list stored feedback."""
    conn = sqlite3.connect(str(db))
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
        return {rid for (rid,) in conn.execute(
            "SELECT i.request_id FROM interactions i JOIN feedback f ON f.interaction_id = i.id")}
    finally:
        conn.close()


@pytest.mark.timeout(180)
def test_sigkill_during_a_burst_keeps_every_acknowledged_feedback(tmp_path: Path) -> None:
    rng = random.Random(0x5EED)
    db, acks = tmp_path / "feedback.sqlite3", tmp_path / "acks.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rounds_with_acks = 0
    for round_no in range(ROUNDS):
        before = _acknowledged(acks)
        proc = subprocess.Popen(
            [sys.executable, str(WRITER), str(db), str(acks), f"r{round_no}"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        if round_no % 5 == 0:
            # Some kills land while the store opens (schema creation, WAL recovery).
            time.sleep(rng.uniform(0.0, 0.3))
        else:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n", proc.stderr
            time.sleep(rng.uniform(0.02, 0.4))
        proc.send_signal(signal.SIGKILL)
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL, f"writer died on its own:\n{stderr}"

        acknowledged = _acknowledged(acks)
        stored = _check_database(db) if db.exists() else set()
        missing = acknowledged - stored
        assert not missing, f"round {round_no}: acknowledged but lost: {sorted(missing)[:5]}"
        rounds_with_acks += len(acknowledged) > len(before)

    assert rounds_with_acks >= ROUNDS // 2
    with FeedbackStore(db) as store:  # the daemon's own open path also recovers cleanly
        stats = store.stats()
        assert stats.feedback >= len(_acknowledged(acks)) > 100
        assert stats.interactions >= stats.feedback
