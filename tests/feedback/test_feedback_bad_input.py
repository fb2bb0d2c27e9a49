"""Bad input gets a typed error with a code, and leaves every table exactly as it was."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from edge_runtime.errors import BadRequest, MaceError, UnknownRequest
from edge_runtime.feedback import (
    Choice,
    DuplicateFeedback,
    DuplicateInteraction,
    Edit,
    FeedbackStore,
    InvalidFeedback,
    Rating,
    Thumbs,
    UnknownInteraction,
    UnknownPair,
    UnknownUser,
    feedback_from_dict,
)

PROMPT = "Summarise the meeting notes."


@pytest.fixture
def seeded(store: FeedbackStore) -> FeedbackStore:
    store.set_consent("alice", True)
    store.record_interaction("alice", "r1", PROMPT, ["short", "long"], model="m")
    store.record_feedback("alice", "r1", Choice(0))
    store.record_feedback("alice", "r1", Thumbs(1, up=False))
    return store


BAD_CALLS: dict[str, tuple[type[MaceError], str, Callable[[FeedbackStore], object]]] = {
    "unknown user": (UnknownUser, "unknown_user",
                     lambda s: s.record_feedback("nobody", "r1", Choice(0))),
    "unknown request": (UnknownInteraction, "unknown_request",
                        lambda s: s.record_feedback("alice", "r404", Choice(0))),
    "choice twice": (DuplicateFeedback, "duplicate_feedback",
                     lambda s: s.record_feedback("alice", "r1", Choice(1))),
    "same thumbs twice": (DuplicateFeedback, "duplicate_feedback",
                          lambda s: s.record_feedback("alice", "r1", Thumbs(1, up=True))),
    "request id reused": (DuplicateInteraction, "duplicate_request",
                          lambda s: s.record_interaction("alice", "r1", PROMPT, ["x"], model="m")),
    "candidate out of range": (InvalidFeedback, "bad_request",
                               lambda s: s.record_feedback("alice", "r1", Rating(2, 3))),
    "stars out of range": (InvalidFeedback, "bad_request",
                           lambda s: s.record_feedback("alice", "r1", Rating(0, 6))),
    "empty edit": (InvalidFeedback, "bad_request",
                   lambda s: s.record_feedback("alice", "r1", Edit(0, "   "))),
    "bool as index": (InvalidFeedback, "bad_request",
                      lambda s: s.record_feedback("alice", "r1", Choice(True))),
    "not feedback": (InvalidFeedback, "bad_request",
                     lambda s: s.record_feedback("alice", "r1", {"kind": "choice"})),
    "user id with a slash": (BadRequest, "bad_request",
                             lambda s: s.record_interaction("../x", "r2", PROMPT, ["x"], model="m")),
    "bad request id": (BadRequest, "bad_request",
                       lambda s: s.record_interaction("alice", "r 2", PROMPT, ["x"], model="m")),
    "oversize prompt": (BadRequest, "bad_request",
                        lambda s: s.record_interaction("alice", "r2", "x" * 70_000, ["x"], model="m")),
    "oversize multibyte candidate": (BadRequest, "bad_request",
                                     lambda s: s.record_interaction("alice", "r2", PROMPT, ["é" * 40_000], model="m")),
    "lone surrogate": (BadRequest, "bad_request",
                       lambda s: s.record_interaction("alice", "r2", "bad \udcff text", ["x"], model="m")),
    "bytes prompt": (BadRequest, "bad_request",
                     lambda s: s.record_interaction("alice", "r2", b"bytes", ["x"], model="m")),
    "NUL in prompt": (BadRequest, "bad_request",
                      lambda s: s.record_interaction("alice", "r2", "a\x00b", ["x"], model="m")),
    "empty prompt": (BadRequest, "bad_request",
                     lambda s: s.record_interaction("alice", "r2", " \n", ["x"], model="m")),
    "no candidates": (BadRequest, "bad_request",
                      lambda s: s.record_interaction("alice", "r2", PROMPT, [], model="m")),
    "candidates as a string": (BadRequest, "bad_request",
                               lambda s: s.record_interaction("alice", "r2", PROMPT, "abc", model="m")),
    "NaN timing": (BadRequest, "bad_request",
                   lambda s: s.record_interaction("alice", "r2", PROMPT, ["x"], model="m",
                                                  timings={"ttft_s": float("nan")})),
    "unknown pair": (UnknownPair, "unknown_pair", lambda s: s.mark_trained(999, 0.5)),
    "infinite loss": (BadRequest, "bad_request", lambda s: s.mark_trained(1, float("inf"))),
    "export unknown user": (UnknownUser, "unknown_user", lambda s: s.export_user("nobody")),
    "forget unknown user": (UnknownUser, "unknown_user", lambda s: s.forget("nobody")),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_input_raises_typed_error_and_leaves_store_unchanged(
    seeded: FeedbackStore, case: str, table_snapshot: Callable[[Path], dict]
) -> None:
    error_type, code, call = BAD_CALLS[case]
    before = table_snapshot(seeded.path)
    with pytest.raises(error_type) as err:
        call(seeded)
    assert err.value.code == code
    assert str(err.value)  # a message a person can act on
    assert table_snapshot(seeded.path) == before


def test_unknown_interaction_is_an_unknown_request_for_the_daemon() -> None:
    assert issubclass(UnknownInteraction, UnknownRequest)


def test_a_failing_write_does_not_spoil_the_next_one(seeded: FeedbackStore) -> None:
    with pytest.raises(DuplicateFeedback):
        seeded.record_feedback("alice", "r1", Choice(1))
    assert seeded.record_feedback("alice", "r1", Thumbs(0, up=True)).pair_ids  # up 0 vs down 1


@pytest.mark.parametrize("message", [
    {"kind": "like", "candidate": 0},
    {"kind": "thumbs", "candidate": 0, "up": 1},
    {"kind": "rating", "candidate": -1, "stars": 3},
    {"kind": "rating", "candidate": 0, "stars": "5"},
    {"kind": "edit", "candidate": 0, "text": None},
    ["choice", 0],
])
def test_malformed_feedback_messages_are_rejected(message: object) -> None:
    with pytest.raises(InvalidFeedback):
        feedback_from_dict(message)  # type: ignore[arg-type]


def test_heldout_pairs_refuse_training(tmp_path: Path, table_snapshot: Callable[[Path], dict]) -> None:
    from edge_runtime.feedback import FeedbackStoreConfig

    config = FeedbackStoreConfig(heldout_fraction=0.5)
    with FeedbackStore(tmp_path / "f.sqlite3", config=config) as store:
        store.set_consent("alice", True)
        for i in range(40):
            store.record_interaction("alice", f"r{i}", f"{PROMPT} {i}", ["a", "b"], model="m")
            store.record_feedback("alice", f"r{i}", Choice(0))
        held = store.heldout_pairs("alice")
        assert 5 < len(held) < 35
        before = table_snapshot(store.path)
        with pytest.raises(BadRequest, match="held out"):
            store.mark_trained_batch([(store.next_pairs()[0].id, 0.3), (held[0].id, 0.2)])
        assert table_snapshot(store.path) == before
