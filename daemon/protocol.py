"""The wire protocol between apps and `maced`: frames, version, message shapes, validation, errors.

Pure: msgpack and the standard library only (no zmq, no torch, no engine), so the server and the
client SDK share it. docs/protocol.md is the prose version of this module.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
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
    "users.consent", "users.export", "users.forget", "embed", "fleet.publish", "fleet.rollback",
    "fleet.status", "fleet.round", "fleet.evaluate",
)
# Ops whose requests carry adapter tensors: their frames may reach `fleet.max_message_bytes`.
TENSOR_OPS = frozenset({"fleet.round", "fleet.evaluate"})
# Safe to send again after a lost reply: repeating them changes nothing (consent sets a value;
# feedback is deduplicated by the store, so a resend is answered `duplicate_feedback`).
IDEMPOTENT_OPS = frozenset({"status", "health", "adapters.list", "users.consent", "users.export",
                            "cancel", "feedback", "embed", "fleet.status", "fleet.evaluate"})
MAX_EMBED_INPUTS = 256

ROLES = ("system", "user", "assistant", "tool")
MAX_ID_CHARS = 128
MAX_MESSAGES = 1024
MAX_TOOLS = 128
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024
MAX_PROMPT_TOKEN_IDS = 1 << 20
TOOL_CHOICES = ("none", "auto", "required")
# response_format types: OpenAI's, plus `regex` and `grammar` (a Lark grammar, llguidance's dialect).
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "regex", "grammar")
MAX_GRAMMAR_CHARS = 1 << 18
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOKENS_CAP = 1 << 20  # the engine also stops at its context length; this only bounds input
MAX_N = 16
MAX_FEEDBACK_FIELDS = 8
_USER_ID = re.compile(r"^[A-Za-z0-9_@-][A-Za-z0-9_.@-]{0,63}$")  # = edge_runtime.ids
MAX_USER_CHARS = 256
# What an app may send as `user`: printable text (no control characters: a trailing newline or a
# NUL is a client bug, not a different user).
_APP_USER = re.compile(r"[^\x00-\x1f\x7f-\x9f]{1,256}")
_INTERACTION_ID = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")
_ABSOLUTE_PATH = re.compile(r"/[^\x00-\x1f\x7f]*")  # the daemon's working folder is not the client's
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # = edge_runtime.chat


class ProtocolError(Exception):
    """A request the daemon refuses, with the error code the reply carries."""

    def __init__(self, code: str, message: str, *, retry_after_s: float | None = None,
                 details: dict[str, Any] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code if code in ERROR_CODES else "internal"
        self.message = message
        self.retry_after_s = retry_after_s
        self.details = details
        self.param = param  # the request field at fault (`messages.2.tool_calls`), when one is


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


def token_message(request_id: Any, index: int, text: str, token_id: int | None,
                  extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A streamed piece of candidate `index`; `extra` may add `logprobs` (the pieces' tokens)
    and `tool_calls` (calls that completed in this piece)."""
    message = {"v": PROTOCOL_VERSION, "id": request_id, "type": "token", "index": index, "text": text,
               "token_id": token_id}
    if extra:
        message.update(extra)
    return message


def result_message(request_id: Any, result: Mapping[str, Any]) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "type": "result", "result": dict(result)}


def error_message(request_id: Any, code: str, message: str, *, retry_after_s: float | None = None,
                  details: Mapping[str, Any] | None = None, param: str | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code if code in ERROR_CODES else "internal", "message": message}
    if param is not None:
        error["param"] = param
    if retry_after_s is not None:
        error["retry_after_s"] = float(retry_after_s)
    if details:
        error["details"] = dict(details)
    return {"v": PROTOCOL_VERSION, "id": request_id, "type": "error", "error": error}


def error_from(request_id: Any, exc: ProtocolError) -> dict[str, Any]:
    return error_message(request_id, exc.code, exc.message, retry_after_s=exc.retry_after_s,
                         details=exc.details, param=exc.param)


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
        return ProtocolError("bad_request", f"{self.op}: '{name}' must be {want}; got {shown}", param=name)

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
        value = self.text(name, max_chars=MAX_USER_CHARS, required=required, pattern=_APP_USER,
                          what=f"a user: 1-{MAX_USER_CHARS} printable characters (an app's own id)")
        return None if value is None else internal_user(value)


def internal_user(app_user: str) -> str:
    """The id the daemon keys a user's data, adapters and rights on, for the string an app sent
    (OpenAI's free-form `user`, such as "user:1234" or an email). Ids of 1-64 letters, digits,
    '_', '-', '.', '@' (not starting with '.') are their own; any other string maps to
    "h-" + the first 40 hex digits of its SHA-256, the same on every front and every start, so
    `macectl users export "user:1234"` finds what the app stored under that string."""
    if _USER_ID.fullmatch(app_user):
        return app_user
    return "h-" + hashlib.sha256(app_user.encode("utf-8", "surrogatepass")).hexdigest()[:40]


# --- per-op arguments --------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerateArgs:
    prompt: str | list[dict[str, Any]] | list[int]  # text, chat messages, or token ids
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
    logprobs: int | None = None  # None: none; k: each token's and the k most likely
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    response_format: tuple[str, str] | None = None  # (constraint kind, its text) for the engine
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str = "auto"  # none, auto, required, or a function's name
    continue_final_message: bool = False
    echo: bool = False  # the result also carries the prompt's text (`prompt_text`)

    def sampling_kwargs(self, default_max_tokens: int) -> dict[str, Any]:
        """Keyword arguments of `edge_runtime.sampling.SamplingParams` (without the constraint,
        which the daemon builds from `response_format`)."""
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        return {"max_tokens": max_tokens, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p, "seed": self.seed, "n": self.n, "stop": self.stop,
                "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
                "logprobs": self.logprobs, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "logit_bias": self.logit_bias}

    @property
    def is_chat(self) -> bool:
        return isinstance(self.prompt, list) and bool(self.prompt) and isinstance(self.prompt[0], dict)


def _parse_generate(f: _Fields) -> GenerateArgs:
    has_prompt, has_messages = f.has("prompt"), f.has("messages")
    if has_prompt == has_messages:
        raise ProtocolError("bad_request", "generate: give exactly one of 'prompt' (text) or "
                            "'messages' (chat: a list of {role, content})", param="prompt")
    prompt: str | list[dict[str, Any]] | list[int]
    if has_prompt and isinstance(f.values["prompt"], list):
        prompt = f.values["prompt"]
        if (not 1 <= len(prompt) <= MAX_PROMPT_TOKEN_IDS
                or any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < 2**31 for t in prompt)):
            raise f._fail("prompt", "a string, or a non-empty list of token ids")
    elif has_prompt:
        prompt = f.text("prompt", max_chars=1 << 24, what="a string, or a non-empty list of token ids") or ""
        if not prompt.strip():
            raise ProtocolError("bad_request", "generate: 'prompt' is empty", param="prompt")
    else:
        prompt = _parse_messages(f.values["messages"])
    tools = _parse_tools(f)
    tool_choice = _parse_tool_choice(f, tools)
    continue_final = bool(f.flag("continue_final_message", default=False))
    if (tools or continue_final) and not has_messages:
        raise ProtocolError("bad_request", "generate: 'tools' and 'continue_final_message' need 'messages'",
                            param="tools" if tools else "continue_final_message")
    if continue_final and prompt[-1].get("role") != "assistant":  # type: ignore[index, union-attr]
        raise f._fail("continue_final_message", "true only when the last message is the assistant's")
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
        raise ProtocolError("bad_request", "generate: an adapter version needs 'user'", param="adapter")
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
        logprobs=f.integer("logprobs", lo=0, hi=MAX_LOGPROBS),
        presence_penalty=f.number("presence_penalty", lo=-2.0, hi=2.0, default=0.0),
        frequency_penalty=f.number("frequency_penalty", lo=-2.0, hi=2.0, default=0.0),
        logit_bias=_parse_logit_bias(f),
        response_format=_parse_response_format(f),
        tools=tools,
        tool_choice=tool_choice,
        continue_final_message=continue_final,
        echo=bool(f.flag("echo", default=False)),
    )


def _parse_logit_bias(f: _Fields) -> tuple[tuple[int, float], ...]:
    value = f.values.get("logit_bias")
    if value is None:
        return ()
    want = f"a map of at most {MAX_LOGIT_BIAS} token ids (integers, or their decimal strings) to numbers in [-100, 100]"
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise f._fail("logit_bias", want)
    pairs = []
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isdigit() and len(key) <= 10 else key
        if (not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < 2**31
                or isinstance(bias, bool) or not isinstance(bias, (int, float))
                or not math.isfinite(bias) or not -100 <= bias <= 100):
            raise f._fail("logit_bias", want)
        pairs.append((token, float(bias)))
    return tuple(pairs)


def _parse_response_format(f: _Fields) -> tuple[str, str] | None:
    """OpenAI's `response_format` (plus `regex` and `grammar`) as the engine's constraint."""
    value = f.values.get("response_format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise f._fail("response_format", "a map with 'type' one of " + ", ".join(RESPONSE_FORMATS))
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json", "")
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise f._fail("response_format", "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}")
        text = _json_text(schema)
        if text is None or len(text) > MAX_GRAMMAR_CHARS:
            raise f._fail("response_format", f"a JSON schema of at most {MAX_GRAMMAR_CHARS} characters")
        return ("json_schema", text)
    field_name = "regex" if kind == "regex" else "grammar"
    pattern = value.get(field_name)
    if not isinstance(pattern, str) or not pattern.strip() or len(pattern) > MAX_GRAMMAR_CHARS:
        raise f._fail("response_format", f"{{'type': '{kind}', '{field_name}': a non-empty string of at most "
                      f"{MAX_GRAMMAR_CHARS} characters}}")
    return ("regex" if kind == "regex" else "lark", pattern)


def _json_text(value: Any) -> str | None:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return None


def _parse_tools(f: _Fields) -> tuple[dict[str, Any], ...]:
    value = f.values.get("tools")
    if value is None:
        return ()
    want = (f"a list of at most {MAX_TOOLS} {{'type': 'function', 'function': {{'name', 'description', "
            "'parameters'}}}} maps")
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise f._fail("tools", want)
    for tool in value:
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(function, dict) or tool.get("type", "function") != "function"
                or not isinstance(function.get("name"), str) or not _FUNCTION_NAME.fullmatch(function["name"])
                or not isinstance(function.get("parameters", {}), dict)
                or not isinstance(function.get("description", ""), str) or _json_text(tool) is None):
            raise f._fail("tools", want + " (names: 1-64 letters, digits, '_', '.', '-')")
    return tuple(value)


def _parse_tool_choice(f: _Fields, tools: tuple[dict[str, Any], ...]) -> str:
    value = f.values.get("tool_choice")
    if value is None:
        return "auto"
    if isinstance(value, dict) and isinstance(value.get("function"), dict):
        value = value["function"].get("name")
    names = [t["function"]["name"] for t in tools]
    if not isinstance(value, str) or (value not in TOOL_CHOICES and value not in names):
        raise f._fail("tool_choice", "'none', 'auto', 'required', or {'type': 'function', 'function': "
                      "{'name': one of the tools}}")
    if value == "required" and not tools:
        raise f._fail("tool_choice", "'required' only with tools")
    return value

_MESSAGE_FIELDS = {"system": {"role", "content"}, "user": {"role", "content"},
                   "assistant": {"role", "content", "tool_calls"}, "tool": {"role", "content", "tool_call_id", "name"}}


def _parse_messages(value: Any) -> list[dict[str, Any]]:
    """Chat turns: {role, content}; an assistant turn may carry `tool_calls` (content then may
    be nil), a `tool` turn answers one with `tool_call_id`."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_MESSAGES:
        raise ProtocolError("bad_request", f"generate: 'messages' must be a list of 1-{MAX_MESSAGES} "
                            "{role, content} maps", param="messages")
    messages = []
    for i, m in enumerate(value):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES or not set(m) <= _MESSAGE_FIELDS[role] or "content" not in m:
            raise ProtocolError("bad_request", f"generate: messages[{i}] must be a map with 'role' (one of "
                                f"{', '.join(ROLES)}) and 'content'; assistant turns may add 'tool_calls', "
                                "tool turns 'tool_call_id' and 'name'", param=f"messages.{i}")
        content, calls = m["content"], m.get("tool_calls")
        if not (isinstance(content, str) or (content is None and role == "assistant" and calls)):
            raise ProtocolError("bad_request", f"generate: messages[{i}] needs string content",
                                param=f"messages.{i}.content")
        message: dict[str, Any] = {"role": role, "content": content}
        if calls is not None:
            message["tool_calls"] = _parse_tool_calls(calls, i)
        for key in ("tool_call_id", "name"):
            if key in m:
                if not isinstance(m[key], str) or not 0 < len(m[key]) <= MAX_ID_CHARS:
                    raise ProtocolError("bad_request", f"generate: messages[{i}].{key} must be a string "
                                        f"of 1-{MAX_ID_CHARS} characters", param=f"messages.{i}.{key}")
                message[key] = m[key]
        messages.append(message)
    return messages


def _parse_tool_calls(value: Any, i: int) -> list[dict[str, Any]]:
    want = (f"generate: messages[{i}].tool_calls must be a list of {{'id', 'type': 'function', "
            "'function': {'name', 'arguments': JSON text}} maps")
    param = f"messages.{i}.tool_calls"
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_TOOLS:
        raise ProtocolError("bad_request", want, param=param)
    calls = []
    for c in value:
        function = c.get("function") if isinstance(c, dict) else None
        if (not isinstance(function, dict) or not isinstance(function.get("name"), str)
                or not _FUNCTION_NAME.fullmatch(function["name"])
                or not isinstance(function.get("arguments", "{}"), (str, dict))
                or not isinstance(c.get("id", ""), str) or len(c.get("id", "")) > MAX_ID_CHARS):
            raise ProtocolError("bad_request", want, param=param)
        arguments = function.get("arguments", "{}")
        calls.append({"id": c.get("id", ""), "type": "function",
                      "function": {"name": function["name"],
                                   "arguments": arguments if isinstance(arguments, str) else _json_text(arguments)}})
    return calls


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
class EmbedArgs:
    inputs: tuple[str | list[int], ...]  # texts or token-id lists


def _parse_embed(f: _Fields) -> EmbedArgs:
    value = f.values.get("input")
    want = (f"a string, a list of 1-{MAX_EMBED_INPUTS} strings, a list of token ids, or a list of "
            "token-id lists")
    if isinstance(value, str) or (isinstance(value, list) and value and all(_is_token(t) for t in value)):
        value = [value]
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_EMBED_INPUTS:
        raise f._fail("input", want)
    for item in value:
        ok = (isinstance(item, str) and 0 < len(item) <= 1 << 24) or (
            isinstance(item, list) and 0 < len(item) <= MAX_PROMPT_TOKEN_IDS and all(_is_token(t) for t in item))
        if not ok:
            raise f._fail("input", want + " (none empty)")
    return EmbedArgs(tuple(value))


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31


@dataclass(frozen=True)
class NoArgs:
    pass


@dataclass(frozen=True)
class UserArgs:
    user: str


@dataclass(frozen=True)
class ConsentArgs:
    user: str
    granted: bool | None  # consent to feedback collection; None: leave as it is
    fleet: bool | None = None  # consent to training the shared fleet adapter; None: leave as it is


@dataclass(frozen=True)
class AdaptersListArgs:
    user: str | None = None


@dataclass(frozen=True)
class RollbackArgs:
    user: str
    version: int


@dataclass(frozen=True)
class FleetPublishArgs:
    path: str  # an absolute path, on the daemon's machine, of a PEFT LoRA adapter folder


@dataclass(frozen=True)
class FleetRollbackArgs:
    version: int | None = None  # serve this version again (0: no fleet adapter); None: drop the newest


def _fleet_publish(f: _Fields) -> FleetPublishArgs:
    path = f.text("path", max_chars=4096, required=True, pattern=_ABSOLUTE_PATH,
                  what="the absolute path of a PEFT LoRA adapter folder on the daemon's machine")
    assert path is not None
    return FleetPublishArgs(path)


def _fleet_rollback(f: _Fields) -> FleetRollbackArgs:
    return FleetRollbackArgs(f.integer("version", lo=0, hi=2**31 - 1))


# Adapter tensors on the wire: name -> {"dtype": "float32", "shape": [..], "data": raw
# little-endian bytes (msgpack bin)}; names are PEFT state-dict keys.
MAX_TENSORS = 4096
MAX_TENSOR_NAME_CHARS = 256
TENSOR_DTYPES = {"float32": 4}


@dataclass(frozen=True)
class WireTensor:
    dtype: str
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True)
class FleetLoraConfig:
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]


@dataclass(frozen=True)
class FleetRoundConfig:
    steps: int = 1  # optimizer steps, each over all of the round's training examples
    lr: float = 5e-4
    beta: float = 0.1
    clip: float = 1.0  # L2 bound C of the whole delta
    noise_multiplier: float = 0.0  # sigma: the noise's std is sigma * C
    seed: int = 0  # the order examples are drawn in (never the noise: the server knows it)
    max_pairs: int = 64  # training examples per round at most
    heldout_fraction: float = 0.2  # share of the train split kept for evaluation, by example id


@dataclass(frozen=True)
class FleetRoundArgs:
    round: int
    adapter: dict[str, WireTensor]
    lora_config: FleetLoraConfig
    config: FleetRoundConfig


@dataclass(frozen=True)
class FleetEvaluateArgs:
    adapter: dict[str, WireTensor]
    lora_config: FleetLoraConfig
    heldout_fraction: float | None = None  # None: the daemon's fleet.heldout_fraction
    max_pairs: int | None = None


def _parse_tensors(f: _Fields, name: str) -> dict[str, WireTensor]:
    value = f.values.get(name)
    want = (f"a map of at most {MAX_TENSORS} PEFT tensor names to {{'dtype': 'float32', 'shape': [ints], "
            "'data': raw little-endian bytes (msgpack bin) of that shape}")
    if not isinstance(value, dict) or not 0 < len(value) <= MAX_TENSORS:
        raise f._fail(name, want)
    out: dict[str, WireTensor] = {}
    for key, spec in value.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_TENSOR_NAME_CHARS or not isinstance(spec, dict) \
                or set(spec) != {"dtype", "shape", "data"}:
            raise f._fail(name, want)
        dtype, shape, data = spec["dtype"], spec["shape"], spec["data"]
        if (dtype not in TENSOR_DTYPES or not isinstance(shape, list) or not 1 <= len(shape) <= 4
                or any(not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < 2**31 for n in shape)
                or not isinstance(data, bytes)):
            raise ProtocolError("bad_request", f"{f.op}: tensor {key[:80]!r} must be {{'dtype': 'float32', "
                                "'shape': [1-4 ints], 'data': bytes}", param=f"{name}.{key[:80]}")
        count = math.prod(shape)
        if len(data) != count * TENSOR_DTYPES[dtype]:
            raise ProtocolError("bad_request", f"{f.op}: tensor {key[:80]!r} has {len(data)} bytes of data; shape "
                                f"{shape} in {dtype} needs {count * TENSOR_DTYPES[dtype]}", param=f"{name}.{key[:80]}")
        out[key] = WireTensor(dtype, tuple(shape), data)
    return out


def _parse_lora_config(f: _Fields) -> FleetLoraConfig:
    value = f.values.get("lora_config")
    want = "{'r': int >= 1, 'lora_alpha': number > 0, 'target_modules': [projection names]}"
    if not isinstance(value, dict) or not {"r", "lora_alpha", "target_modules"} <= set(value) or len(value) > 8:
        raise f._fail("lora_config", want)
    rank, alpha, targets = value["r"], value["lora_alpha"], value["target_modules"]
    ok = (isinstance(rank, int) and not isinstance(rank, bool) and 1 <= rank <= 4096
          and isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and math.isfinite(alpha) and alpha > 0
          and isinstance(targets, list) and 0 < len(targets) <= 16
          and all(isinstance(t, str) and 0 < len(t) <= 64 for t in targets))
    if not ok:
        raise f._fail("lora_config", want)
    return FleetLoraConfig(rank, float(alpha), tuple(targets))


def _fleet_round(f: _Fields) -> FleetRoundArgs:
    value = f.values.get("config") or {}
    if not isinstance(value, dict):
        raise f._fail("config", "a map of round settings (steps, lr, beta, clip, noise_multiplier, seed, "
                      "max_pairs, heldout_fraction)")
    unknown = sorted(str(k)[:64] for k in value if k not in _ROUND_CONFIG_FIELDS)
    if unknown:
        raise ProtocolError("bad_request", f"fleet.round: 'config' has no field(s) {', '.join(unknown)}; allowed: "
                            f"{', '.join(sorted(_ROUND_CONFIG_FIELDS))}", param="config")
    c = _Fields("fleet.round config", value)
    d = FleetRoundConfig()
    try:
        config = _round_config(c, d)
    except ProtocolError as exc:
        raise ProtocolError("bad_request", exc.message, param=f"config.{exc.param}") from None
    round_number = f.integer("round", lo=0, hi=2**31 - 1, required=True)
    assert round_number is not None
    return FleetRoundArgs(round_number, _parse_tensors(f, "adapter"), _parse_lora_config(f), config)


def _round_config(c: _Fields, d: FleetRoundConfig) -> FleetRoundConfig:
    return FleetRoundConfig(
        steps=c.integer("steps", lo=1, hi=10_000, default=d.steps),
        lr=c.number("lr", lo=0.0, hi=1.0, default=d.lr, lo_open=True),
        beta=c.number("beta", lo=0.0, hi=100.0, default=d.beta, lo_open=True),
        clip=c.number("clip", lo=0.0, hi=1e6, default=d.clip, lo_open=True),
        noise_multiplier=c.number("noise_multiplier", lo=0.0, hi=1e6, default=d.noise_multiplier),
        seed=c.integer("seed", lo=0, hi=2**63 - 1, default=d.seed),
        max_pairs=c.integer("max_pairs", lo=1, hi=1_000_000, default=d.max_pairs),
        heldout_fraction=c.number("heldout_fraction", lo=0.0, hi=0.95, default=d.heldout_fraction),
    )


def _fleet_evaluate(f: _Fields) -> FleetEvaluateArgs:
    value = f.values.get("config") or {}
    if not isinstance(value, dict) or not set(value) <= {"heldout_fraction", "max_pairs"}:
        raise f._fail("config", "a map with 'heldout_fraction' and/or 'max_pairs'")
    c = _Fields("fleet.evaluate config", value)
    return FleetEvaluateArgs(_parse_tensors(f, "adapter"), _parse_lora_config(f),
                             c.number("heldout_fraction", lo=0.0, hi=0.95),
                             c.integer("max_pairs", lo=1, hi=1_000_000))


_ROUND_CONFIG_FIELDS = frozenset(f.name for f in fields(FleetRoundConfig))


def _user_args(f: _Fields) -> UserArgs:
    return UserArgs(f.user() or "")


def _consent_args(f: _Fields) -> ConsentArgs:
    user = f.user() or ""
    fleet = f.flag("fleet")
    # `granted` alone is the original form; `fleet` alone changes only the fleet consent.
    granted = f.flag("granted", required=fleet is None)
    if granted is False and fleet is True:
        raise f._fail("fleet", "false or absent when withdrawing consent to feedback collection "
                      "(fleet consent needs it)")
    return ConsentArgs(user, granted, fleet)


def _adapters_list(f: _Fields) -> AdaptersListArgs:
    return AdaptersListArgs(f.user(required=False))


def _rollback(f: _Fields) -> RollbackArgs:
    return RollbackArgs(f.user() or "", f.integer("version", lo=0, hi=2**31 - 1, required=True) or 0)


_GENERATE_FIELDS = frozenset({
    "prompt", "messages", "max_tokens", "temperature", "top_k", "top_p", "seed", "n", "stop",
    "stop_token_ids", "ignore_eos", "stream", "user", "record", "adapter", "timeout_s", "logprobs",
    "presence_penalty", "frequency_penalty", "logit_bias", "response_format", "tools", "tool_choice",
    "continue_final_message", "echo"})

_PARSERS: dict[str, tuple[Any, frozenset[str]]] = {
    "generate": (_parse_generate, _GENERATE_FIELDS),
    "cancel": (_parse_cancel, frozenset({"target"})),
    "feedback": (_parse_feedback, frozenset({"user", "interaction_id", "feedback"})),
    "status": (lambda f: NoArgs(), frozenset()),
    "health": (lambda f: NoArgs(), frozenset()),
    "adapters.list": (_adapters_list, frozenset({"user"})),
    "adapters.rollback": (_rollback, frozenset({"user", "version"})),
    "users.consent": (_consent_args, frozenset({"user", "granted", "fleet"})),
    "users.export": (_user_args, frozenset({"user"})),
    "users.forget": (_user_args, frozenset({"user"})),
    "embed": (_parse_embed, frozenset({"input"})),
    "fleet.publish": (_fleet_publish, frozenset({"path"})),
    "fleet.rollback": (_fleet_rollback, frozenset({"version"})),
    "fleet.status": (lambda f: NoArgs(), frozenset()),
    "fleet.round": (_fleet_round, frozenset({"round", "adapter", "lora_config", "config"})),
    "fleet.evaluate": (_fleet_evaluate, frozenset({"adapter", "lora_config", "config"})),
}
assert set(_PARSERS) == set(OPS)
