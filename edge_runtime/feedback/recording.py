"""Write jobs that record interactions and feedback and derive pairs; they run on the writer thread.

Inputs are already validated; these functions check what needs the database (consent, ids,
duplicates, candidate range) and raise typed errors before writing anything. SQL stays within
SQLite 3.31 (JetPack 5 / Ubuntu 20.04): no RETURNING.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence

from edge_runtime.feedback import pairs as rules
from edge_runtime.feedback.errors import (
    ConsentRequired,
    DuplicateFeedback,
    DuplicateInteraction,
    InvalidFeedback,
    UnknownInteraction,
    UnknownUser,
)
from edge_runtime.feedback.records import (
    HELDOUT,
    TRAIN,
    Choice,
    Edit,
    Feedback,
    FeedbackAck,
    Rating,
    Thumbs,
)


def require_consent(conn: sqlite3.Connection, user_id: str) -> None:
    row = conn.execute("SELECT consent FROM users WHERE user_id = ?", (user_id,)).fetchone()
    if row is None or not row[0]:
        raise ConsentRequired(
            f"user {user_id!r} has not consented to feedback collection; nothing was stored"
        )


def insert_interaction(
    conn: sqlite3.Connection,
    *,
    user_id: str,
    request_id: str,
    prompt: str,
    candidates: Sequence[str],
    model: str,
    adapter_version: int | None,
    timings: dict[str, float],
    now: float,
) -> int:
    require_consent(conn, user_id)
    seen = conn.execute(
        "SELECT 1 FROM interactions WHERE user_id = ? AND request_id = ?", (user_id, request_id)
    ).fetchone()
    if seen is not None:
        raise DuplicateInteraction(f"request {request_id!r} of user {user_id!r} is already recorded")
    cur = conn.execute(
        "INSERT INTO interactions (user_id, request_id, prompt, prompt_hash, model,"
        " adapter_version, timings, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (user_id, request_id, prompt, rules.prompt_hash(prompt), model, adapter_version,
         json.dumps(timings, sort_keys=True), now),
    )
    interaction_id = int(cur.lastrowid)
    conn.executemany(
        "INSERT INTO candidates (interaction_id, idx, text) VALUES (?, ?, ?)",
        [(interaction_id, i, text) for i, text in enumerate(candidates)],
    )
    return interaction_id


def _feedback_columns(feedback: Feedback) -> tuple[int, int, int | None, str | None]:
    """(slot, candidate index, value, text) as stored; slot -1 makes a choice one per interaction."""
    if isinstance(feedback, Choice):
        return -1, feedback.chosen, None, None
    if isinstance(feedback, Thumbs):
        return feedback.candidate, feedback.candidate, 1 if feedback.up else -1, None
    if isinstance(feedback, Rating):
        return feedback.candidate, feedback.candidate, feedback.stars, None
    return feedback.candidate, feedback.candidate, None, feedback.text


def insert_feedback(
    conn: sqlite3.Connection,
    *,
    user_id: str,
    request_id: str,
    feedback: Feedback,
    now: float,
    heldout_fraction: float,
) -> FeedbackAck:
    user = conn.execute("SELECT consent FROM users WHERE user_id = ?", (user_id,)).fetchone()
    if user is None:
        raise UnknownUser(f"no user {user_id!r} in the feedback store (never consented, or erased)")
    require_consent(conn, user_id)
    found = conn.execute(
        "SELECT id, prompt FROM interactions WHERE user_id = ? AND request_id = ?",
        (user_id, request_id),
    ).fetchone()
    if found is None:
        raise UnknownInteraction(f"no recorded request {request_id!r} for user {user_id!r}")
    interaction_id, prompt = int(found[0]), str(found[1])
    candidates = [
        str(text)
        for (text,) in conn.execute(
            "SELECT text FROM candidates WHERE interaction_id = ? ORDER BY idx", (interaction_id,)
        )
    ]
    slot, index, value, text = _feedback_columns(feedback)
    if index >= len(candidates):
        raise InvalidFeedback(
            f"candidate {index} does not exist: request {request_id!r} had {len(candidates)} candidate(s)"
        )
    duplicate = conn.execute(
        "SELECT 1 FROM feedback WHERE interaction_id = ? AND kind = ? AND slot = ?",
        (interaction_id, feedback.kind, slot),
    ).fetchone()
    if duplicate is not None:
        target = "this request" if slot < 0 else f"candidate {index} of this request"
        raise DuplicateFeedback(f"{feedback.kind} feedback on {target} was already recorded")
    cur = conn.execute(
        "INSERT INTO feedback (interaction_id, kind, slot, candidate_idx, value, text, created_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)",
        (interaction_id, feedback.kind, slot, index, value, text, now),
    )
    feedback_id = int(cur.lastrowid)
    drafts = _derive(conn, user_id, prompt, interaction_id, candidates, feedback, feedback_id)
    pair_ids = upsert_pairs(conn, user_id, prompt, drafts, now, heldout_fraction)
    unpaired_ids = insert_unpaired(conn, user_id, prompt, interaction_id, candidates[index], feedback,
                                   feedback_id, value, now, heldout_fraction)
    return FeedbackAck(feedback_id=feedback_id, pair_ids=tuple(pair_ids), unpaired_ids=unpaired_ids)


def insert_unpaired(
    conn: sqlite3.Connection, user_id: str, prompt: str, interaction_id: int, text: str,
    feedback: Feedback, feedback_id: int, value: int | None, now: float, heldout_fraction: float,
) -> tuple[int, ...]:
    """Rule 5: a thumb or a non-neutral rating is an unpaired example of the response it judged."""
    if value is None:
        return ()
    desirable = rules.unpaired_verdict(feedback.kind, value)
    if desirable is None:
        return ()
    key = rules.unpaired_key(user_id, prompt, text)
    split = HELDOUT if rules.is_heldout(key, heldout_fraction) else TRAIN
    cur = conn.execute(
        "INSERT INTO unpaired (user_id, feedback_id, interaction_id, prompt, completion, desirable,"
        " rule, split, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (user_id, feedback_id, interaction_id, prompt, text, int(desirable), feedback.kind, split, now, now),
    )
    return (int(cur.lastrowid),)


def _derive(
    conn: sqlite3.Connection,
    user_id: str,
    prompt: str,
    interaction_id: int,
    candidates: list[str],
    feedback: Feedback,
    feedback_id: int,
) -> list[rules.PairDraft]:
    if isinstance(feedback, Choice):
        return rules.from_choice(candidates, feedback.chosen, interaction_id)
    if isinstance(feedback, Edit):
        return rules.from_edit(candidates[feedback.candidate], feedback.text, interaction_id)
    _, index, value, _ = _feedback_columns(feedback)
    assert value is not None
    new = rules.Judgement(interaction_id, candidates[index], value)
    # Same prompt text, any interaction of this user: the hash finds them through an index, the
    # text comparison rules out a hash collision.
    earlier = [
        rules.Judgement(int(iid), str(text), int(val))
        for iid, text, val in conn.execute(
            "SELECT i.id, c.text, f.value FROM interactions i"
            " JOIN feedback f ON f.interaction_id = i.id"
            " JOIN candidates c ON c.interaction_id = i.id AND c.idx = f.candidate_idx"
            " WHERE i.user_id = ? AND i.prompt_hash = ? AND i.prompt = ? AND f.kind = ? AND f.id != ?",
            (user_id, rules.prompt_hash(prompt), prompt, feedback.kind, feedback_id),
        )
    ]
    return rules.from_judgement(new, earlier, feedback.kind)


def upsert_pairs(
    conn: sqlite3.Connection,
    user_id: str,
    prompt: str,
    drafts: Sequence[rules.PairDraft],
    now: float,
    heldout_fraction: float,
) -> list[int]:
    """Insert new pairs or merge into existing ones (support += 1); returns their ids."""
    pair_ids = []
    for draft in drafts:
        key = rules.pair_key(user_id, prompt, draft.chosen, draft.rejected)
        row = conn.execute("SELECT id FROM pairs WHERE pair_key = ?", (key,)).fetchone()
        if row is not None:
            pair_id = int(row[0])
            conn.execute(
                "UPDATE pairs SET support = support + 1, updated_at = ? WHERE id = ?", (now, pair_id)
            )
        else:
            split = HELDOUT if rules.is_heldout(key, heldout_fraction) else TRAIN
            cur = conn.execute(
                "INSERT INTO pairs (user_id, pair_key, prompt, chosen, rejected, rule, split,"
                " created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (user_id, key, prompt, draft.chosen, draft.rejected, draft.rule, split, now, now),
            )
            pair_id = int(cur.lastrowid)
        conn.executemany(
            "INSERT OR IGNORE INTO pair_sources (pair_id, interaction_id) VALUES (?, ?)",
            [(pair_id, iid) for iid in sorted(draft.interaction_ids)],
        )
        pair_ids.append(pair_id)
    return pair_ids
