"""The bounds every request shares (ids, users, feedback) and the typed getters that check one
request's fields, raising `bad_request` with the field's name.

Pure standard library.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from typing import Any

from daemon.wire.errors import ProtocolError

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


class Fields:
    """Typed getters over one request's fields, raising `bad_request` with the field's name."""

    def __init__(self, op: str, values: Mapping[str, Any]) -> None:
        self.op = op
        self.values = values

    def _fail(self, name: str, want: str) -> ProtocolError:
        got = self.values.get(name)
        shown = repr(got) if isinstance(got, (int, float, bool)) or got is None else type(got).__name__
        return ProtocolError("bad_request", f"{self.op}: '{name}' must be {want}; got {shown}", param=name)

    def text(self, name: str, *, max_chars: int, default: str | None = None, required: bool = False,
            pattern: re.Pattern[str] | None = None, what: str = "a string") -> str | None:
        value = self.values.get(name)
        if value is None:
            if required:
                raise self._fail(name, what)
            return default
        if not isinstance(value, str) or len(value) > max_chars or (pattern and not pattern.fullmatch(value)):
            raise self._fail(name, what)
        return value

    def integer(self, name: str, *, lo: int, hi: int, default: int | None = None,
            required: bool = False) -> int | None:
        value = self.values.get(name)
        if value is None and not required:
            return default
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise self._fail(name, f"an integer in [{lo}, {hi}]")
        return value

    def number(self, name: str, *, lo: float, hi: float, default: float | None = None,
              lo_open: bool = False) -> float | None:
        value = self.values.get(name)
        if value is None:
            return default
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value > hi or value < lo or (lo_open and value == lo):
            raise self._fail(name, f"a number in {'(' if lo_open else '['}{lo}, {hi}]")
        return float(value)

    def flag(self, name: str, *, default: bool | None = None, required: bool = False) -> bool | None:
        value = self.values.get(name)
        if value is None and not required:
            return default
        if not isinstance(value, bool):
            raise self._fail(name, "true or false")
        return value

    def user(self, name: str = "user", *, required: bool = True) -> str | None:
        value = self.text(name, max_chars=MAX_USER_CHARS, required=required, pattern=APP_USER,
                          what=f"a user: 1-{MAX_USER_CHARS} printable characters (an app's own id)")
        return None if value is None else internal_user(value)


def internal_user(app_user: str) -> str:
    """The id the daemon keys a user's data, adapters and rights on, for the string an app sent
    (OpenAI's free-form `user`, such as "user:1234" or an email). Ids of 1-64 letters, digits,
    '_', '-', '.', '@' (not starting with '.') are their own; any other string maps to
    "h-" + the first 40 hex digits of its SHA-256, the same on every front and every start, so
    `macectl users export "user:1234"` finds what the app stored under that string."""
    if USER_ID.fullmatch(app_user):
        return app_user
    return "h-" + hashlib.sha256(app_user.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31

