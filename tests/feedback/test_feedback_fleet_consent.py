"""Fleet consent (issue #20): a second, revocable consent that lets a user's pairs and unpaired
examples train the shared fleet adapter. Defaults off, needs feedback consent, shows in the export,
goes with erasure, and an older database gains it by migration."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path
from typing import Any

import pytest

from edge_runtime.errors import BadRequest
from edge_runtime.feedback import (
    Choice,
    ConsentRequired,
    FeedbackStore,
    FeedbackStoreConfig,
    Thumbs,
)
from edge_runtime.feedback.schema import MIGRATIONS, SCHEMA_VERSION


def _teach(store: FeedbackStore, user: str, tag: str) -> None:
    """One preference pair (a choice) and one unpaired example (a thumb), texts carrying `tag`."""
    store.record_interaction(user, f"{tag}-c", f"{tag} prompt", [f"{tag} good", f"{tag} bad"], model="m")
    store.record_feedback(user, f"{tag}-c", Choice(0))
    store.record_interaction(user, f"{tag}-t", f"{tag} thumb prompt", [f"{tag} thumbed"], model="m")
    store.record_feedback(user, f"{tag}-t", Thumbs(0, up=True))


def _material_users(store: FeedbackStore) -> tuple[set[str], set[str], tuple[str, ...]]:
    m = store.fleet_material()
    return {p.user_id for p in m.pairs}, {e.user_id for e in m.unpaired}, m.users


def test_fleet_consent_defaults_off_and_round_trips(store: FeedbackStore) -> None:
    assert store.consent_state("nobody").fleet is False
    store.set_consent("alice", True)
    state = store.consent_state("alice")
    assert (state.granted, state.fleet) == (True, False)
    assert store.set_fleet_consent("alice", True) is True
    assert store.set_fleet_consent("alice", True) is False  # unchanged
    assert store.consent_state("alice").fleet is True
    assert store.set_fleet_consent("alice", False) is True
    assert store.consent_state("alice").fleet is False
    ops = [e["op"] for e in store.audit_log("alice")]
    assert ops[:3] == ["fleet_consent_withdrawn", "fleet_consent_granted", "fleet_consent_granted"]


def test_fleet_consent_needs_feedback_consent(store: FeedbackStore) -> None:
    with pytest.raises(ConsentRequired, match="feedback collection"):
        store.set_fleet_consent("stranger", True)
    assert store.set_fleet_consent("stranger", False) is False  # withdrawing is always allowed
    store.set_consent("bob", True)
    store.set_consent("bob", False)
    with pytest.raises(ConsentRequired):
        store.set_fleet_consent("bob", True)
    with pytest.raises(BadRequest):
        store.set_fleet_consent("bob", 1)  # type: ignore[arg-type]


def test_round_material_holds_only_doubly_consented_users(store: FeedbackStore) -> None:
    for user in ("both", "feedback_only", "revoked", "fleet_then_no_feedback"):
        store.set_consent(user, True)
        _teach(store, user, user)
    store.set_fleet_consent("both", True)
    store.set_fleet_consent("revoked", True)
    store.set_fleet_consent("fleet_then_no_feedback", True)
    assert _material_users(store) == (
        {"both", "revoked", "fleet_then_no_feedback"}, {"both", "revoked", "fleet_then_no_feedback"},
        ("both", "fleet_then_no_feedback", "revoked"))

    store.set_fleet_consent("revoked", False)
    store.set_consent("fleet_then_no_feedback", False)  # fleet consent no longer counts

    pairs, unpaired, users = _material_users(store)
    assert pairs == unpaired == {"both"} and users == ("both",)
    material = store.fleet_material()
    assert [(p.prompt, p.chosen, p.rejected) for p in material.pairs] == [("both prompt", "both good", "both bad")]
    assert [(e.completion, e.desirable) for e in material.unpaired] == [("both thumbed", True)]
    # Training a user's own adapter does not take the row out of later fleet rounds.
    store.mark_trained(material.pairs[0].id, 0.5)
    assert len(store.fleet_material().pairs) == 1
    assert store.fleet_material("heldout").pairs == ()
    assert store.stats().fleet_users == 1
    with pytest.raises(BadRequest):
        store.fleet_material("everything")


def test_export_shows_fleet_consent_and_erasure_removes_it_byte_for_byte(
    tmp_path: Path, adapters_root: Path, clock: Any
) -> None:
    user = f"u{uuid.uuid4().hex}"
    config = FeedbackStoreConfig(heldout_fraction=0.0)
    with FeedbackStore(tmp_path / "f.sqlite3", adapters_root=adapters_root, config=config, clock=clock) as store:
        store.set_consent(user, True)
        store.set_consent("other", True)
        _teach(store, user, user)
        _teach(store, "other", "other")
        store.set_fleet_consent("other", True)
        clock.now += 5
        store.set_fleet_consent(user, True)
        exported = store.export_user(user)
        assert exported["format_version"] == 3
        assert exported["consent"]["fleet"] == {"granted": True, "changed_at": clock.now}
        assert exported["consent"]["granted"] is True
        assert user in store.fleet_material().users

        store.forget(user)

        raw = b"".join(p.read_bytes() for p in tmp_path.glob("f.sqlite3*"))
        assert user.encode() not in raw
        assert store.fleet_material().users == ("other",)
        assert store.consent_state(user).fleet is False
        conn = sqlite3.connect(str(store.path))
        assert conn.execute("SELECT count(*) FROM users WHERE fleet_consent = 1").fetchone()[0] == 1
        conn.close()


def test_a_version_2_database_migrates_with_fleet_consent_off(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(str(path), isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    for migration in MIGRATIONS[:2]:
        for statement in migration:
            statement(conn, 0.0) if callable(statement) else conn.execute(statement)
    conn.execute("PRAGMA user_version = 2")
    conn.execute("INSERT INTO users VALUES ('alice', 1, 1.0, 1.0)")
    conn.close()

    with FeedbackStore(path, config=FeedbackStoreConfig(heldout_fraction=0.0)) as store:
        state = store.consent_state("alice")
        assert (state.granted, state.fleet) == (True, False)
        assert store.export_user("alice")["consent"]["fleet"] == {"granted": False, "changed_at": None}
        assert store.set_fleet_consent("alice", True) is True
    check = sqlite3.connect(str(path))
    assert check.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3
    check.close()
