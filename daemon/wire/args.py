"""The arguments of the small ops (cancel, feedback, embed, users, adapters) and their validation.

Pure standard library.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from daemon.wire.fields import (
    INTERACTION_ID,
    MAX_EMBED_INPUTS,
    MAX_FEEDBACK_FIELDS,
    MAX_PROMPT_TOKEN_IDS,
    Fields,
    is_token,
    request_id_of,
)

# The app whose user an operator's request names (docs/security.md); an app may name only itself.
APP_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")


def _app(f: Fields) -> str | None:
    return f.text("app", max_chars=32, pattern=APP_NAME, what="an app's name from the daemon's [[apps]]")


@dataclass(frozen=True)
class CancelArgs:
    target: str | int  # the id of one of this client's requests in flight


def parse_cancel(f: Fields) -> CancelArgs:
    target = request_id_of({"id": f.values.get("target")})
    if target is None:
        raise f._fail("target", "the id of one of your requests in flight")
    return CancelArgs(target)


@dataclass(frozen=True)
class FeedbackArgs:
    user: str
    interaction_id: str
    feedback: dict[str, Any]  # {"kind": "choice"|"thumbs"|"rating"|"edit", ...}; the store parses it


def parse_feedback(f: Fields) -> FeedbackArgs:
    user = f.user()
    interaction = f.text("interaction_id", max_chars=128, required=True, pattern=INTERACTION_ID,
                        what="the interaction_id a generate reply gave")
    feedback = f.values.get("feedback")
    if (not isinstance(feedback, dict) or not isinstance(feedback.get("kind"), str)
            or len(feedback) > MAX_FEEDBACK_FIELDS):
        raise f._fail("feedback", "a map with 'kind' (choice, thumbs, rating or edit) and its fields")
    assert user is not None and interaction is not None
    return FeedbackArgs(user, interaction, feedback)


@dataclass(frozen=True)
class EmbedArgs:
    inputs: tuple[str | list[int], ...]  # texts or token-id lists


def parse_embed(f: Fields) -> EmbedArgs:
    value = f.values.get("input")
    want = (f"a string, a list of 1-{MAX_EMBED_INPUTS} strings, a list of token ids, or a list of "
            "token-id lists")
    if isinstance(value, str) or (isinstance(value, list) and value and all(is_token(t) for t in value)):
        value = [value]
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_EMBED_INPUTS:
        raise f._fail("input", want)
    for item in value:
        ok = (isinstance(item, str) and 0 < len(item) <= 1 << 24) or (
            isinstance(item, list) and 0 < len(item) <= MAX_PROMPT_TOKEN_IDS and all(is_token(t) for t in item))
        if not ok:
            raise f._fail("input", want + " (none empty)")
    return EmbedArgs(tuple(value))


@dataclass(frozen=True)
class NoArgs:
    pass


@dataclass(frozen=True)
class UserArgs:
    user: str
    app: str | None = None


@dataclass(frozen=True)
class ConsentArgs:
    user: str
    granted: bool | None  # consent to feedback collection; None: leave as it is
    fleet: bool | None = None  # consent to training the shared fleet adapter; None: leave as it is
    app: str | None = None


@dataclass(frozen=True)
class AdaptersListArgs:
    user: str | None = None
    app: str | None = None


@dataclass(frozen=True)
class RollbackArgs:
    user: str
    version: int
    app: str | None = None


def user_args(f: Fields) -> UserArgs:
    return UserArgs(f.user() or "", _app(f))


def consent_args(f: Fields) -> ConsentArgs:
    user = f.user() or ""
    fleet = f.flag("fleet")
    # `granted` alone is the original form; `fleet` alone changes only the fleet consent.
    granted = f.flag("granted", required=fleet is None)
    if granted is False and fleet is True:
        raise f._fail("fleet", "false or absent when withdrawing consent to feedback collection "
                      "(fleet consent needs it)")
    return ConsentArgs(user, granted, fleet, _app(f))


def adapters_list_args(f: Fields) -> AdaptersListArgs:
    return AdaptersListArgs(f.user(required=False), _app(f))


def rollback_args(f: Fields) -> RollbackArgs:
    return RollbackArgs(f.user() or "", f.integer("version", lo=0, hi=2**31 - 1, required=True) or 0, _app(f))

