"""The wire protocol between apps and `maced`: frames, version, message shapes, validation, errors.

Pure: msgpack and the standard library only (no zmq, no torch, no engine), so the server and the
client SDK share it. docs/protocol.md is the prose version of this module.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)

# --- error codes -------------------------------------------------------------------------------
# Stable strings: clients branch on them. The message next to each is for docs and `macectl`.
ERROR_CODES: dict[str, str] = {
    "bad_message": "the frames could not be read as one msgpack map (bad msgpack, invalid UTF-8, "
    "wrong frame count)",
    "too_large": "a frame exceeds the daemon's size limit",
    "unsupported_version": "the request's protocol version is not spoken by this daemon",
    "unknown_op": "the operation name is not one this daemon knows",
    "bad_request": "a field is missing, of the wrong type or out of range",
    "duplicate_id": "the client reused the id of one of its requests still in flight",
    "busy": "too many requests in flight for this client or for the daemon",
    "not_ready": "the model is still loading",
    "shutting_down": "the daemon is stopping and admits nothing new",
    "cancelled": "the request was cancelled by its client",
    "timeout": "the request ran past its timeout_s",
    "admission_rejected": "the device is under pressure; retry after retry_after_s",
    "unknown_request": "no recorded interaction with that id for this user",
    "unknown_user": "the daemon holds nothing on that user",
    "adapter_unavailable": "no such adapter version is served for that user (or it cannot load)",
    "consent_required": "the user has not consented to feedback collection",
    "duplicate_feedback": "the same feedback was already recorded; the first one stands",
    "duplicate_request": "that interaction id was already recorded",
    "store_unavailable": "the feedback store cannot commit right now",
    "model_unavailable": "the model cannot be loaded",
    "not_supported": "this daemon build cannot do that (e.g. fine-tuning not available)",
    "internal": "a bug in the daemon; the request failed, the daemon keeps serving",
}

# --- operations --------------------------------------------------------------------------------
OPS = (
    "generate", "cancel", "feedback", "status", "health", "adapters.list", "adapters.rollback",
    "users.consent", "users.export", "users.forget",
)
# Safe to send again after a lost reply: repeating them changes nothing (consent sets a value;
# feedback is deduplicated by the store, so a resend is answered `duplicate_feedback`).
IDEMPOTENT_OPS = frozenset({"status", "health", "adapters.list", "users.consent", "users.export",
                            "cancel", "feedback"})

ROLES = ("system", "user", "assistant")
MAX_ID_CHARS = 128
MAX_MESSAGES = 1024
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOKENS_CAP = 1 << 20  # the engine also stops at its context length; this only bounds input
MAX_N = 16
MAX_FEEDBACK_FIELDS = 8
_USER_ID = re.compile(r"^[A-Za-z0-9_@-][A-Za-z0-9_.@-]{0,63}$")  # = edge_runtime.ids
_INTERACTION_ID = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")


class ProtocolError(Exception):
    """A request the daemon refuses, with the error code the reply carries."""

    def __init__(self, code: str, message: str, *, retry_after_s: float | None = None,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code if code in ERROR_CODES else "internal"
        self.message = message
        self.retry_after_s = retry_after_s
        self.details = details


# --- frames ------------------------------------------------------------------------------------


def encode(message: Mapping[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not part of the protocol")


def _refuse_timestamps(values: Iterable[Any]) -> None:
    # msgpack decodes its timestamp extension (type -1) itself instead of calling ext_hook.
    if any(isinstance(value, msgpack.Timestamp) for value in values):
        raise ValueError("msgpack extension type -1 (timestamp) is not part of the protocol")


def _no_timestamps_in_list(items: list[Any]) -> list[Any]:
    _refuse_timestamps(items)
    return items


def _no_timestamps_in_map(pairs: dict[Any, Any]) -> dict[Any, Any]:
    _refuse_timestamps(pairs.values())
    return pairs


def decode(frame: bytes, max_bytes: int | None = None) -> dict[str, Any]:
    """One frame -> one msgpack map; ProtocolError `too_large` / `bad_message` otherwise."""
    if max_bytes is not None and len(frame) > max_bytes:
        raise ProtocolError("too_large", f"frame of {len(frame)} bytes exceeds the limit of {max_bytes}")
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=True, ext_hook=_no_ext,
                                  timestamp=0, list_hook=_no_timestamps_in_list,
                                  object_hook=_no_timestamps_in_map)
    except UnicodeDecodeError as exc:
        raise ProtocolError("bad_message", f"a string is not valid UTF-8 ({exc.reason})") from None
    except (ValueError, msgpack.UnpackException) as exc:
        # Covers truncated input, extra data, nesting too deep, huge declared sizes, bad types.
        raise ProtocolError("bad_message", f"not a msgpack message: {exc or type(exc).__name__}") from None
    if not isinstance(message, dict):
        raise ProtocolError("bad_message", f"a request must be a msgpack map, got {type(message).__name__}")
    return message


def reply_envelope(frames: Sequence[Any]) -> list[bytes]:
    """The frames a reply goes back under: the routing id (bytes), and the empty delimiter a REQ
    client puts first (without it a REQ socket drops the reply), even when the body is malformed
    or too large. Only the length of the frames after the id is read, so they may be unread
    zmq frames."""
    if len(frames) >= 3 and len(frames[1]) == 0:
        return [frames[0], b""]
    return list(frames[:1])


def split_envelope(frames: list[bytes]) -> tuple[list[bytes], bytes]:
    """ROUTER frames -> (reply envelope, body). DEALER clients send [body]; REQ clients put an
    empty delimiter first, which must come back in the reply envelope. Anything else raises
    `bad_message` (answered under `reply_envelope(frames)`)."""
    if len(frames) < 2:
        raise ProtocolError("bad_message", "a request has exactly one body frame; got none")
    envelope = reply_envelope(frames)
    bodies = frames[len(envelope):]
    if len(bodies) != 1:
        raise ProtocolError("bad_message", f"a request has exactly one body frame; got {len(bodies)}")
    return envelope, bodies[0]


# --- replies -----------------------------------------------------------------------------------


def token_message(request_id: Any, index: int, text: str, token_id: int | None) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "type": "token", "index": index, "text": text,
            "token_id": token_id}


def result_message(request_id: Any, result: Mapping[str, Any]) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "type": "result", "result": dict(result)}


def error_message(request_id: Any, code: str, message: str, *, retry_after_s: float | None = None,
                  details: Mapping[str, Any] | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code if code in ERROR_CODES else "internal", "message": message}
    if retry_after_s is not None:
        error["retry_after_s"] = float(retry_after_s)
    if details:
        error["details"] = dict(details)
    return {"v": PROTOCOL_VERSION, "id": request_id, "type": "error", "error": error}


def error_from(request_id: Any, exc: ProtocolError) -> dict[str, Any]:
    return error_message(request_id, exc.code, exc.message, retry_after_s=exc.retry_after_s,
                         details=exc.details)


# --- requests ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    id: str | int
    op: str
    args: Any  # the op's validated arguments record


def request_id_of(message: Mapping[str, Any]) -> str | int | None:
    """The client's id if it is usable in a reply (so even a rejected request is answered by id)."""
    value = message.get("id")
    if isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63:
        return value
    return None


def parse_request(message: Mapping[str, Any]) -> Request:
    """Validate the envelope and the op's arguments; raises ProtocolError naming the problem."""
    version = message.get("v")
    # An integer, exactly: 1.0 == 1 and True == 1 in Python, but neither is version 1.
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        raise ProtocolError(
            "unsupported_version",
            f"protocol version {version!r} is not supported; this daemon speaks {list(SUPPORTED_VERSIONS)}",
            details={"supported": list(SUPPORTED_VERSIONS)})
    request_id = request_id_of(message)
    if request_id is None:
        raise ProtocolError("bad_request", f"'id' must be a string of 1-{MAX_ID_CHARS} characters or "
                            "a 64-bit integer")
    op = message.get("op")
    if not isinstance(op, str) or op not in _PARSERS:
        shown = op if isinstance(op, str) and len(op) <= 64 else type(op).__name__
        raise ProtocolError("unknown_op", f"unknown op {shown!r}; known ops: {', '.join(OPS)}")
    fields = {k: v for k, v in message.items() if k not in ("v", "id", "op")}
    parser, allowed = _PARSERS[op]
    unknown = sorted(str(k)[:64] for k in fields if k not in allowed)
    if unknown:
        raise ProtocolError("bad_request", f"op {op!r} has no field(s) {', '.join(unknown)}; "
                            f"allowed: {', '.join(sorted(allowed)) or 'none'}")
    return Request(request_id, op, parser(_Fields(op, fields)))


class _Fields:
    """Typed getters over one request's fields, raising `bad_request` with the field's name."""

    def __init__(self, op: str, values: Mapping[str, Any]) -> None:
        self.op = op
        self.values = values

    def _fail(self, name: str, want: str) -> ProtocolError:
        got = self.values.get(name)
        shown = repr(got) if isinstance(got, (int, float, bool)) or got is None else type(got).__name__
        return ProtocolError("bad_request", f"{self.op}: '{name}' must be {want}; got {shown}")

    def has(self, name: str) -> bool:
        return self.values.get(name) is not None

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
        return self.text(name, max_chars=64, required=required, pattern=_USER_ID,
                        what="a user id: 1-64 letters, digits, '_', '-', '.', '@', not starting with '.'")


# --- per-op arguments --------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerateArgs:
    prompt: str | list[dict[str, str]]
    max_tokens: int | None = None  # None: the daemon's configured default
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    user: str | None = None
    record: bool = True  # store the interaction for feedback when `user` has consented
    adapter: str | int = "latest"  # "latest" (the user's newest), "base", or a version number
    timeout_s: float | None = None

    def sampling_kwargs(self, default_max_tokens: int) -> dict[str, Any]:
        """Keyword arguments of `edge_runtime.sampling.SamplingParams`."""
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        return {"max_tokens": max_tokens, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p, "seed": self.seed, "n": self.n, "stop": self.stop,
                "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos}


def _parse_generate(f: _Fields) -> GenerateArgs:
    has_prompt, has_messages = f.has("prompt"), f.has("messages")
    if has_prompt == has_messages:
        raise ProtocolError("bad_request", "generate: give exactly one of 'prompt' (text) or "
                            "'messages' (chat: a list of {role, content})")
    prompt: str | list[dict[str, str]]
    if has_prompt:
        prompt = f.text("prompt", max_chars=1 << 24, what="a string") or ""
        if not prompt.strip():
            raise ProtocolError("bad_request", "generate: 'prompt' is empty")
    else:
        prompt = _parse_messages(f.values["messages"])
    stop_value = f.values.get("stop")
    if stop_value is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_value, str):
        stop = (stop_value,)
    elif isinstance(stop_value, list) and len(stop_value) <= MAX_STOP_STRINGS:
        stop = tuple(stop_value)
    else:
        raise f._fail("stop", f"a string or a list of at most {MAX_STOP_STRINGS} strings")
    if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise f._fail("stop", f"non-empty strings of at most {MAX_STOP_CHARS} characters")
    ids = f.values.get("stop_token_ids")
    ids = [] if ids is None else ids  # only nil means "none": 0, false, "" or {} are mistakes
    if (not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS
            or any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < 2**31 for t in ids)):
        raise f._fail("stop_token_ids", f"a list of at most {MAX_STOP_TOKEN_IDS} token ids")
    adapter = f.values.get("adapter", "latest")
    if not (adapter in ("latest", "base")
            or (isinstance(adapter, int) and not isinstance(adapter, bool) and 0 <= adapter < 2**31)):
        raise f._fail("adapter", "'latest', 'base' or a version number >= 0")
    user = f.user(required=False)
    if adapter not in ("latest", "base") and user is None:
        raise ProtocolError("bad_request", "generate: an adapter version needs 'user'")
    return GenerateArgs(
        prompt=prompt,
        max_tokens=f.integer("max_tokens", lo=1, hi=MAX_TOKENS_CAP),
        temperature=f.number("temperature", lo=0.0, hi=100.0, default=0.0),
        top_k=f.integer("top_k", lo=0, hi=2**31 - 1, default=0),
        top_p=f.number("top_p", lo=0.0, hi=1.0, default=1.0, lo_open=True),
        seed=f.integer("seed", lo=0, hi=2**63 - 1 - MAX_N),
        n=f.integer("n", lo=1, hi=MAX_N, default=1),
        stop=stop,
        stop_token_ids=tuple(ids),
        ignore_eos=f.flag("ignore_eos", default=False),
        stream=f.flag("stream", default=False),
        user=user,
        record=f.flag("record", default=True),
        adapter=adapter,
        timeout_s=f.number("timeout_s", lo=0.0, hi=86_400.0, lo_open=True),
    )


def _parse_messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_MESSAGES:
        raise ProtocolError("bad_request", f"generate: 'messages' must be a list of 1-{MAX_MESSAGES} "
                            "{role, content} maps")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise ProtocolError("bad_request", f"generate: messages[{i}] must be a map with exactly "
                                "'role' and 'content'")
        role, content = m["role"], m["content"]
        if role not in ROLES or not isinstance(content, str):
            raise ProtocolError("bad_request", f"generate: messages[{i}] needs role in "
                                f"{', '.join(ROLES)} and string content")
        messages.append({"role": role, "content": content})
    return messages


@dataclass(frozen=True)
class CancelArgs:
    target: str | int  # the id of one of this client's requests in flight


def _parse_cancel(f: _Fields) -> CancelArgs:
    target = request_id_of({"id": f.values.get("target")})
    if target is None:
        raise f._fail("target", "the id of one of your requests in flight")
    return CancelArgs(target)


@dataclass(frozen=True)
class FeedbackArgs:
    user: str
    interaction_id: str
    feedback: dict[str, Any]  # {"kind": "choice"|"thumbs"|"rating"|"edit", ...}; the store parses it


def _parse_feedback(f: _Fields) -> FeedbackArgs:
    user = f.user()
    interaction = f.text("interaction_id", max_chars=128, required=True, pattern=_INTERACTION_ID,
                        what="the interaction_id a generate reply gave")
    feedback = f.values.get("feedback")
    if (not isinstance(feedback, dict) or not isinstance(feedback.get("kind"), str)
            or len(feedback) > MAX_FEEDBACK_FIELDS):
        raise f._fail("feedback", "a map with 'kind' (choice, thumbs, rating or edit) and its fields")
    assert user is not None and interaction is not None
    return FeedbackArgs(user, interaction, feedback)


@dataclass(frozen=True)
class NoArgs:
    pass


@dataclass(frozen=True)
class UserArgs:
    user: str


@dataclass(frozen=True)
class ConsentArgs:
    user: str
    granted: bool


@dataclass(frozen=True)
class AdaptersListArgs:
    user: str | None = None


@dataclass(frozen=True)
class RollbackArgs:
    user: str
    version: int


def _user_args(f: _Fields) -> UserArgs:
    return UserArgs(f.user() or "")


def _consent_args(f: _Fields) -> ConsentArgs:
    return ConsentArgs(f.user() or "", bool(f.flag("granted", required=True)))


def _adapters_list(f: _Fields) -> AdaptersListArgs:
    return AdaptersListArgs(f.user(required=False))


def _rollback(f: _Fields) -> RollbackArgs:
    return RollbackArgs(f.user() or "", f.integer("version", lo=0, hi=2**31 - 1, required=True) or 0)


_GENERATE_FIELDS = frozenset({
    "prompt", "messages", "max_tokens", "temperature", "top_k", "top_p", "seed", "n", "stop",
    "stop_token_ids", "ignore_eos", "stream", "user", "record", "adapter", "timeout_s"})

_PARSERS: dict[str, tuple[Any, frozenset[str]]] = {
    "generate": (_parse_generate, _GENERATE_FIELDS),
    "cancel": (_parse_cancel, frozenset({"target"})),
    "feedback": (_parse_feedback, frozenset({"user", "interaction_id", "feedback"})),
    "status": (lambda f: NoArgs(), frozenset()),
    "health": (lambda f: NoArgs(), frozenset()),
    "adapters.list": (_adapters_list, frozenset({"user"})),
    "adapters.rollback": (_rollback, frozenset({"user", "version"})),
    "users.consent": (_consent_args, frozenset({"user", "granted"})),
    "users.export": (_user_args, frozenset({"user"})),
    "users.forget": (_user_args, frozenset({"user"})),
}
assert set(_PARSERS) == set(OPS)
