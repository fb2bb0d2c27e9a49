"""The training queue the trainer and scheduler draw from, and adapter-version bookkeeping."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_runtime.errors import BadRequest
from edge_runtime.feedback import (
    SKIPPED,
    TRAINED,
    Choice,
    FeedbackStore,
    FeedbackStoreConfig,
    UnknownPair,
    UnknownUser,
)


def _feed(store: FeedbackStore, user: str, n: int) -> None:
    store.set_consent(user, True)
    for i in range(n):
        store.record_interaction(user, f"r{i}", f"question {i} from {user}", ["good", "bad"], model="m")
        store.record_feedback(user, f"r{i}", Choice(0))


def test_next_pairs_oldest_first_per_user_and_limit(store: FeedbackStore) -> None:
    _feed(store, "alice", 3)
    _feed(store, "bob", 2)
    assert [p.prompt for p in store.next_pairs(limit=2)] == ["question 0 from alice", "question 1 from alice"]
    assert {p.user_id for p in store.next_pairs(user_id="bob")} == {"bob"}
    assert store.pending_counts() == {"alice": 3, "bob": 2}


def test_mark_trained_records_loss_count_and_leaves_the_pending_queue(store: FeedbackStore) -> None:
    _feed(store, "alice", 2)
    first, second = store.next_pairs()
    store.mark_trained(first.id, 0.69)
    store.mark_trained_batch([(first.id, 0.41), (second.id, 0.7)])
    pair = store.get_pair(first.id)
    assert (pair.status, pair.train_count, pair.last_dpo_loss) == (TRAINED, 2, 0.41)
    assert store.next_pairs() == []
    assert [p.id for p in store.next_pairs(status=TRAINED)] == [first.id, second.id]
    assert store.pending_counts() == {}
    stats = store.stats()
    assert (stats.pairs_pending, stats.pairs_trained) == (0, 2)


def test_skipped_pairs_are_never_drawn_again(store: FeedbackStore) -> None:
    _feed(store, "alice", 2)
    skipped = store.next_pairs()[0]
    store.mark_skipped(skipped.id)
    assert [p.id for p in store.next_pairs()] != [] and skipped.id not in [p.id for p in store.next_pairs()]
    assert store.get_pair(skipped.id).status == SKIPPED
    assert store.stats().pairs_skipped == 1


def test_heldout_pairs_are_separate_and_stable(tmp_path: Path) -> None:
    path = tmp_path / "f.sqlite3"
    with FeedbackStore(path, config=FeedbackStoreConfig(heldout_fraction=0.3)) as store:
        _feed(store, "alice", 60)
        held = {p.id for p in store.heldout_pairs("alice")}
        train = {p.id for p in store.next_pairs(limit=1000)}
        assert held and train and not held & train
        assert len(held) + len(train) == 60
        assert {p.id for p in store.next_pairs(split="heldout", limit=1000)} == held
        assert store.stats().pairs_heldout == len(held)
        assert store.pending_counts() == {"alice": len(train)}
    # A different fraction later never moves existing pairs between splits.
    with FeedbackStore(path, config=FeedbackStoreConfig(heldout_fraction=0.0)) as store:
        assert {p.id for p in store.heldout_pairs("alice")} == held


def test_bad_queue_arguments(store: FeedbackStore) -> None:
    with pytest.raises(BadRequest):
        store.next_pairs(split="test")
    with pytest.raises(BadRequest):
        store.next_pairs(status="done")
    with pytest.raises(BadRequest):
        store.next_pairs(limit=0)
    with pytest.raises(UnknownPair):
        store.get_pair(12345)


def test_adapter_versions_record_their_pairs(store: FeedbackStore, adapters_root: Path) -> None:
    _feed(store, "alice", 3)
    ids = [p.id for p in store.next_pairs()]
    v1 = adapters_root / "alice" / "v1"
    v1.mkdir(parents=True)
    store.record_adapter_version("alice", 1, v1, ids[:2])
    [record] = store.adapter_versions("alice")
    assert (record.version, record.path, record.pair_ids) == (1, str(v1), tuple(ids[:2]))
    exported = store.export_user("alice")["adapter_versions"]
    assert exported == [{"version": 1, "path": str(v1), "created_at": record.created_at,
                         "trained_on_pair_ids": ids[:2], "trained_on_unpaired_ids": []}]
    with pytest.raises(BadRequest, match="already recorded"):
        store.record_adapter_version("alice", 1, v1, ids)


def test_adapter_outside_the_users_folder_is_refused(store: FeedbackStore, adapters_root: Path) -> None:
    _feed(store, "alice", 1)
    with pytest.raises(BadRequest, match="not inside"):
        store.record_adapter_version("alice", 1, adapters_root / "bob" / "v1", [])
    with pytest.raises(BadRequest, match="not inside"):
        store.record_adapter_version("alice", 1, adapters_root / "alice" / ".." / "bob" / "v1", [])


def test_adapter_trained_on_an_erased_user_is_deleted(store: FeedbackStore, adapters_root: Path) -> None:
    _feed(store, "alice", 1)
    ids = [p.id for p in store.next_pairs()]
    store.forget("alice")  # erasure lands while the trainer was still training
    late = adapters_root / "alice" / "v2"
    late.mkdir(parents=True)
    (late / "adapter_model.safetensors").write_bytes(b"weights")
    with pytest.raises(UnknownUser, match="deleted"):
        store.record_adapter_version("alice", 2, late, ids)
    assert not late.exists()


def test_adapter_trained_on_pairs_of_an_earlier_identity_is_deleted(
    store: FeedbackStore, adapters_root: Path
) -> None:
    _feed(store, "alice", 1)
    old_ids = [p.id for p in store.next_pairs()]
    store.forget("alice")
    store.set_consent("alice", True)  # same id, new consent, no data
    late = adapters_root / "alice" / "v1"
    late.mkdir(parents=True)
    with pytest.raises(UnknownPair):
        store.record_adapter_version("alice", 1, late, old_ids)
    assert not late.exists()
