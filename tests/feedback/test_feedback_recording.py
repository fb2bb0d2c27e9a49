"""Recording interactions and feedback through the store, and the pairs it derives."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from edge_runtime.feedback import (
    Choice,
    ConsentRequired,
    Edit,
    FeedbackStore,
    FeedbackStoreConfig,
    Rating,
    Thumbs,
    feedback_from_dict,
)
from edge_runtime.feedback.schema import SCHEMA_VERSION

PROMPT = "Name the capital of France."


def _pairs(store: FeedbackStore) -> set[tuple[str, str, str]]:
    return {(p.chosen, p.rejected, p.rule) for p in store.next_pairs(limit=1000)}


def test_interaction_keeps_prompt_candidates_model_adapter_and_timings(store: FeedbackStore) -> None:
    store.set_consent("alice", True)
    store.record_interaction("alice", "r1", PROMPT, ["Paris", "Lyon"], model="smollm2-135m",
                             adapter_version=3, timings={"ttft_s": 0.05, "total_s": 0.4})
    [row] = store.export_user("alice")["interactions"]
    assert row["prompt"] == PROMPT
    assert [c["text"] for c in row["candidates"]] == ["Paris", "Lyon"]
    assert (row["model"], row["adapter_version"]) == ("smollm2-135m", 3)
    assert row["timings"] == {"ttft_s": 0.05, "total_s": 0.4}


def test_an_answer_holding_nul_is_stored_whole_and_takes_feedback(store: FeedbackStore) -> None:
    """Any byte is a token, so a model can say NUL; what it said is stored as said (a refused
    answer could take no feedback: seen on CUDA, where a tiny model's sampled text held one)."""
    store.set_consent("alice", True)
    store.record_interaction("alice", "r1", PROMPT, ["Par\x00is", "Lyon"], model="m")
    store.record_feedback("alice", "r1", Choice(0))
    [row] = store.export_user("alice")["interactions"]
    assert [c["text"] for c in row["candidates"]] == ["Par\x00is", "Lyon"]
    assert _pairs(store) == {("Par\x00is", "Lyon", "choice")}


def test_nothing_is_stored_without_consent(store: FeedbackStore) -> None:
    with pytest.raises(ConsentRequired) as err:
        store.record_interaction("bob", "r1", PROMPT, ["Paris"], model="m")
    assert err.value.code == "consent_required"
    assert store.stats().interactions == 0 and store.stats().users == 0


def test_withdrawn_consent_stops_recording_and_training(store: FeedbackStore) -> None:
    store.set_consent("alice", True)
    store.record_interaction("alice", "r1", PROMPT, ["Paris", "Lyon"], model="m")
    store.record_feedback("alice", "r1", Choice(0))
    assert store.pending_counts() == {"alice": 1}
    assert store.set_consent("alice", False) is True
    with pytest.raises(ConsentRequired):
        store.record_interaction("alice", "r2", PROMPT, ["Paris"], model="m")
    assert store.next_pairs() == [] and store.pending_counts() == {}
    store.set_consent("alice", True)
    assert len(store.next_pairs()) == 1


def test_choice_among_n_gives_chosen_over_each_other(store: FeedbackStore) -> None:
    store.set_consent("alice", True)
    store.record_interaction("alice", "r1", PROMPT, ["Paris", "Lyon", "Nice"], model="m")
    ack = store.record_feedback("alice", "r1", Choice(0))
    assert len(ack.pair_ids) == 2
    assert _pairs(store) == {("Paris", "Lyon", "choice"), ("Paris", "Nice", "choice")}


def test_thumbs_up_and_down_on_the_same_prompt_across_requests(store: FeedbackStore) -> None:
    store.set_consent("alice", True)
    store.record_interaction("alice", "r1", PROMPT, ["Lyon"], model="m")
    store.record_interaction("alice", "r2", PROMPT, ["Paris"], model="m")
    assert store.record_feedback("alice", "r1", Thumbs(0, up=False)).pair_ids == ()
    ack = store.record_feedback("alice", "r2", Thumbs(0, up=True))
    assert _pairs(store) == {("Paris", "Lyon", "thumbs")}
    sources = store.export_user("alice")["preference_pairs"][0]["from_request_ids"]
    assert sources == ["r1", "r2"] and len(ack.pair_ids) == 1


def test_thumbs_on_a_different_prompt_never_pair(store: FeedbackStore) -> None:
    store.set_consent("alice", True)
    store.record_interaction("alice", "r1", PROMPT, ["Lyon"], model="m")
    store.record_interaction("alice", "r2", "Another question", ["Paris"], model="m")
    store.record_feedback("alice", "r1", Thumbs(0, up=False))
    store.record_feedback("alice", "r2", Thumbs(0, up=True))
    assert _pairs(store) == set()


def test_ratings_prefer_higher_stars_and_ties_give_nothing(store: FeedbackStore) -> None:
    store.set_consent("alice", True)
    store.record_interaction("alice", "r1", PROMPT, ["Paris", "Lyon", "Nice", "Paris!"], model="m")
    for index, stars in [(0, 5), (1, 2), (2, 2), (3, 5)]:
        store.record_feedback("alice", "r1", Rating(index, stars))
    assert {(c, r) for c, r, _ in _pairs(store)} == {
        ("Paris", "Lyon"), ("Paris", "Nice"), ("Paris!", "Lyon"), ("Paris!", "Nice")}


def test_edit_is_chosen_over_the_original(store: FeedbackStore) -> None:
    store.set_consent("alice", True)
    store.record_interaction("alice", "r1", PROMPT, ["Lyon"], model="m")
    store.record_feedback("alice", "r1", Edit(0, "Paris, of course."))
    assert _pairs(store) == {("Paris, of course.", "Lyon", "edit")}


def test_duplicate_pairs_are_merged_with_support_counted(store: FeedbackStore) -> None:
    store.set_consent("alice", True)
    for rid in ("r1", "r2"):
        store.record_interaction("alice", rid, PROMPT, ["Paris", "Lyon"], model="m")
        store.record_feedback("alice", rid, Choice(0))
    [pair] = store.next_pairs()
    assert (pair.chosen, pair.rejected, pair.support) == ("Paris", "Lyon", 2)


def test_same_pair_of_two_users_stays_separate(store: FeedbackStore) -> None:
    for user in ("alice", "bob"):
        store.set_consent(user, True)
        store.record_interaction(user, "r1", PROMPT, ["Paris", "Lyon"], model="m")
        store.record_feedback(user, "r1", Choice(0))
    assert store.pending_counts() == {"alice": 1, "bob": 1}


def test_feedback_from_protocol_messages() -> None:
    assert feedback_from_dict({"kind": "choice", "chosen": 2}) == Choice(2)
    assert feedback_from_dict({"kind": "thumbs", "candidate": 0, "up": False}) == Thumbs(0, False)
    assert feedback_from_dict({"kind": "rating", "candidate": 1, "stars": 4}) == Rating(1, 4)
    assert feedback_from_dict({"kind": "edit", "candidate": 0, "text": "x"}) == Edit(0, "x")


def test_schema_pragmas_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "f.sqlite3"
    with FeedbackStore(path, config=FeedbackStoreConfig()) as store:
        store.set_consent("alice", True)
        store.record_interaction("alice", "r1", PROMPT, ["Paris"], model="m")
    with FeedbackStore(path) as store:  # reopening migrates nothing and keeps the data
        assert store.stats().interactions == 1
    conn = sqlite3.connect(str(path))
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 2
    assert conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # incremental
    assert (path.stat().st_mode & 0o777) == 0o600
    conn.close()


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "f.sqlite3"
    FeedbackStore(path).close()
    conn = sqlite3.connect(str(path))
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(RuntimeError, match="newer than this code"):
        FeedbackStore(path)


def test_store_module_stays_light() -> None:
    import subprocess
    import sys

    code = ("import sys, edge_runtime.feedback; "
            "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[2])
    assert json.loads(out.stdout) == []
