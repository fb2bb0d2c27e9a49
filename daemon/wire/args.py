"""The arguments of the small ops (cancel, feedback, embed, users, adapters), declared as msgspec
`Struct`s with their bounds and checked once by `fields.convert`; the few rules that tie fields
together follow each conversion. docs/protocol.md is their prose.

msgspec and the standard library.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from daemon.wire.fields import (
    APP_USER,
    INTERACTION_ID,
    MAX_EMBED_INPUTS,
    MAX_FEEDBACK_FIELDS,
    MAX_ID_CHARS,
    MAX_PROMPT_TOKEN_IDS,
    MAX_USER_CHARS,
    anchored,
    convert,
    internal_user,
    refusal,
)

# The app whose user an operator's request names (docs/security.md); an app may name only itself.
APP_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")

AppName = Annotated[str, Meta(pattern=anchored(APP_NAME))]
AppUser = Annotated[str, Meta(max_length=MAX_USER_CHARS, pattern=anchored(APP_USER))]
TokenId = Annotated[int, Meta(ge=0, lt=2**31)]
MAX_EMBED_CHARS = 1 << 24

WANT = {
    "user": f"a user: 1-{MAX_USER_CHARS} printable characters (an app's own id)",
    "app": "an app's name from the daemon's [[apps]]",
    "target": "the id of one of your requests in flight",
    "interaction_id": "the interaction_id a generate reply gave",
    "feedback": "a map with 'kind' (choice, thumbs, rating or edit) and its fields",
    "input": (f"a string, a list of 1-{MAX_EMBED_INPUTS} strings, a list of token ids, or a list of "
              "token-id lists"),
}
WANT["input[]"] = WANT["input"] + " (none empty)"  # one of the inputs refused


class _Args(Struct, frozen=True):
    pass


class NoArgs(_Args):
    pass


class CancelArgs(_Args):
    target: Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS)] | Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]


class FeedbackArgs(_Args):
    user: AppUser
    interaction_id: Annotated[str, Meta(max_length=MAX_ID_CHARS, pattern=anchored(INTERACTION_ID))]
    # {"kind": "choice"|"thumbs"|"rating"|"edit", ...}; the store parses it
    feedback: Annotated[dict[Any, Any], Meta(max_length=MAX_FEEDBACK_FIELDS)]


class EmbedArgs(_Args):
    # Texts or token-id lists; a flat list of token ids is one input (made a 1-tuple).
    inputs: (str | Annotated[list[Annotated[str, Meta(min_length=1, max_length=MAX_EMBED_CHARS)] | TokenId
                                  | Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)]],
                             Meta(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)]) = msgspec.field(name="input")


class UserArgs(_Args):
    user: AppUser
    app: AppName | None = None


class ConsentArgs(_Args):
    user: AppUser
    granted: bool | None = None  # consent to feedback collection; None: leave as it is
    fleet: bool | None = None  # consent to training the shared fleet adapter; None: leave as it is
    app: AppName | None = None


class AdaptersListArgs(_Args):
    user: AppUser | None = None
    app: AppName | None = None


class RollbackArgs(_Args):
    user: AppUser
    version: Annotated[int, Meta(ge=0, le=2**31 - 1)]
    app: AppName | None = None


def _with_user(args: Any) -> Any:
    """The app's `user` string as the id the daemon keys the user's data on."""
    return args if args.user is None else msgspec.structs.replace(args, user=internal_user(args.user))


def parse_cancel(op: str, values: dict[str, Any]) -> CancelArgs:
    return convert(op, values, CancelArgs, WANT)


def parse_feedback(op: str, values: dict[str, Any]) -> FeedbackArgs:
    args = convert(op, values, FeedbackArgs, WANT)
    if not isinstance(args.feedback.get("kind"), str):
        raise refusal(op, values, "feedback", WANT["feedback"])
    return _with_user(args)


def parse_embed(op: str, values: dict[str, Any]) -> EmbedArgs:
    args = convert(op, values, EmbedArgs, WANT)
    inputs = args.inputs
    tokens = [isinstance(item, int) for item in inputs]
    if isinstance(inputs, str) or all(tokens):
        inputs = [inputs]  # one text, or one list of token ids
    elif any(tokens):
        raise refusal(op, values, "input", WANT["input"] + " (none empty)")  # ids beside inputs
    if len(inputs) > MAX_EMBED_INPUTS:
        raise refusal(op, values, "input", WANT["input"])
    if any(isinstance(item, str) and not 0 < len(item) <= MAX_EMBED_CHARS for item in inputs):
        raise refusal(op, values, "input", WANT["input"] + " (none empty)")
    return msgspec.structs.replace(args, inputs=tuple(inputs))


def user_args(op: str, values: dict[str, Any]) -> UserArgs:
    return _with_user(convert(op, values, UserArgs, WANT))


def consent_args(op: str, values: dict[str, Any]) -> ConsentArgs:
    args = convert(op, values, ConsentArgs, WANT)
    # `granted` alone is the original form; `fleet` alone changes only the fleet consent.
    if args.granted is None and args.fleet is None:
        raise refusal(op, values, "granted", "true or false")
    if args.granted is False and args.fleet is True:
        raise refusal(op, values, "fleet", "false or absent when withdrawing consent to feedback collection "
                      "(fleet consent needs it)")
    return _with_user(args)


def adapters_list_args(op: str, values: dict[str, Any]) -> AdaptersListArgs:
    return _with_user(convert(op, values, AdaptersListArgs, WANT))


def rollback_args(op: str, values: dict[str, Any]) -> RollbackArgs:
    return _with_user(convert(op, values, RollbackArgs, WANT))
