"""Unpaired examples (rule 5): a lone thumb or a non-neutral rating is a first-class row beside the
pairs; the training queue, consent, export, erasure (down to the bytes), retention and the schema
migration of an existing database cover them."""

from __future__ import annotations

import os
import sqlite3
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
    UnknownPair,
)
from edge_runtime.feedback.pairs import (
    RATING_DESIRABLE_MIN,
    RATING_UNDESIRABLE_MAX,
    unpaired_verdict,
)
from edge_runtime.feedback.schema import MIGRATIONS, SCHEMA_VERSION


def _thumbs(store: FeedbackStore, user: str, prompt: str, answer: str, up: bool, rid: str) -> Any:
    store.record_interaction(user, rid, prompt, [answer], model="m")
    return store.record_feedback(user, rid, Thumbs(0, up=up))


def test_a_lone_thumb_is_an_unpaired_example_and_no_pair(store: FeedbackStore) -> None:
    store.set_consent("alice", True)
    up = _thumbs(store, "alice", "Capital of France?", "Paris.", True, "r1")
    down = _thumbs(store, "alice", "Two plus two?", "Five.", False, "r2")
    assert up.pair_ids == () and down.pair_ids == ()  # different prompts: the pair rules give nothing
    examples = store.next_unpaired("alice")
    assert [(e.id, e.prompt, e.completion, e.desirable, e.rule) for e in examples] == [
        (up.unpaired_ids[0], "Capital of France?", "Paris.", True, "thumbs"),
        (down.unpaired_ids[0], "Two plus two?", "Five.", False, "thumbs"),
    ]
    assert store.next_pairs() == [] and store.pending_unpaired_counts() == {"alice": 2}
    # Choices and edits make pairs, not unpaired examples.
    store.record_interaction("alice", "r3", "Hi?", ["Hello.", "Go away."], model="m")
    assert store.record_feedback("alice", "r3", Choice(0)).unpaired_ids == ()
    assert store.record_feedback("alice", "r3", Edit(1, "Hi there.")).unpaired_ids == ()
    assert len(store.next_unpaired()) == 2


@pytest.mark.parametrize(("stars", "desirable"), [(1, False), (2, False), (3, None), (4, True), (5, True)])
def test_rating_threshold_four_stars_up_two_down_three_neutral(store: FeedbackStore, stars: int, desirable: Any) -> None:
    assert (RATING_DESIRABLE_MIN, RATING_UNDESIRABLE_MAX) == (4, 2)
    assert unpaired_verdict("rating", stars) is desirable
    store.set_consent("alice", True)
    store.record_interaction("alice", "r1", "Q?", ["A."], model="m")
    ack = store.record_feedback("alice", "r1", Rating(0, stars))
    got = [e.desirable for e in store.next_unpaired("alice")]
    assert got == ([] if desirable is None else [desirable])
    assert len(ack.unpaired_ids) == len(got)


def test_unpaired_queue_respects_consent_split_and_reports(tmp_path: Path) -> None:
    config = FeedbackStoreConfig(heldout_fraction=0.5)
    with FeedbackStore(tmp_path / "f.sqlite3", config=config) as store:
        store.set_consent("alice", True)
        for i in range(16):
            _thumbs(store, "alice", f"Q{i}?", f"A{i}.", i % 2 == 0, f"r{i}")
        train, heldout = store.next_unpaired("alice", limit=100), store.heldout_unpaired("alice")
        assert train and heldout and len(train) + len(heldout) == 16
        assert store.next_unpaired("alice", split="heldout", limit=100) == heldout
        with pytest.raises(BadRequest, match="held out"):
            store.mark_unpaired_trained(heldout[0].id, 0.4)
        with pytest.raises(UnknownPair):
            store.mark_unpaired_trained(10_000, 0.4)
        store.mark_unpaired_trained(train[0].id, 0.25)
        [done] = store.next_unpaired("alice", status="trained")
        assert (done.id, done.train_count, done.last_loss) == (train[0].id, 1, 0.25)
        stats = store.stats()
        assert (stats.unpaired_trained, stats.unpaired_pending, stats.unpaired_heldout) == (
            1, len(train) - 1, len(heldout))
        store.set_consent("alice", False)  # withdrawn: nothing is drawn for training
        assert store.next_unpaired() == [] and store.pending_unpaired_counts() == {}


def _file_bytes(path: Path) -> bytes:
    return b"".join(Path(f"{path}{s}").read_bytes() for s in ("", "-wal") if Path(f"{path}{s}").exists())


def test_export_lists_unpaired_examples_and_forget_removes_them_byte_for_byte(
    tmp_path: Path, adapters_root: Path
) -> None:
    marker = f"THUMB{uuid.uuid4().hex}"
    config = FeedbackStoreConfig(heldout_fraction=0.0)
    with FeedbackStore(tmp_path / "f.sqlite3", adapters_root=adapters_root, config=config) as store:
        for user in ("alice", "bob"):
            store.set_consent(user, True)
        texts = []
        for i in range(20):
            prompt, answer = f"{marker} question {i}", f"{marker} answer {i}"
            texts += [prompt, answer]
            if i % 2:
                _thumbs(store, "alice", prompt, answer, i % 4 == 1, f"r{i}")
            else:
                store.record_interaction("alice", f"r{i}", prompt, [answer], model="m")
                store.record_feedback("alice", f"r{i}", Rating(0, 5 if i % 4 else 1))
        _thumbs(store, "bob", "BOB question", "BOB answer", True, "b1")
        ids = [e.id for e in store.next_unpaired("alice", limit=100)]
        folder = adapters_root / "alice" / "v1"
        folder.mkdir(parents=True)
        (folder / "adapter_model.safetensors").write_bytes(os.urandom(64))
        store.record_adapter_version("alice", 1, folder, [], unpaired_ids=ids[:5])
        exported = store.export_user("alice")
        assert [e["id"] for e in exported["unpaired_examples"]] == ids and len(ids) == 20
        assert exported["unpaired_examples"][0]["request_id"] == "r0"
        assert exported["adapter_versions"][0]["trained_on_unpaired_ids"] == ids[:5]
        assert store.adapter_versions("alice")[0].unpaired_ids == tuple(ids[:5])
        bob_before = store.export_user("bob")["unpaired_examples"]
        assert marker.encode() in _file_bytes(store.path)

        report = store.forget("alice")

        assert (report.unpaired, report.pairs, report.interactions) == (20, 0, 20)
        raw = _file_bytes(store.path)
        for text in texts:
            assert text.encode() not in raw
        assert marker.encode() not in raw
        assert store.export_user("bob")["unpaired_examples"] == bob_before
        assert store.next_unpaired() == [e for e in store.next_unpaired("bob")]
        with pytest.raises(UnknownPair):  # an erased example cannot be linked to an adapter
            folder.mkdir(parents=True)
            store.set_consent("alice", True)
            store.record_adapter_version("alice", 2, folder, [], unpaired_ids=ids[:1])


def test_retention_takes_unpaired_examples_with_their_interaction(tmp_path: Path, clock: Any) -> None:
    config = FeedbackStoreConfig(heldout_fraction=0.0, retention_max_age_s=100.0,
                                 retention_max_interactions_per_user=None, retention_interval_s=None)
    with FeedbackStore(tmp_path / "f.sqlite3", config=config, clock=clock) as store:
        store.set_consent("alice", True)
        _thumbs(store, "alice", "Old?", "old answer", False, "old")
        clock.now += 60
        _thumbs(store, "alice", "New?", "new answer", True, "new")
        clock.now += 50
        report = store.apply_retention()
        assert (report.interactions_deleted, report.unpaired_deleted, report.pairs_deleted) == (1, 1, 0)
        assert [e.completion for e in store.next_unpaired()] == ["new answer"]


def test_a_version_1_database_opens_and_its_thumbs_and_ratings_become_unpaired(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(str(path), isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    for statement in MIGRATIONS[0]:
        conn.execute(statement)
    conn.execute("PRAGMA user_version = 1")
    conn.execute("INSERT INTO users VALUES ('alice', 1, 1.0, 1.0)")
    for iid, (kind, value) in enumerate([("thumbs", 1), ("thumbs", -1), ("rating", 3), ("rating", 2),
                                         ("choice", None)], 1):
        conn.execute("INSERT INTO interactions VALUES (?, 'alice', ?, ?, x'00', 'm', NULL, '{}', 2.0)",
                     (iid, f"r{iid}", f"prompt {iid}"))
        conn.execute("INSERT INTO candidates VALUES (?, 0, ?)", (iid, f"answer {iid}"))
        conn.execute("INSERT INTO feedback (interaction_id, kind, slot, candidate_idx, value, created_at)"
                     " VALUES (?, ?, ?, 0, ?, 3.0)", (iid, kind, -1 if kind == "choice" else 0, value))
    conn.close()

    with FeedbackStore(path, config=FeedbackStoreConfig(heldout_fraction=0.0)) as store:
        got = [(e.completion, e.desirable, e.rule) for e in store.next_unpaired(limit=100)]
        assert got == [("answer 1", True, "thumbs"), ("answer 2", False, "thumbs"), ("answer 4", False, "rating")]
        assert store.stats().interactions == 5
    check = sqlite3.connect(str(path))
    assert check.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 2
    check.close()
