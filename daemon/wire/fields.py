"""The bounds every request shares (ids, users, feedback), and `convert`: one op's fields checked
once as its msgspec Struct, a refusal raising `bad_request` with the field's name and the
protocol's text for it.

msgspec and the standard library.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from daemon.wire.errors import ProtocolError

S = TypeVar("S")

MAX_EMBED_INPUTS = 256
MAX_ID_CHARS = 128
MAX_PROMPT_TOKEN_IDS = 1 << 20
MAX_FEEDBACK_FIELDS = 8
USER_ID = re.compile(r"^[A-Za-z0-9_@-][A-Za-z0-9_.@-]{0,63}$")  # = edge_runtime.ids
MAX_USER_CHARS = 256
# What an app may send as `user`: printable text (no control characters: a trailing newline or a
# NUL is a client bug, not a different user).
APP_USER = re.compile(r"[^\x00-\x1f\x7f-\x9f]{1,256}")
INTERACTION_ID = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")
ABSOLUTE_PATH = re.compile(r"/[^\x00-\x1f\x7f]*")  # the daemon's working folder is not the client's


def request_id_of(message: Mapping[str, Any]) -> str | int | None:
    """The client's id if it is usable in a reply (so even a rejected request is answered by id)."""
    value = message.get("id")
    if isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63:
        return value
    return None


def anchored(pattern: re.Pattern[str]) -> str:
    """`pattern` for a msgspec `Meta(pattern=...)`, which searches: the whole string must match
    (`\\Z`, not `$`, which also matches before a trailing newline)."""
    return rf"^(?:{pattern.pattern})\Z"


def refusal(op: str, values: Mapping[str, Any], name: str, want: str) -> ProtocolError:
    """`bad_request` naming the field, what it must be and what it was."""
    got = values.get(name)
    shown = repr(got) if isinstance(got, (int, float, bool)) or got is None else type(got).__name__
    return ProtocolError("bad_request", f"{op}: '{name}' must be {want}; got {shown}", param=name)


def bounds_want(schema: type, name: str) -> str:
    """'an integer in [lo, hi]', 'a number in (lo, hi]' (read off a Struct field's own bounds),
    'true or false' or 'a string'."""
    info = next(f for f in msgspec.inspect.type_info(schema).fields if f.encode_name == name)  # type: ignore[attr-defined]
    kinds = [t for t in getattr(info.type, "types", (info.type,)) if not isinstance(t, msgspec.inspect.NoneType)]
    t = kinds[0]
    if isinstance(t, msgspec.inspect.IntType):
        return f"an integer in [{t.ge}, {t.le if t.le is not None else t.lt - 1}]"
    if isinstance(t, msgspec.inspect.BoolType):
        return "true or false"
    if isinstance(t, msgspec.inspect.StrType):
        return "a string"
    lo = t.ge if t.ge is not None else t.gt
    return f"a number in {'[' if t.ge is not None else '('}{lo}, {t.le}]"


_AT = re.compile(r" - at `\$\.(?P<name>\w+)(?P<part>[.\[])?")  # where msgspec refused, or what was missing:
_MISSING = re.compile(r"missing required field `(?P<name>\w+)`")


def convert(op: str, values: Mapping[str, Any], schema: type[S], want: Mapping[str, str]) -> S:
    """`values` (nil means absent, as everywhere in the protocol) as the Struct `schema`, checked
    once; a refusal names the first field msgspec refused, with what it must be: `want[field]`
    (`want[field + "[]"]` when a part of it was refused, if given), else its bounds."""
    present = {k: v for k, v in values.items() if v is not None}
    try:
        return msgspec.convert(present, schema)
    except msgspec.ValidationError as exc:
        where = _AT.search(str(exc)) or _MISSING.search(str(exc))
        name = where["name"] if where else ""
        text = (want.get(name + "[]") if where and where.groupdict().get("part") else None) or want.get(name)
        raise refusal(op, present, name, text or bounds_want(schema, name)) from None


def internal_user(app_user: str) -> str:
    """The id the daemon keys a user's data, adapters and rights on, for the string an app sent
    (OpenAI's free-form `user`, such as "user:1234" or an email). Ids of 1-64 letters, digits,
    '_', '-', '.', '@' (not starting with '.') are their own; any other string maps to
    "h-" + the first 40 hex digits of its SHA-256, the same on every front and every start, so
    `macectl users export "user:1234"` finds what the app stored under that string."""
    if USER_ID.fullmatch(app_user):
        return app_user
    return "h-" + hashlib.sha256(app_user.encode("utf-8", "surrogatepass")).hexdigest()[:40]

