"""Data-subject rights over the feedback store: consent, export (Art. 15/20), erasure (Art. 17),
retention limits, and the audit log of these operations.

The audit log names users only by a keyed hash and records counts, never content.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import shutil
import sqlite3
from pathlib import Path
from typing import Any

from edge_runtime.errors import BadRequest
from edge_runtime.feedback.errors import ConsentRequired, UnknownUser
from edge_runtime.feedback.records import ConsentState, RetentionReport
from edge_runtime.feedback.training_queue import adapter_versions

EXPORT_FORMAT = "mace-edge.feedback-export"
EXPORT_VERSION = 3  # 2: unpaired_examples, trained_on_unpaired_ids; 3: consent.fleet
ALL_USERS = "*"  # audit subject of operations over every user (retention)

log = logging.getLogger(__name__)


# --- audit -------------------------------------------------------------------------------------


def audit_subject(conn: sqlite3.Connection, user_id: str) -> str:
    key = conn.execute("SELECT value FROM meta WHERE key = 'audit_key'").fetchone()[0]
    return hmac.new(bytes.fromhex(key), user_id.encode("utf-8"), hashlib.sha256).hexdigest()[:32]


def write_audit(
    conn: sqlite3.Connection, op: str, user_id: str | None, detail: dict[str, Any], now: float
) -> None:
    subject = ALL_USERS if user_id is None else audit_subject(conn, user_id)
    conn.execute(
        "INSERT INTO audit_log (at, op, subject, detail) VALUES (?, ?, ?, ?)",
        (now, op, subject, json.dumps(detail, sort_keys=True)),
    )


def read_audit(conn: sqlite3.Connection, user_id: str | None, limit: int) -> list[dict[str, Any]]:
    if user_id is None:
        rows = conn.execute(
            "SELECT at, op, subject, detail FROM audit_log ORDER BY id DESC LIMIT ?", (limit,)
        )
    else:
        rows = conn.execute(
            "SELECT at, op, subject, detail FROM audit_log WHERE subject = ? ORDER BY id DESC LIMIT ?",
            (audit_subject(conn, user_id), limit),
        )
    return [
        {"at": at, "op": op, "subject": subject, "detail": json.loads(detail)}
        for at, op, subject, detail in rows
    ]


# --- consent -----------------------------------------------------------------------------------


def set_consent(conn: sqlite3.Connection, user_id: str, granted: bool, now: float) -> bool:
    """Record consent or its withdrawal; returns whether anything changed.

    Withdrawal stops recording and training at once but keeps what is stored: erasure is its
    own right (`forget`). A user who never consented gets no row at all.
    """
    row = conn.execute("SELECT consent FROM users WHERE user_id = ?", (user_id,)).fetchone()
    changed = False
    if granted and row is None:
        conn.execute(
            "INSERT INTO users (user_id, consent, consent_at, created_at) VALUES (?, 1, ?, ?)",
            (user_id, now, now),
        )
        changed = True
    elif row is not None and bool(row[0]) != granted:
        conn.execute(
            "UPDATE users SET consent = ?, consent_at = ? WHERE user_id = ?",
            (int(granted), now, user_id),
        )
        changed = True
    write_audit(conn, "consent_granted" if granted else "consent_withdrawn", user_id,
                {"changed": changed}, now)
    return changed


def set_fleet_consent(conn: sqlite3.Connection, user_id: str, granted: bool, now: float) -> bool:
    """Record consent to training the shared fleet adapter, or its withdrawal; returns whether
    anything changed.

    Granting needs feedback consent first (there is nothing to train on without it); withdrawing
    takes the user out of every later round, and is a no-op for a user the store does not know.
    """
    row = conn.execute("SELECT consent, fleet_consent FROM users WHERE user_id = ?", (user_id,)).fetchone()
    if granted and (row is None or not row[0]):
        raise ConsentRequired(
            f"user {user_id!r} has not consented to feedback collection; grant that first "
            "(fleet consent only lets already collected feedback train the fleet adapter)")
    changed = row is not None and bool(row[1]) != granted
    if changed:
        conn.execute("UPDATE users SET fleet_consent = ?, fleet_consent_at = ? WHERE user_id = ?",
                     (int(granted), now, user_id))
    write_audit(conn, "fleet_consent_granted" if granted else "fleet_consent_withdrawn", user_id,
                {"changed": changed}, now)
    return changed


def consent_state(conn: sqlite3.Connection, user_id: str) -> ConsentState:
    row = conn.execute("SELECT consent, fleet_consent FROM users WHERE user_id = ?", (user_id,)).fetchone()
    return ConsentState(user_id, bool(row and row[0]), bool(row and row[1]))


# --- export ------------------------------------------------------------------------------------


def export_user(conn: sqlite3.Connection, user_id: str, now: float) -> dict[str, Any]:
    """Everything held on one user, as JSON-ready data. Run inside one read transaction."""
    user = conn.execute(
        "SELECT consent, consent_at, created_at, fleet_consent, fleet_consent_at FROM users"
        " WHERE user_id = ?", (user_id,)
    ).fetchone()
    if user is None:
        raise UnknownUser(f"the feedback store holds nothing on user {user_id!r}")
    interactions = []
    request_of: dict[int, str] = {}
    for iid, request_id, prompt, model, adapter_version, timings, created_at in conn.execute(
        "SELECT id, request_id, prompt, model, adapter_version, timings, created_at"
        " FROM interactions WHERE user_id = ? ORDER BY id",
        (user_id,),
    ).fetchall():
        request_of[iid] = request_id
        candidates = [
            {"index": idx, "text": text}
            for idx, text in conn.execute(
                "SELECT idx, text FROM candidates WHERE interaction_id = ? ORDER BY idx", (iid,)
            )
        ]
        feedback = [
            _feedback_entry(kind, idx, value, text, at)
            for kind, idx, value, text, at in conn.execute(
                "SELECT kind, candidate_idx, value, text, created_at FROM feedback"
                " WHERE interaction_id = ? ORDER BY id",
                (iid,),
            )
        ]
        interactions.append({
            "request_id": request_id, "prompt": prompt, "model": model,
            "adapter_version": adapter_version, "timings": json.loads(timings),
            "created_at": created_at, "candidates": candidates, "feedback": feedback,
        })
    pairs = []
    for row in conn.execute(
        "SELECT id, prompt, chosen, rejected, rule, split, status, support, train_count,"
        " last_dpo_loss, created_at FROM pairs WHERE user_id = ? ORDER BY id",
        (user_id,),
    ).fetchall():
        sources = [
            request_of[iid]
            for (iid,) in conn.execute(
                "SELECT interaction_id FROM pair_sources WHERE pair_id = ? ORDER BY interaction_id",
                (row[0],),
            )
            if iid in request_of
        ]
        pairs.append({
            "id": row[0], "prompt": row[1], "chosen": row[2], "rejected": row[3], "rule": row[4],
            "split": row[5], "status": row[6], "support": row[7], "train_count": row[8],
            "last_dpo_loss": row[9], "created_at": row[10], "from_request_ids": sources,
        })
    unpaired = [
        {"id": row[0], "request_id": request_of.get(row[1]), "prompt": row[2], "completion": row[3],
         "desirable": bool(row[4]), "rule": row[5], "split": row[6], "status": row[7],
         "train_count": row[8], "last_loss": row[9], "created_at": row[10]}
        for row in conn.execute(
            "SELECT id, interaction_id, prompt, completion, desirable, rule, split, status, train_count,"
            " last_loss, created_at FROM unpaired WHERE user_id = ? ORDER BY id",
            (user_id,),
        ).fetchall()
    ]
    adapters = [
        {"version": a.version, "path": a.path, "created_at": a.created_at,
         "trained_on_pair_ids": list(a.pair_ids), "trained_on_unpaired_ids": list(a.unpaired_ids)}
        for a in adapter_versions(conn, user_id)
    ]
    return {
        "format": EXPORT_FORMAT,
        "format_version": EXPORT_VERSION,
        "time_unit": "seconds since the Unix epoch (UTC)",
        "exported_at": now,
        "user_id": user_id,
        "consent": {"granted": bool(user[0]), "changed_at": user[1],
                    "fleet": {"granted": bool(user[3]), "changed_at": user[4]}},
        "created_at": user[2],
        "interactions": interactions,
        "preference_pairs": pairs,
        "unpaired_examples": unpaired,
        "adapter_versions": adapters,
        "audit_log": [
            {"at": e["at"], "op": e["op"], "detail": e["detail"]}
            for e in read_audit(conn, user_id, limit=-1)
        ],
    }


def _feedback_entry(kind: str, idx: int, value: int | None, text: str | None, at: float) -> dict:
    entry: dict[str, Any] = {"kind": kind, "created_at": at}
    if kind == "choice":
        entry["chosen"] = idx
    elif kind == "thumbs":
        entry.update(candidate=idx, up=value == 1)
    elif kind == "rating":
        entry.update(candidate=idx, stars=value)
    else:
        entry.update(candidate=idx, text=text)
    return entry


# --- erasure -----------------------------------------------------------------------------------


def adapter_dir(adapters_root: Path | None, user_id: str) -> Path | None:
    """The user's adapter folder, refusing anything that would resolve outside adapters_root."""
    if adapters_root is None:
        return None
    root = adapters_root.resolve()
    target = root / user_id
    # user ids are validated path components, but a symlink planted at <root>/<user> could still
    # point elsewhere: never delete through it.
    if target.is_symlink() or target.resolve().parent != root:
        raise BadRequest(f"refusing to erase {target}: it is not a plain folder inside {root}")
    return target


def inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
    except ValueError:
        return False
    return True


def remove_tree(path: Path) -> bool:
    if not path.exists():
        return False
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    return True


def count_user_rows(conn: sqlite3.Connection, user_id: str) -> dict[str, int] | None:
    if conn.execute("SELECT 1 FROM users WHERE user_id = ?", (user_id,)).fetchone() is None:
        return None

    def count(sql: str) -> int:
        return int(conn.execute(sql, (user_id,)).fetchone()[0])

    return {
        "interactions": count("SELECT count(*) FROM interactions WHERE user_id = ?"),
        "feedback": count(
            "SELECT count(*) FROM feedback f JOIN interactions i ON i.id = f.interaction_id"
            " WHERE i.user_id = ?"
        ),
        "pairs": count("SELECT count(*) FROM pairs WHERE user_id = ?"),
        "unpaired": count("SELECT count(*) FROM unpaired WHERE user_id = ?"),
        "adapter_versions": count("SELECT count(*) FROM adapter_versions WHERE user_id = ?"),
    }


def delete_user_rows(conn: sqlite3.Connection, user_id: str) -> None:
    # ON DELETE CASCADE takes interactions, candidates, feedback, pairs, pair sources, unpaired
    # examples and adapter records with the user row.
    conn.execute("DELETE FROM users WHERE user_id = ?", (user_id,))


def reclaim_space(conn: sqlite3.Connection, full_vacuum: bool) -> bool:
    """Give freed pages back and empty the WAL; returns whether the WAL was truncated.

    Must run outside a transaction. The WAL still holds earlier page images (with the erased
    text) until a TRUNCATE checkpoint empties it.
    """
    if full_vacuum:
        try:
            conn.execute("VACUUM")
        except sqlite3.OperationalError as exc:
            # VACUUM needs room for a second copy of the database; secure_delete has already
            # zeroed the erased cells, so fall back to handing back free pages only.
            log.warning("VACUUM after erasure failed (%s); reclaiming free pages only", exc)
            full_vacuum = False
    if not full_vacuum:
        # execute() steps a statement once, which frees a single page; executescript runs the
        # pragma to completion.
        conn.executescript("PRAGMA incremental_vacuum;")
    busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    return busy == 0


# --- retention ---------------------------------------------------------------------------------


def apply_retention(
    conn: sqlite3.Connection, max_age_s: float | None, max_per_user: int | None, now: float
) -> RetentionReport:
    """Delete interactions past the age limit or beyond each user's newest `max_per_user`.

    A pair that quotes a deleted interaction goes with it, even if another interaction also
    supports it: no text outlives the limit inside a derived pair. Unpaired examples go with
    their interaction (ON DELETE CASCADE).
    """
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS doomed (id INTEGER PRIMARY KEY)")
    conn.execute("DELETE FROM temp.doomed")
    if max_age_s is not None:
        conn.execute(
            "INSERT OR IGNORE INTO temp.doomed SELECT id FROM interactions WHERE created_at < ?",
            (now - max_age_s,),
        )
    if max_per_user is not None:
        conn.execute(
            "INSERT OR IGNORE INTO temp.doomed SELECT id FROM ("
            " SELECT id, row_number() OVER (PARTITION BY user_id ORDER BY created_at DESC, id DESC)"
            " AS newest FROM interactions) WHERE newest > ?",
            (max_per_user,),
        )
    users = int(conn.execute(
        "SELECT count(DISTINCT user_id) FROM interactions WHERE id IN (SELECT id FROM temp.doomed)"
    ).fetchone()[0])
    pairs = conn.execute(
        "DELETE FROM pairs WHERE id IN (SELECT pair_id FROM pair_sources"
        " WHERE interaction_id IN (SELECT id FROM temp.doomed))"
    ).rowcount
    unpaired = int(conn.execute(
        "SELECT count(*) FROM unpaired WHERE interaction_id IN (SELECT id FROM temp.doomed)"
    ).fetchone()[0])
    interactions = conn.execute(
        "DELETE FROM interactions WHERE id IN (SELECT id FROM temp.doomed)"
    ).rowcount
    conn.execute("DELETE FROM temp.doomed")
    report = RetentionReport(interactions_deleted=interactions, pairs_deleted=pairs,
                             users_affected=users, unpaired_deleted=unpaired)
    if interactions or pairs:
        write_audit(conn, "retention", None,
                    {"interactions": interactions, "pairs": pairs, "unpaired": unpaired, "users": users}, now)
    return report
