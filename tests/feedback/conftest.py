"""Fixtures for the feedback-store tests: a store in a temporary folder and a table snapshot."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from edge_runtime.feedback import FeedbackStore, FeedbackStoreConfig


class FakeClock:
    """Wall clock the tests can move (retention compares ages)."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def adapters_root(tmp_path: Path) -> Path:
    root = tmp_path / "adapters"
    root.mkdir()
    return root


@pytest.fixture
def store(tmp_path: Path, adapters_root: Path, clock: FakeClock) -> Iterator[FeedbackStore]:
    s = FeedbackStore(tmp_path / "feedback.sqlite3", adapters_root=adapters_root,
                      config=FeedbackStoreConfig(heldout_fraction=0.0), clock=clock)
    yield s
    s.close()


def _table_snapshot(path: Path) -> dict[str, list[tuple]]:
    conn = sqlite3.connect(str(path))
    try:
        tables = [name for (name,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        return {t: sorted(conn.execute(f"SELECT * FROM {t}").fetchall(), key=repr) for t in tables}
    finally:
        conn.close()


@pytest.fixture
def table_snapshot() -> Callable[[Path], dict[str, list[tuple]]]:
    """Every row of every table, read through a separate connection: "store unchanged" checks."""
    return _table_snapshot
