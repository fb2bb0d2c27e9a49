"""Checks on everything a client hands the store, done in the caller's thread before any write.

Each failure is a `BadRequest` (or `InvalidFeedback`) naming the field and the limit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from edge_runtime.errors import BadRequest
from edge_runtime.feedback.config import FeedbackStoreConfig
from edge_runtime.feedback.errors import InvalidFeedback
from edge_runtime.feedback.records import (
    MAX_STARS,
    MIN_STARS,
    Choice,
    Edit,
    Feedback,
    Rating,
    Thumbs,
)


def check_text(
    value: object, what: str, max_bytes: int, *, allow_empty: bool = False, allow_nul: bool = False,
    error: type[BadRequest] = BadRequest,
) -> str:
    if not isinstance(value, str):
        raise error(f"{what} must be a string; got {type(value).__name__}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        # Lone surrogates come from clients that decoded invalid UTF-8 with 'surrogateescape'.
        raise error(f"{what} is not valid UTF-8 text ({exc.reason} at {exc.start})") from None
    if not allow_nul and "\x00" in value:
        raise error(f"{what} contains a NUL character")
    if size > max_bytes:
        raise error(f"{what} is {size} bytes of UTF-8; the limit is {max_bytes}")
    if not allow_empty and not value.strip():
        raise error(f"{what} is empty")
    return value


def check_candidates(candidates: object, config: FeedbackStoreConfig) -> list[str]:
    if isinstance(candidates, (str, bytes)) or not isinstance(candidates, Sequence):
        raise BadRequest("candidates must be a list of strings")
    if not 1 <= len(candidates) <= config.max_candidates:
        raise BadRequest(f"candidates must hold 1-{config.max_candidates} responses; got {len(candidates)}")
    # A candidate may be empty: the model can stop at once, and that is worth learning from. It
    # may hold NUL too: it is what the model said (any byte is a token), and an answer the store
    # refused could take no feedback. Text that clients write (prompts, edits) may not.
    return [
        check_text(text, f"candidate {i}", config.max_text_bytes, allow_empty=True, allow_nul=True)
        for i, text in enumerate(candidates)
    ]


def check_timings(timings: object, config: FeedbackStoreConfig) -> dict[str, float]:
    if timings is None:
        return {}
    if not isinstance(timings, Mapping) or len(timings) > config.max_timing_fields:
        raise BadRequest(f"timings must be a mapping of at most {config.max_timing_fields} names to numbers")
    checked: dict[str, float] = {}
    for name, value in timings.items():
        if not isinstance(name, str) or not name or len(name) > 64:
            raise BadRequest(f"timing name must be a string of 1-64 characters; got {name!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BadRequest(f"timing {name!r} must be a finite number; got {value!r}")
        checked[name] = float(value)
    return checked


def check_adapter_version(version: object) -> int:
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise BadRequest(f"adapter version must be an integer >= 0; got {version!r}")
    return version


def check_feedback_shape(feedback: Feedback, config: FeedbackStoreConfig) -> None:
    """Checks that need no database: types, star range, edit text. Index range is checked on write."""
    if not isinstance(feedback, (Choice, Thumbs, Rating, Edit)):
        raise InvalidFeedback(f"feedback must be Choice, Thumbs, Rating or Edit; got {type(feedback).__name__}")
    index = feedback.chosen if isinstance(feedback, Choice) else feedback.candidate
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise InvalidFeedback(f"candidate index must be an integer >= 0; got {index!r}")
    if isinstance(feedback, Thumbs) and not isinstance(feedback.up, bool):
        raise InvalidFeedback(f"thumbs needs up=True or up=False; got {feedback.up!r}")
    if isinstance(feedback, Rating) and (not isinstance(feedback.stars, int) or isinstance(feedback.stars, bool)):
        raise InvalidFeedback(f"rating stars must be an integer; got {feedback.stars!r}")
    if isinstance(feedback, Rating) and not MIN_STARS <= feedback.stars <= MAX_STARS:
        raise InvalidFeedback(f"rating must be {MIN_STARS}-{MAX_STARS} stars; got {feedback.stars}")
    if isinstance(feedback, Edit):
        check_text(feedback.text, "edited answer", config.max_text_bytes, error=InvalidFeedback)
