"""GDPR rights: export (Art. 15/20), erasure down to the bytes of the file (Art. 17), retention
limits, and an audit log that holds no erased content."""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from edge_runtime.errors import BadRequest
from edge_runtime.feedback import (
    Choice,
    Edit,
    FeedbackStore,
    FeedbackStoreConfig,
    Rating,
    Thumbs,
    UnknownUser,
)


def _populate(store: FeedbackStore, user: str, marker: str, adapters_root: Path, rounds: int) -> list[str]:
    """Interactions of every feedback kind whose texts all carry `marker`; returns the texts."""
    store.set_consent(user, True)
    texts = []
    for i in range(rounds):
        # Long prompts spill into overflow pages, short ones share pages with other users.
        filler = "lorem ipsum " * (600 if i % 3 == 0 else 5)
        prompt = f"{marker} prompt {i} {filler}"
        cands = [f"{marker} answer {i}.{k}" for k in range(3)]
        texts += [prompt, *cands]
        rid = f"req-{i}"
        store.record_interaction(user, rid, prompt, cands, model="m", timings={"ttft_s": 0.1})
        kind = i % 4
        if kind == 0:
            store.record_feedback(user, rid, Choice(1))
        elif kind == 1:
            store.record_feedback(user, rid, Thumbs(0, up=True))
            store.record_feedback(user, rid, Thumbs(2, up=False))
        elif kind == 2:
            store.record_feedback(user, rid, Rating(0, 5))
            store.record_feedback(user, rid, Rating(1, 1))
        else:
            edit = f"{marker} edited answer {i}"
            texts.append(edit)
            store.record_feedback(user, rid, Edit(0, edit))
    ids = [p.id for p in store.next_pairs(user_id=user, limit=1000)]
    for version in (1, 2):
        folder = adapters_root / user / f"v{version}"
        folder.mkdir(parents=True)
        (folder / "adapter_model.safetensors").write_bytes(os.urandom(64))
        store.record_adapter_version(user, version, folder, ids[: 3 * version])
    return texts


def _file_bytes(path: Path) -> bytes:
    data = b""
    for suffix in ("", "-wal", "-journal"):
        f = Path(f"{path}{suffix}")
        if f.exists():
            data += f.read_bytes()
    return data


def _comparable(export: dict) -> dict:
    return {k: export[k] for k in ("interactions", "preference_pairs", "adapter_versions", "consent")}


@pytest.mark.parametrize("vacuum", [True, False], ids=["vacuum", "incremental"])
def test_forget_leaves_no_byte_of_the_users_text_and_spares_others(
    tmp_path: Path, adapters_root: Path, vacuum: bool
) -> None:
    marker = f"ALICE{uuid.uuid4().hex}"
    alice = f"alice-{uuid.uuid4().hex[:12]}"
    config = FeedbackStoreConfig(heldout_fraction=0.0, vacuum_on_forget=vacuum)
    with FeedbackStore(tmp_path / "f.sqlite3", adapters_root=adapters_root, config=config) as store:
        bob_texts = _populate(store, "bob", "BOB-TEXT", adapters_root, rounds=6)
        alice_texts = _populate(store, alice, marker, adapters_root, rounds=24)
        _populate(store, "carol", "CAROL-TEXT", adapters_root, rounds=6)
        store.export_user(alice)
        bob_before = _comparable(store.export_user("bob"))
        assert marker.encode() in _file_bytes(store.path)

        report = store.forget(alice)

        assert (report.interactions, report.adapter_versions) == (24, 2)
        assert report.adapter_dir_removed and report.wal_truncated
        raw = _file_bytes(store.path)
        assert marker.encode() not in raw
        assert alice.encode() not in raw  # the audit log keeps a keyed hash, not the id
        for text in alice_texts:
            assert text.encode() not in raw
        assert not (adapters_root / alice).exists()
        # Everyone else is untouched, rows and adapters alike.
        assert _comparable(store.export_user("bob")) == bob_before
        assert bob_texts[1].encode() in _file_bytes(store.path)  # a short candidate: one page
        assert (adapters_root / "bob" / "v2").is_dir() and (adapters_root / "carol" / "v1").is_dir()
        assert store.stats().users == 2
        with pytest.raises(UnknownUser):
            store.export_user(alice)


def test_forget_reclaims_space(tmp_path: Path, adapters_root: Path) -> None:
    with FeedbackStore(tmp_path / "f.sqlite3", adapters_root=adapters_root) as store:
        _populate(store, "bob", "BOB", adapters_root, rounds=3)
        _populate(store, "alice", "ALICE", adapters_root, rounds=60)
        before = store.stats()
        store.forget("alice")
        after = store.stats()
        assert after.wal_bytes == 0
        assert after.db_bytes < before.db_bytes / 3


def test_forget_finishes_an_erasure_interrupted_before_the_adapters(store: FeedbackStore, adapters_root: Path) -> None:
    # Rows gone but the folder left behind (crash between commit and rmtree): forget again works.
    (adapters_root / "ghost" / "v1").mkdir(parents=True)
    report = store.forget("ghost")
    assert report.adapter_dir_removed and report.interactions == 0
    assert not (adapters_root / "ghost").exists()


def test_forget_never_deletes_through_a_symlink_out_of_adapters_root(
    store: FeedbackStore, adapters_root: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    store.set_consent("mallory", True)
    (adapters_root / "mallory").symlink_to(outside, target_is_directory=True)
    with pytest.raises(BadRequest, match="refusing"):
        store.forget("mallory")
    assert (outside / "keep.txt").read_text() == "keep"
    assert store.has_consent("mallory")  # nothing erased either: fix the folder, then retry


def test_export_is_complete_machine_readable_json(store: FeedbackStore, adapters_root: Path) -> None:
    texts = _populate(store, "alice", "ALICE", adapters_root, rounds=4)
    data = json.loads(json.dumps(store.export_user("alice")))
    assert data["format"] == "mace-edge.feedback-export" and data["user_id"] == "alice"
    assert data["consent"]["granted"] is True
    dumped = json.dumps(data)
    assert all(json.dumps(t)[1:-1] in dumped for t in texts)
    kinds = [f["kind"] for i in data["interactions"] for f in i["feedback"]]
    assert sorted(set(kinds)) == ["choice", "edit", "rating", "thumbs"]
    assert {"chosen", "rejected", "status", "split", "train_count", "last_dpo_loss"} <= set(
        data["preference_pairs"][0])
    assert [a["version"] for a in data["adapter_versions"]] == [1, 2]
    assert [e["op"] for e in data["audit_log"]] == ["consent_granted"]


def test_audit_log_records_operations_without_content(store: FeedbackStore, adapters_root: Path) -> None:
    _populate(store, "alice", "SECRET", adapters_root, rounds=2)
    store.export_user("alice")
    store.set_consent("alice", False)
    store.forget("alice")
    entries = store.audit_log()
    assert [e["op"] for e in entries] == ["erasure", "consent_withdrawn", "export", "consent_granted"]
    assert "SECRET" not in json.dumps(entries) and "alice" not in json.dumps(entries)
    assert entries[0]["detail"]["interactions"] == 2
    assert store.audit_log("alice") == entries  # looked up by the keyed hash of the id


def test_retention_drops_old_interactions_and_the_pairs_quoting_them(
    tmp_path: Path, clock: Any
) -> None:
    config = FeedbackStoreConfig(heldout_fraction=0.0, retention_max_age_s=100.0,
                                 retention_max_interactions_per_user=None, retention_interval_s=None)
    with FeedbackStore(tmp_path / "f.sqlite3", config=config, clock=clock) as store:
        store.set_consent("alice", True)
        store.record_interaction("alice", "old", "Q", ["bad"], model="m")
        store.record_feedback("alice", "old", Thumbs(0, up=False))
        clock.now += 60
        store.record_interaction("alice", "new", "Q", ["good", "meh"], model="m")
        store.record_feedback("alice", "new", Thumbs(0, up=True))  # pairs with the old thumbs down
        store.record_feedback("alice", "new", Choice(0))
        assert store.stats().pairs_pending == 2
        clock.now += 50  # "old" is now 110 s old
        report = store.apply_retention()
        assert (report.interactions_deleted, report.pairs_deleted, report.users_affected) == (1, 1, 1)
        [pair] = store.next_pairs()
        assert (pair.chosen, pair.rejected, pair.rule) == ("good", "meh", "choice")
        assert store.audit_log()[0]["op"] == "retention"
        assert store.apply_retention().interactions_deleted == 0


def test_retention_caps_rows_per_user(tmp_path: Path, clock: Any) -> None:
    config = FeedbackStoreConfig(retention_max_age_s=None, retention_max_interactions_per_user=3,
                                 retention_interval_s=None)
    with FeedbackStore(tmp_path / "f.sqlite3", config=config, clock=clock) as store:
        for user, n in (("alice", 5), ("bob", 2)):
            store.set_consent(user, True)
            for i in range(n):
                clock.now += 1
                store.record_interaction(user, f"r{i}", f"q{i} " + "x" * 9000, ["a"], model="m")
        assert store.apply_retention().interactions_deleted == 2
        conn = sqlite3.connect(str(store.path))
        assert conn.execute("PRAGMA freelist_count").fetchone()[0] == 0  # space handed back
        conn.close()
        kept = [i["request_id"] for i in store.export_user("alice")["interactions"]]
        assert kept == ["r2", "r3", "r4"]
        assert len(store.export_user("bob")["interactions"]) == 2


def test_the_store_applies_retention_on_its_own_timer(tmp_path: Path, clock: Any) -> None:
    config = FeedbackStoreConfig(retention_max_age_s=100.0, retention_interval_s=0.05)
    with FeedbackStore(tmp_path / "f.sqlite3", config=config, clock=clock) as store:
        store.set_consent("alice", True)
        store.record_interaction("alice", "r1", "q", ["a"], model="m")
        clock.now += 101
        deadline = time.monotonic() + 10
        while store.stats().interactions and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store.stats().interactions == 0
