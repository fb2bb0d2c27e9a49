"""Plain records of the feedback store: the four feedback kinds, pairs, adapter versions, reports.

No SQL here; `feedback_from_dict` is the one place that turns a protocol message into feedback.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from edge_runtime.feedback.errors import InvalidFeedback

# Pair status values (the training queue's states).
PENDING = "pending"  # derived, never trained
TRAINED = "trained"  # at least one DPO step used it
SKIPPED = "skipped"  # the trainer gave up on it (e.g. longer than the context); never drawn again
PAIR_STATUSES = (PENDING, TRAINED, SKIPPED)

# Splits: held-out pairs are for evaluation only and never train.
TRAIN = "train"
HELDOUT = "heldout"
SPLITS = (TRAIN, HELDOUT)

MIN_STARS, MAX_STARS = 1, 5


@dataclass(frozen=True)
class Choice:
    """The user picked candidate `chosen` among the n candidates shown."""

    chosen: int
    kind = "choice"


@dataclass(frozen=True)
class Thumbs:
    """Thumbs up (`up=True`) or down on one candidate."""

    candidate: int
    up: bool
    kind = "thumbs"


@dataclass(frozen=True)
class Rating:
    """A 1-5 star rating of one candidate."""

    candidate: int
    stars: int
    kind = "rating"


@dataclass(frozen=True)
class Edit:
    """The user's edited or rephrased version of one candidate: what they wanted instead."""

    candidate: int
    text: str
    kind = "edit"


Feedback = Choice | Thumbs | Rating | Edit
FEEDBACK_KINDS = ("choice", "thumbs", "rating", "edit")


def _index(message: Mapping[str, Any], key: str) -> int:
    value = message.get(key)
    # bool is an int subclass; `True` as a candidate index is a client bug, not index 1.
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidFeedback(f"feedback field {key!r} must be a candidate index >= 0; got {value!r}")
    return value


def feedback_from_dict(message: Mapping[str, Any]) -> Feedback:
    """Parse a protocol message such as {"kind": "rating", "candidate": 0, "stars": 4}."""
    if not isinstance(message, Mapping):
        raise InvalidFeedback(f"feedback must be a mapping; got {type(message).__name__}")
    kind = message.get("kind")
    if kind == "choice":
        return Choice(chosen=_index(message, "chosen"))
    if kind == "thumbs":
        up = message.get("up")
        if not isinstance(up, bool):
            raise InvalidFeedback(f"thumbs feedback needs 'up': true or false; got {up!r}")
        return Thumbs(candidate=_index(message, "candidate"), up=up)
    if kind == "rating":
        stars = message.get("stars")
        if not isinstance(stars, int) or isinstance(stars, bool):
            raise InvalidFeedback(f"rating needs integer 'stars' in 1-5; got {stars!r}")
        return Rating(candidate=_index(message, "candidate"), stars=stars)
    if kind == "edit":
        text = message.get("text")
        if not isinstance(text, str):
            raise InvalidFeedback(f"edit feedback needs 'text' as a string; got {type(text).__name__}")
        return Edit(candidate=_index(message, "candidate"), text=text)
    raise InvalidFeedback(f"feedback kind must be one of {', '.join(FEEDBACK_KINDS)}; got {kind!r}")


@dataclass(frozen=True)
class FeedbackAck:
    """What an acknowledged (durably committed) feedback produced."""

    feedback_id: int
    pair_ids: tuple[int, ...]  # pairs created or merged into by this feedback
    unpaired_ids: tuple[int, ...] = ()  # the unpaired example it made (a thumb, a non-neutral rating)


@dataclass(frozen=True)
class PreferencePair:
    """One (prompt, chosen, rejected) training example and its place in the training queue."""

    id: int
    user_id: str
    prompt: str
    chosen: str
    rejected: str
    rule: str  # the feedback kind that first derived it
    split: str  # TRAIN or HELDOUT
    status: str  # PENDING, TRAINED or SKIPPED
    support: int  # how many feedback events derived this same pair (duplicates merged)
    train_count: int
    last_dpo_loss: float | None
    created_at: float


@dataclass(frozen=True)
class UnpairedExample:
    """One answer the user judged desirable or undesirable (a thumb, a rating): a KTO example."""

    id: int
    user_id: str
    prompt: str
    completion: str
    desirable: bool
    rule: str  # "thumbs" or "rating"
    split: str
    status: str
    train_count: int
    last_loss: float | None
    created_at: float


@dataclass(frozen=True)
class ConsentState:
    """A user's two consents: to feedback collection, and to training the shared fleet adapter
    (which counts only while the first is also held)."""

    user_id: str
    granted: bool
    fleet: bool


@dataclass(frozen=True)
class FleetMaterial:
    """What a fleet round may train on: rows of users who hold both consents at the time of asking."""

    users: tuple[str, ...]
    pairs: tuple[PreferencePair, ...]
    unpaired: tuple[UnpairedExample, ...]


@dataclass(frozen=True)
class AdapterVersionRecord:
    """A published adapter version and the pairs and unpaired examples it was trained on."""

    user_id: str
    version: int
    path: str
    created_at: float
    pair_ids: tuple[int, ...]
    unpaired_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class StoreStats:
    """Counts for `macectl status`."""

    users: int
    consented_users: int
    interactions: int
    feedback: int
    pairs_pending: int
    pairs_trained: int
    pairs_skipped: int
    pairs_heldout: int
    adapter_versions: int
    db_bytes: int
    wal_bytes: int
    unpaired_pending: int = 0
    unpaired_trained: int = 0
    unpaired_heldout: int = 0
    fleet_users: int = 0  # users holding both feedback and fleet consent

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class ErasureReport:
    """What `forget(user)` removed (counts only: the content is gone)."""

    user_id: str
    interactions: int
    feedback: int
    pairs: int
    adapter_versions: int
    adapter_dir_removed: bool
    wal_truncated: bool
    unpaired: int = 0
    # what the serving side erased outside the store, by kind (prefix_blocks, responses, ...)
    elsewhere: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RetentionReport:
    """What one retention pass removed."""

    interactions_deleted: int
    pairs_deleted: int
    users_affected: int
    unpaired_deleted: int = 0
