"""The training queue over preference pairs and unpaired examples: what the trainer draws, and
what it reports back.

Only consented users' train-split rows are ever drawn for training; held-out rows are read for
evaluation and refuse `mark_trained`. Adapter versions and the pairs they learned from live here
too, so erasure and export can name them.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Iterable, Sequence

from edge_runtime.errors import BadRequest
from edge_runtime.feedback.errors import UnknownPair, UnknownUser
from edge_runtime.feedback.records import (
    HELDOUT,
    PAIR_STATUSES,
    SPLITS,
    TRAINED,
    AdapterVersionRecord,
    FleetMaterial,
    PreferencePair,
    UnpairedExample,
)

_PAIR_COLUMNS = (
    "p.id, p.user_id, p.prompt, p.chosen, p.rejected, p.rule, p.split, p.status, p.support,"
    " p.train_count, p.last_dpo_loss, p.created_at"
)


def _pair(row: Sequence) -> PreferencePair:
    return PreferencePair(
        id=int(row[0]), user_id=row[1], prompt=row[2], chosen=row[3], rejected=row[4],
        rule=row[5], split=row[6], status=row[7], support=int(row[8]), train_count=int(row[9]),
        last_dpo_loss=None if row[10] is None else float(row[10]), created_at=float(row[11]),
    )


def next_pairs(
    conn: sqlite3.Connection, user_id: str | None, limit: int, split: str, status: str
) -> list[PreferencePair]:
    # Oldest first: feedback is trained in the order users gave it; the scheduler re-prioritises
    # by DPO loss once it has scored them.
    rows = _queued_rows(conn, "pairs", _PAIR_COLUMNS, user_id, limit, split, status)
    return [_pair(row) for row in rows]


def _queued_rows(
    conn: sqlite3.Connection, table: str, columns: str, user_id: str | None, limit: int, split: str,
    status: str,
) -> list[Sequence]:
    """Rows of `table` (pairs or unpaired, aliased p and x in `columns`) of consented users in one
    split and status, oldest first; `user_id` None: every user's."""
    if split not in SPLITS:
        raise BadRequest(f"split must be one of {SPLITS}; got {split!r}")
    if status not in PAIR_STATUSES:
        raise BadRequest(f"status must be one of {PAIR_STATUSES}; got {status!r}")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise BadRequest(f"limit must be an integer >= 1; got {limit!r}")
    alias = {"pairs": "p", "unpaired": "x"}[table]
    sql = (
        f"SELECT {columns} FROM {table} {alias} JOIN users u ON u.user_id = {alias}.user_id"
        f" WHERE u.consent = 1 AND {alias}.split = ? AND {alias}.status = ?"
    )
    args: list[object] = [split, status]
    if user_id is not None:
        sql += f" AND {alias}.user_id = ?"
        args.append(user_id)
    sql += f" ORDER BY {alias}.id LIMIT ?"
    args.append(limit)
    return list(conn.execute(sql, args))


def heldout_pairs(conn: sqlite3.Connection, user_id: str) -> list[PreferencePair]:
    rows = conn.execute(
        f"SELECT {_PAIR_COLUMNS} FROM pairs p WHERE p.user_id = ? AND p.split = ? ORDER BY p.id",
        (user_id, HELDOUT),
    )
    return [_pair(row) for row in rows]


def get_pair(conn: sqlite3.Connection, pair_id: int) -> PreferencePair:
    row = conn.execute(f"SELECT {_PAIR_COLUMNS} FROM pairs p WHERE p.id = ?", (pair_id,)).fetchone()
    if row is None:
        raise UnknownPair(f"no preference pair {pair_id!r} (erased, expired or never created)")
    return _pair(row)


def pending_counts(conn: sqlite3.Connection, table: str = "pairs") -> dict[str, int]:
    """Pending train-split pairs (or, `table="unpaired"`, unpaired examples) per consented user
    (users with none are absent)."""
    if table not in ("pairs", "unpaired"):
        raise BadRequest(f"table must be 'pairs' or 'unpaired'; got {table!r}")
    rows = conn.execute(
        f"SELECT p.user_id, count(*) FROM {table} p JOIN users u ON u.user_id = p.user_id"
        " WHERE u.consent = 1 AND p.split = 'train' AND p.status = 'pending' GROUP BY p.user_id"
    )
    return {str(user): int(n) for user, n in rows}


def check_losses(results: Iterable[tuple[int, float]]) -> list[tuple[int, float]]:
    checked = []
    for pair_id, loss in results:
        if not isinstance(pair_id, int) or isinstance(pair_id, bool):
            raise BadRequest(f"pair id must be an integer; got {pair_id!r}")
        if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss):
            raise BadRequest(f"DPO loss of pair {pair_id} must be a finite number; got {loss!r}")
        checked.append((pair_id, float(loss)))
    return checked


def mark_trained(conn: sqlite3.Connection, results: Sequence[tuple[int, float]], now: float) -> None:
    """All or nothing: one unknown or held-out pair rejects the whole report."""
    for pair_id, loss in results:
        split = _split_of(conn, pair_id)
        if split == HELDOUT:
            raise BadRequest(f"pair {pair_id} is held out for evaluation and must never train")
        conn.execute(
            "UPDATE pairs SET status = ?, train_count = train_count + 1, last_dpo_loss = ?,"
            " updated_at = ? WHERE id = ?",
            (TRAINED, loss, now, pair_id),
        )


def set_status(conn: sqlite3.Connection, pair_id: int, status: str, now: float) -> None:
    if status not in PAIR_STATUSES:
        raise BadRequest(f"status must be one of {PAIR_STATUSES}; got {status!r}")
    _split_of(conn, pair_id)
    conn.execute("UPDATE pairs SET status = ?, updated_at = ? WHERE id = ?", (status, now, pair_id))


def _split_of(conn: sqlite3.Connection, pair_id: int) -> str:
    row = conn.execute("SELECT split FROM pairs WHERE id = ?", (pair_id,)).fetchone()
    if row is None:
        raise UnknownPair(f"no preference pair {pair_id!r} (erased, expired or never created)")
    return str(row[0])


def insert_adapter_version(
    conn: sqlite3.Connection, user_id: str, version: int, path: str, pair_ids: Sequence[int], now: float
) -> None:
    """Raises UnknownUser / UnknownPair when the adapter cannot be tied to this user's live pairs."""
    if conn.execute("SELECT 1 FROM users WHERE user_id = ?", (user_id,)).fetchone() is None:
        raise UnknownUser(f"no user {user_id!r} in the feedback store (erased?)")
    for pair_id in pair_ids:
        row = conn.execute("SELECT user_id, split FROM pairs WHERE id = ?", (pair_id,)).fetchone()
        if row is None or row[0] != user_id:
            raise UnknownPair(f"pair {pair_id!r} is not a live pair of user {user_id!r}")
        if row[1] == HELDOUT:
            raise BadRequest(f"pair {pair_id} is held out for evaluation; an adapter cannot train on it")
    exists = conn.execute(
        "SELECT 1 FROM adapter_versions WHERE user_id = ? AND version = ?", (user_id, version)
    ).fetchone()
    if exists is not None:
        raise BadRequest(f"adapter version {version} of user {user_id!r} is already recorded")
    conn.execute(
        "INSERT INTO adapter_versions (user_id, version, path, created_at) VALUES (?, ?, ?, ?)",
        (user_id, version, path, now),
    )
    conn.executemany(
        "INSERT OR IGNORE INTO adapter_pairs (user_id, version, pair_id) VALUES (?, ?, ?)",
        [(user_id, version, pair_id) for pair_id in pair_ids],
    )


def adapter_versions(conn: sqlite3.Connection, user_id: str) -> list[AdapterVersionRecord]:
    versions = conn.execute(
        "SELECT version, path, created_at FROM adapter_versions WHERE user_id = ? ORDER BY version",
        (user_id,),
    ).fetchall()
    records = []
    for version, path, created_at in versions:
        pair_ids = tuple(
            int(pid)
            for (pid,) in conn.execute(
                "SELECT pair_id FROM adapter_pairs WHERE user_id = ? AND version = ? ORDER BY pair_id",
                (user_id, version),
            )
        )
        unpaired_ids = tuple(
            int(eid)
            for (eid,) in conn.execute(
                "SELECT example_id FROM adapter_unpaired WHERE user_id = ? AND version = ? ORDER BY example_id",
                (user_id, version),
            )
        )
        records.append(AdapterVersionRecord(user_id, int(version), str(path), float(created_at), pair_ids,
                                            unpaired_ids))
    return records


# --- unpaired examples (thumbs, ratings: KTO) ------------------------------------------------

_UNPAIRED_COLUMNS = (
    "x.id, x.user_id, x.prompt, x.completion, x.desirable, x.rule, x.split, x.status,"
    " x.train_count, x.last_loss, x.created_at"
)


def _unpaired(row: Sequence) -> UnpairedExample:
    return UnpairedExample(
        id=int(row[0]), user_id=row[1], prompt=row[2], completion=row[3], desirable=bool(row[4]),
        rule=row[5], split=row[6], status=row[7], train_count=int(row[8]),
        last_loss=None if row[9] is None else float(row[9]), created_at=float(row[10]),
    )


def next_unpaired(
    conn: sqlite3.Connection, user_id: str | None, limit: int, split: str, status: str
) -> list[UnpairedExample]:
    rows = _queued_rows(conn, "unpaired", _UNPAIRED_COLUMNS, user_id, limit, split, status)
    return [_unpaired(row) for row in rows]


def heldout_unpaired(conn: sqlite3.Connection, user_id: str) -> list[UnpairedExample]:
    rows = conn.execute(
        f"SELECT {_UNPAIRED_COLUMNS} FROM unpaired x WHERE x.user_id = ? AND x.split = ? ORDER BY x.id",
        (user_id, HELDOUT),
    )
    return [_unpaired(row) for row in rows]


def mark_unpaired_trained(conn: sqlite3.Connection, results: Sequence[tuple[int, float]], now: float) -> None:
    """All or nothing, like `mark_trained`; the loss is the example's KTO loss."""
    for example_id, loss in results:
        row = conn.execute("SELECT split FROM unpaired WHERE id = ?", (example_id,)).fetchone()
        if row is None:
            raise UnknownPair(f"no unpaired example {example_id!r} (erased, expired or never created)")
        if row[0] == HELDOUT:
            raise BadRequest(f"unpaired example {example_id} is held out for evaluation and must never train")
        conn.execute(
            "UPDATE unpaired SET status = ?, train_count = train_count + 1, last_loss = ?,"
            " updated_at = ? WHERE id = ?",
            (TRAINED, loss, now, example_id),
        )


def link_adapter_unpaired(conn: sqlite3.Connection, user_id: str, version: int, example_ids: Sequence[int]) -> None:
    """Raises UnknownPair when an example is not a live train-split example of this user."""
    for example_id in example_ids:
        row = conn.execute("SELECT user_id, split FROM unpaired WHERE id = ?", (example_id,)).fetchone()
        if row is None or row[0] != user_id:
            raise UnknownPair(f"unpaired example {example_id!r} is not a live example of user {user_id!r}")
        if row[1] == HELDOUT:
            raise BadRequest(f"unpaired example {example_id} is held out; an adapter cannot train on it")
    conn.executemany(
        "INSERT OR IGNORE INTO adapter_unpaired (user_id, version, example_id) VALUES (?, ?, ?)",
        [(user_id, version, example_id) for example_id in example_ids],
    )


def fleet_material(conn: sqlite3.Connection, split: str) -> FleetMaterial:
    """Pairs and unpaired examples (in `split`, any status but skipped) of the users who hold both
    feedback and fleet consent now. Run inside one read transaction so the three reads agree."""
    if split not in SPLITS:
        raise BadRequest(f"split must be one of {SPLITS}; got {split!r}")
    both = "JOIN users u ON u.user_id = {a}.user_id AND u.consent = 1 AND u.fleet_consent = 1"
    users = tuple(str(u) for (u,) in conn.execute(
        "SELECT user_id FROM users WHERE consent = 1 AND fleet_consent = 1 ORDER BY user_id"))
    pairs = tuple(_pair(row) for row in conn.execute(
        f"SELECT {_PAIR_COLUMNS} FROM pairs p {both.format(a='p')}"
        " WHERE p.split = ? AND p.status != 'skipped' ORDER BY p.id", (split,)))
    unpaired = tuple(_unpaired(row) for row in conn.execute(
        f"SELECT {_UNPAIRED_COLUMNS} FROM unpaired x {both.format(a='x')}"
        " WHERE x.split = ? AND x.status != 'skipped' ORDER BY x.id", (split,)))
    return FleetMaterial(users=users, pairs=pairs, unpaired=unpaired)
