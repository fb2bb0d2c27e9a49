"""The SQLite schema of the feedback store, its migrations (`PRAGMA user_version`) and pragmas.

Owns how a connection is opened; knows nothing about feedback rules or the writer thread.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

from edge_runtime.feedback import pairs as rules


def _backfill_unpaired(conn: sqlite3.Connection, heldout_fraction: float) -> None:
    """Version 2: thumbs and ratings recorded before unpaired examples existed become them, with
    the split their key gives (the same rule as new ones)."""
    rows = conn.execute(
        "SELECT f.id, f.interaction_id, i.user_id, i.prompt, c.text, f.kind, f.value, f.created_at"
        " FROM feedback f JOIN interactions i ON i.id = f.interaction_id"
        " JOIN candidates c ON c.interaction_id = i.id AND c.idx = f.candidate_idx"
        " WHERE f.kind IN ('thumbs', 'rating') ORDER BY f.id"
    ).fetchall()
    for feedback_id, interaction_id, user_id, prompt, text, kind, value, at in rows:
        desirable = rules.unpaired_verdict(kind, int(value))
        if desirable is None:
            continue
        split = "heldout" if rules.is_heldout(rules.unpaired_key(user_id, prompt, text), heldout_fraction) else "train"
        conn.execute(
            "INSERT INTO unpaired (user_id, feedback_id, interaction_id, prompt, completion, desirable,"
            " rule, split, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (user_id, feedback_id, interaction_id, prompt, text, int(desirable), kind, split, at, at),
        )


# Each migration is a list of statements (or functions of the connection and the store's held-out
# fraction) run in one transaction
# together with the bump of user_version, so a crash mid-migration leaves the previous version
# intact.
MIGRATIONS: tuple[tuple[str | Callable[[sqlite3.Connection, float], None], ...], ...] = (
    (
        """CREATE TABLE meta (
            key   TEXT PRIMARY KEY,
            value TEXT NOT NULL
        )""",
        # The audit log names users by a keyed hash, so it keeps no identifier after erasure;
        # the key never leaves the database.
        "INSERT INTO meta (key, value) VALUES ('audit_key', lower(hex(randomblob(32))))",
        """CREATE TABLE users (
            user_id    TEXT PRIMARY KEY,
            consent    INTEGER NOT NULL CHECK (consent IN (0, 1)),
            consent_at REAL NOT NULL,
            created_at REAL NOT NULL
        )""",
        """CREATE TABLE interactions (
            id              INTEGER PRIMARY KEY,
            user_id         TEXT NOT NULL REFERENCES users(user_id) ON DELETE CASCADE,
            request_id      TEXT NOT NULL,
            prompt          TEXT NOT NULL,
            prompt_hash     BLOB NOT NULL,
            model           TEXT NOT NULL,
            adapter_version INTEGER,
            timings         TEXT NOT NULL,
            created_at      REAL NOT NULL,
            UNIQUE (user_id, request_id)
        )""",
        "CREATE INDEX interactions_by_prompt ON interactions(user_id, prompt_hash)",
        "CREATE INDEX interactions_by_age ON interactions(created_at)",
        """CREATE TABLE candidates (
            interaction_id INTEGER NOT NULL REFERENCES interactions(id) ON DELETE CASCADE,
            idx            INTEGER NOT NULL,
            text           TEXT NOT NULL,
            PRIMARY KEY (interaction_id, idx)
        ) WITHOUT ROWID""",
        # slot is -1 for a choice (one per interaction) and the candidate index otherwise, so
        # UNIQUE(interaction_id, kind, slot) is exactly "the same feedback given twice".
        """CREATE TABLE feedback (
            id             INTEGER PRIMARY KEY,
            interaction_id INTEGER NOT NULL REFERENCES interactions(id) ON DELETE CASCADE,
            kind           TEXT NOT NULL CHECK (kind IN ('choice', 'thumbs', 'rating', 'edit')),
            slot           INTEGER NOT NULL,
            candidate_idx  INTEGER NOT NULL,
            value          INTEGER,
            text           TEXT,
            created_at     REAL NOT NULL,
            UNIQUE (interaction_id, kind, slot)
        )""",
        """CREATE TABLE pairs (
            id            INTEGER PRIMARY KEY,
            user_id       TEXT NOT NULL REFERENCES users(user_id) ON DELETE CASCADE,
            pair_key      BLOB NOT NULL UNIQUE,
            prompt        TEXT NOT NULL,
            chosen        TEXT NOT NULL,
            rejected      TEXT NOT NULL,
            rule          TEXT NOT NULL,
            split         TEXT NOT NULL CHECK (split IN ('train', 'heldout')),
            status        TEXT NOT NULL DEFAULT 'pending'
                          CHECK (status IN ('pending', 'trained', 'skipped')),
            support       INTEGER NOT NULL DEFAULT 1,
            train_count   INTEGER NOT NULL DEFAULT 0,
            last_dpo_loss REAL,
            created_at    REAL NOT NULL,
            updated_at    REAL NOT NULL
        )""",
        "CREATE INDEX pairs_queue ON pairs(split, status, user_id, id)",
        "CREATE INDEX pairs_by_user ON pairs(user_id)",
        # Which interactions a pair draws text from: when retention drops one of them, the pair
        # goes too, so no text outlives the limit through a derived pair.
        """CREATE TABLE pair_sources (
            pair_id        INTEGER NOT NULL REFERENCES pairs(id) ON DELETE CASCADE,
            interaction_id INTEGER NOT NULL REFERENCES interactions(id) ON DELETE CASCADE,
            PRIMARY KEY (pair_id, interaction_id)
        ) WITHOUT ROWID""",
        "CREATE INDEX pair_sources_by_interaction ON pair_sources(interaction_id)",
        """CREATE TABLE adapter_versions (
            user_id    TEXT NOT NULL REFERENCES users(user_id) ON DELETE CASCADE,
            version    INTEGER NOT NULL,
            path       TEXT NOT NULL,
            created_at REAL NOT NULL,
            PRIMARY KEY (user_id, version)
        )""",
        """CREATE TABLE adapter_pairs (
            user_id TEXT NOT NULL,
            version INTEGER NOT NULL,
            pair_id INTEGER NOT NULL REFERENCES pairs(id) ON DELETE CASCADE,
            PRIMARY KEY (user_id, version, pair_id),
            FOREIGN KEY (user_id, version)
                REFERENCES adapter_versions(user_id, version) ON DELETE CASCADE
        ) WITHOUT ROWID""",
        "CREATE INDEX adapter_pairs_by_pair ON adapter_pairs(pair_id)",
        """CREATE TABLE audit_log (
            id      INTEGER PRIMARY KEY,
            at      REAL NOT NULL,
            op      TEXT NOT NULL,
            subject TEXT NOT NULL,
            detail  TEXT NOT NULL
        )""",
        "CREATE INDEX audit_by_subject ON audit_log(subject)",
    ),
    (
        # Unpaired examples (KTO): one judged answer each, from a thumb or a rating that clears
        # the thresholds (pairs.py, rule 5). Erasing the user, or retention dropping the
        # interaction or the feedback, takes the row with it (CASCADE; secure_delete zeroes it).
        """CREATE TABLE unpaired (
            id             INTEGER PRIMARY KEY,
            user_id        TEXT NOT NULL REFERENCES users(user_id) ON DELETE CASCADE,
            feedback_id    INTEGER NOT NULL UNIQUE REFERENCES feedback(id) ON DELETE CASCADE,
            interaction_id INTEGER NOT NULL REFERENCES interactions(id) ON DELETE CASCADE,
            prompt         TEXT NOT NULL,
            completion     TEXT NOT NULL,
            desirable      INTEGER NOT NULL CHECK (desirable IN (0, 1)),
            rule           TEXT NOT NULL CHECK (rule IN ('thumbs', 'rating')),
            split          TEXT NOT NULL CHECK (split IN ('train', 'heldout')),
            status         TEXT NOT NULL DEFAULT 'pending'
                           CHECK (status IN ('pending', 'trained', 'skipped')),
            train_count    INTEGER NOT NULL DEFAULT 0,
            last_loss      REAL,
            created_at     REAL NOT NULL,
            updated_at     REAL NOT NULL
        )""",
        "CREATE INDEX unpaired_queue ON unpaired(split, status, user_id, id)",
        "CREATE INDEX unpaired_by_user ON unpaired(user_id)",
        "CREATE INDEX unpaired_by_interaction ON unpaired(interaction_id)",
        """CREATE TABLE adapter_unpaired (
            user_id    TEXT NOT NULL,
            version    INTEGER NOT NULL,
            example_id INTEGER NOT NULL REFERENCES unpaired(id) ON DELETE CASCADE,
            PRIMARY KEY (user_id, version, example_id),
            FOREIGN KEY (user_id, version)
                REFERENCES adapter_versions(user_id, version) ON DELETE CASCADE
        ) WITHOUT ROWID""",
        "CREATE INDEX adapter_unpaired_by_example ON adapter_unpaired(example_id)",
        _backfill_unpaired,
    ),
    (
        # Fleet consent (issue #20): a second, separately revocable consent to let the user's
        # pairs and examples train the shared fleet adapter. It lives on the user row, so erasure
        # takes it with everything else; it counts only while feedback consent is also held.
        "ALTER TABLE users ADD COLUMN fleet_consent INTEGER NOT NULL DEFAULT 0"
        " CHECK (fleet_consent IN (0, 1))",
        "ALTER TABLE users ADD COLUMN fleet_consent_at REAL",
    ),
)

SCHEMA_VERSION = len(MIGRATIONS)


def connect(path: Path, busy_timeout_ms: int) -> sqlite3.Connection:
    """Open a connection with the store's per-connection pragmas; transactions are explicit."""
    # isolation_level=None: the store issues BEGIN/COMMIT itself (Python 3.10 has no autocommit=).
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
    conn.execute("PRAGMA foreign_keys = ON")
    # FULL in WAL mode fsyncs the log on every commit: an acknowledged write survives power loss.
    conn.execute("PRAGMA synchronous = FULL")
    # Deleted personal data is overwritten with zeros, not merely unlinked from the b-tree.
    conn.execute("PRAGMA secure_delete = ON")
    # VACUUM and large sorts would otherwise spill user text into files under /tmp.
    conn.execute("PRAGMA temp_store = MEMORY")
    return conn


def prepare_database(conn: sqlite3.Connection, heldout_fraction: float = 0.1) -> int:
    """Create or upgrade the schema; returns the version now in force. Idempotent.
    `heldout_fraction`: the store's, for examples a migration derives from old feedback."""
    # auto_vacuum only takes effect before the first table exists; incremental mode lets
    # retention hand freed pages back to the file system without a full VACUUM.
    if _user_version(conn) == 0:
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
    mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if mode.lower() != "wal":
        raise RuntimeError(f"feedback store needs WAL journaling; SQLite kept {mode!r}")
    current = _user_version(conn)
    if current > SCHEMA_VERSION:
        raise RuntimeError(
            f"feedback database has schema version {current}, newer than this code ({SCHEMA_VERSION}); "
            "upgrade mace-edge instead of downgrading the database"
        )
    for version in range(current, SCHEMA_VERSION):
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Another process may have migrated while we waited for the write lock.
            if _user_version(conn) != version:
                conn.execute("ROLLBACK")
                continue
            for statement in MIGRATIONS[version]:
                if callable(statement):
                    statement(conn, heldout_fraction)
                else:
                    conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {version + 1}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    return _user_version(conn)


def _user_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])
