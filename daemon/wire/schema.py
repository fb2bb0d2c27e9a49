"""The `generate` request, declared once: every field with its type and bounds as msgspec
`Struct`s (docs/protocol.md is their prose), validated once where a request enters (the ZeroMQ
server and the HTTP gateway alike), and handed to the engine as the same object.

Torch-free: msgspec and the standard library. Refusals keep the protocol's texts (`_refusal`).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct, field

from daemon.wire.errors import ProtocolError
from daemon.wire.fields import (
    APP_USER,
    MAX_ID_CHARS,
    MAX_PROMPT_TOKEN_IDS,
    MAX_USER_CHARS,
    internal_user,
)

ROLES = ("system", "user", "assistant", "tool")
MAX_MESSAGES = 1024
MAX_TOOLS = 128
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
MAX_BIAS = 100.0
TOOL_CHOICES = ("none", "auto", "required")
# response_format types: OpenAI's, plus `regex` and `grammar` (a Lark grammar, llguidance's dialect).
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "regex", "grammar")
MAX_GRAMMAR_CHARS = 1 << 18
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOKENS_CAP = 1 << 20  # the engine also stops at its context length; this only bounds input
MAX_N = 16
MAX_PROMPT_CHARS = 1 << 24  # the daemon's `engine.max_prompt_chars` is the real, smaller limit

TokenId = Annotated[int, Meta(ge=0, lt=2**31)]
# \Z, not $: `$` also matches before a trailing newline, and "name\n" is no function's name.
FunctionName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.\-]{1,64}\Z")]  # = edge_runtime.chat
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
IdText = Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS)]


# --- chat messages: a union tagged by `role` ----------------------------------------------------

class FunctionCall(Struct):
    name: FunctionName
    arguments: str | dict[str, Any] = "{}"


class ToolCall(Struct, kw_only=True):  # kw_only: the fields in OpenAI's order
    id: Annotated[str, Meta(max_length=MAX_ID_CHARS)] = ""
    type: str = "function"
    function: FunctionCall


class _Turn(Struct, tag_field="role", forbid_unknown_fields=True, omit_defaults=True):
    def as_dict(self) -> dict[str, Any]:
        turn = msgspec.to_builtins(self)
        for call in turn.get("tool_calls", ()):  # the chat template reads arguments as JSON text
            call["type"] = "function"
            if not isinstance(call["function"]["arguments"], str):
                call["function"]["arguments"] = _json_text(call["function"]["arguments"])
        return turn


class SystemTurn(_Turn, tag="system"):
    content: str


class UserTurn(_Turn, tag="user"):
    content: str


class AssistantTurn(_Turn, tag="assistant"):
    content: str | None  # nil only beside tool_calls
    tool_calls: Annotated[list[ToolCall], Meta(min_length=1, max_length=MAX_TOOLS)] | None = None


class ToolTurn(_Turn, tag="tool"):
    content: str
    tool_call_id: IdText | None = None
    name: IdText | None = None


Turn = SystemTurn | UserTurn | AssistantTurn | ToolTurn


# --- response_format: a union tagged by `type` --------------------------------------------------

class _Format(Struct, tag_field="type"):
    pass


class TextFormat(_Format, tag="text"):
    pass


class JsonObjectFormat(_Format, tag="json_object"):
    pass


class _JsonSchemaSpec(Struct):
    schema: dict[str, Any] | bool
    name: str = ""


class JsonSchemaFormat(_Format, tag="json_schema"):
    json_schema: _JsonSchemaSpec


Grammar = Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS, pattern=r"\S")]  # not blank


class RegexFormat(_Format, tag="regex"):
    regex: Grammar


class GrammarFormat(_Format, tag="grammar"):  # Lark, llguidance's dialect
    grammar: Grammar


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat | RegexFormat | GrammarFormat


class _FunctionSpec(Struct):
    name: FunctionName
    description: str = ""
    parameters: dict[str, Any] = {}


class _Tool(Struct):  # checks a tool; the tool itself travels as sent (the template renders it)
    function: _FunctionSpec
    type: Literal["function"] = "function"


# --- the request --------------------------------------------------------------------------------

class GenerateArgs(Struct, frozen=True, forbid_unknown_fields=True):
    """One generate request, on the wire and in the engine (prompt or chat messages, sampling,
    stops, logprobs, logit bias, response format and tools). Built by `parse_generate` only."""

    text_or_ids: (Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)]
                  | Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)]
                  | None) = field(default=None, name="prompt")
    messages: Annotated[list[Turn], Meta(min_length=1, max_length=MAX_MESSAGES)] | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS_CAP)] | None = None  # None: the daemon's default
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] = 0.0
    top_k: Annotated[int, Meta(ge=0, le=2**31 - 1)] = 0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1 - MAX_N)] | None = None  # candidate i uses seed + i
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    stop: (Annotated[tuple[Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)], ...],
                     Meta(max_length=MAX_STOP_STRINGS)] | str) = ()  # a str is made a 1-tuple
    stop_token_ids: Annotated[tuple[TokenId, ...], Meta(max_length=MAX_STOP_TOKEN_IDS)] = ()
    ignore_eos: bool = False
    stream: bool = False
    user: Annotated[str, Meta(pattern=rf"^(?:{APP_USER.pattern})\Z")] | None = None
    record: bool = True  # store the interaction for feedback when `user` has consented
    adapter: Literal["latest", "base"] | Annotated[int, Meta(ge=0, lt=2**31)] = "latest"
    timeout_s: Annotated[float, Meta(gt=0.0, le=86_400.0)] | None = None
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None  # each token's and the k likeliest
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    bias: (Annotated[dict[Any, Annotated[float, Meta(ge=-MAX_BIAS, le=MAX_BIAS)]], Meta(max_length=MAX_LOGIT_BIAS)]
           | None) = field(default=None, name="logit_bias")  # keys: token ids or their decimal strings
    format: ResponseFormat | None = field(default=None, name="response_format")
    tools: Annotated[tuple[dict[str, Any], ...], Meta(max_length=MAX_TOOLS)] = ()
    tool_choice: str | dict[str, Any] = "auto"  # none, auto, required, or a function's name
    continue_final_message: bool = False
    echo: bool = False  # the result also carries the prompt's text (`prompt_text`)
    thinking: bool | None = None  # a thinking model's think block on or off (None: the model's default)
    speculation: Literal["auto", "on", "off"] = "auto"  # prompt-lookup speculative decoding (docs/speculative.md)

    @property
    def prompt(self) -> str | list[dict[str, Any]] | list[int]:
        """Text, chat messages (as the chat template reads them), or token ids."""
        if self.messages is not None:
            return [m.as_dict() for m in self.messages]
        return self.text_or_ids if self.text_or_ids is not None else ""

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    @property
    def logit_bias(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(t), b) for t, b in (self.bias or {}).items())

    @property
    def response_format(self) -> tuple[str, str] | None:
        """(constraint kind, its text) for the engine (edge_runtime.constraints), or None."""
        f = self.format
        if isinstance(f, JsonSchemaFormat):
            return ("json_schema", _json_text(f.json_schema.schema) or "")
        if isinstance(f, (RegexFormat, GrammarFormat)):
            return ("regex", f.regex) if isinstance(f, RegexFormat) else ("lark", f.grammar)
        return ("json", "") if isinstance(f, JsonObjectFormat) else None

    def sampling_kwargs(self, default_max_tokens: int) -> dict[str, Any]:
        """Keyword arguments of `edge_runtime.sampling.SamplingParams` (without the constraint,
        which the daemon builds from `response_format`): the engine takes them as checked."""
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        return {"max_tokens": max_tokens, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p, "seed": self.seed, "n": self.n, "stop": self.stop,
                "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
                "logprobs": self.logprobs, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "logit_bias": self.logit_bias,
                "speculation": self.speculation}


GENERATE_FIELDS = frozenset(f.encode_name for f in msgspec.structs.fields(GenerateArgs))


def parse_generate(op: str, values: dict[str, Any]) -> GenerateArgs:
    """The request's fields (nil means absent, as everywhere in the protocol), checked against
    the schema, then the rules that tie fields together."""
    values = {k: v for k, v in values.items() if v is not None}
    try:
        args = msgspec.convert(values, GenerateArgs)
    except msgspec.ValidationError as exc:
        raise _refusal(op, values, str(exc)) from None

    def fail(name: str, want: str) -> ProtocolError:
        return _fail(op, values, name, want)

    if (args.text_or_ids is None) == (args.messages is None):
        raise ProtocolError("bad_request", f"{op}: give exactly one of 'prompt' (text) or "
                            "'messages' (chat: a list of {role, content})", param="prompt")
    if isinstance(args.text_or_ids, str) and not args.text_or_ids.strip():
        raise ProtocolError("bad_request", f"{op}: 'prompt' is empty", param="prompt")
    for i, turn in enumerate(args.messages or ()):
        if isinstance(turn, AssistantTurn) and turn.content is None and not turn.tool_calls:
            raise _turn_refusal(op, i, "content")
    names = []
    for tool in args.tools:
        try:
            names.append(msgspec.convert(tool, _Tool).function.name)
            if _json_text(tool) is None:
                raise ValueError(tool)
        except (msgspec.ValidationError, ValueError):
            raise fail("tools", WANT["tools"] + " (names: 1-64 letters, digits, '_', '.', '-')") from None
    choice = args.tool_choice
    if isinstance(choice, dict):
        function = choice.get("function")
        choice = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, str) or (choice not in TOOL_CHOICES and choice not in names):
        raise fail("tool_choice", WANT["tool_choice"])
    if choice == "required" and not names:
        raise fail("tool_choice", "'required' only with tools")
    if (args.tools or args.continue_final_message) and not args.messages:
        raise ProtocolError("bad_request", f"{op}: 'tools' and 'continue_final_message' need 'messages'",
                            param="tools" if args.tools else "continue_final_message")
    if args.continue_final_message and not isinstance(args.messages[-1], AssistantTurn):  # type: ignore[index]
        raise fail("continue_final_message", "true only when the last message is the assistant's")
    for token in (args.bias or {}):
        if isinstance(token, str) and token.isdigit() and len(token) <= 10:
            token = int(token)
        if type(token) is not int or not 0 <= token < 2**31:
            raise fail("logit_bias", WANT["logit_bias"])
    if isinstance(args.format, JsonSchemaFormat):
        text = _json_text(args.format.json_schema.schema)
        if text is None or len(text) > MAX_GRAMMAR_CHARS:
            raise fail("response_format", f"a JSON schema of at most {MAX_GRAMMAR_CHARS} characters")
    if args.thinking is not None and args.messages is None:
        raise ProtocolError("bad_request", f"{op}: 'thinking' needs 'messages' (the chat template "
                            "turns it on or off)", param="thinking")
    if args.adapter not in ("latest", "base") and args.user is None:
        raise ProtocolError("bad_request", f"{op}: an adapter version needs 'user'", param="adapter")
    return msgspec.structs.replace(
        args, stop=(args.stop,) if isinstance(args.stop, str) else args.stop, tool_choice=choice,
        user=None if args.user is None else internal_user(args.user))


# --- refusals: the protocol's texts for what the schema refused ---------------------------------

def _bounds_want(name: str) -> str:
    """'an integer in [lo, hi]' or 'a number in (lo, hi]', read off the schema's own bounds."""
    info = next(f for f in msgspec.inspect.type_info(GenerateArgs).fields if f.encode_name == name)  # type: ignore[attr-defined]
    kinds = [t for t in getattr(info.type, "types", (info.type,)) if not isinstance(t, msgspec.inspect.NoneType)]
    t = kinds[0]
    if isinstance(t, msgspec.inspect.IntType):
        return f"an integer in [{t.ge}, {t.le if t.le is not None else t.lt - 1}]"
    lo = t.ge if t.ge is not None else t.gt
    return f"a number in {'[' if t.ge is not None else '('}{lo}, {t.le}]"


WANT: dict[str, str] = {
    **{name: _bounds_want(name) for name in ("max_tokens", "top_k", "seed", "n", "logprobs", "temperature",
                                             "top_p", "timeout_s", "presence_penalty", "frequency_penalty")},
    **{name: "true or false" for name in ("ignore_eos", "stream", "record", "continue_final_message", "echo",
                                                    "thinking")},
    "prompt": "a string, or a non-empty list of token ids",
    "stop": f"a string or a list of at most {MAX_STOP_STRINGS} strings",
    "stop_token_ids": f"a list of at most {MAX_STOP_TOKEN_IDS} token ids",
    "user": f"a user: 1-{MAX_USER_CHARS} printable characters (an app's own id)",
    "adapter": "'latest', 'base' or a version number >= 0",
    "speculation": "'auto', 'on' or 'off'",
    "logit_bias": f"a map of at most {MAX_LOGIT_BIAS} token ids (integers, or their decimal strings) to "
                  f"numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}]",
    "response_format": "a map with 'type' one of " + ", ".join(RESPONSE_FORMATS),
    "tools": f"a list of at most {MAX_TOOLS} {{'type': 'function', 'function': {{'name', 'description', "
             "'parameters'}}}} maps",
    "tool_choice": "'none', 'auto', 'required', or {'type': 'function', 'function': {'name': one of the tools}}",
}
_WHERE = re.compile(r" - at `\$(?P<path>.*)`$")


def _json_text(value: Any) -> str | None:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return None


def _pattern_want(key: str) -> str:
    return f"{{'type': '{key}', '{key}': a non-empty string of at most {MAX_GRAMMAR_CHARS} characters}}"


def _fail(op: str, values: dict[str, Any], name: str, want: str) -> ProtocolError:
    got = values.get(name)
    shown = repr(got) if isinstance(got, (int, float, bool)) or got is None else type(got).__name__
    return ProtocolError("bad_request", f"{op}: '{name}' must be {want}; got {shown}", param=name)


_TURN_WANT = {
    "": f"must be a map with 'role' (one of {', '.join(ROLES)}) and 'content'; assistant turns may add "
        "'tool_calls', tool turns 'tool_call_id' and 'name'",
    "content": "needs string content",
    "tool_calls": "must be a list of {'id', 'type': 'function', 'function': {'name', 'arguments': JSON text}} maps",
    "tool_call_id": f"must be a string of 1-{MAX_ID_CHARS} characters",
    "name": f"must be a string of 1-{MAX_ID_CHARS} characters",
}


def _turn_refusal(op: str, i: int, key: str) -> ProtocolError:
    key = key if key in _TURN_WANT else ""  # the role, or a field the role does not have
    where = f"messages[{i}]" + (f".{key}" if key not in ("", "content") else "")
    return ProtocolError("bad_request", f"{op}: {where} {_TURN_WANT[key]}", param=f"messages.{i}" + (f".{key}" if key else ""))


def _refusal(op: str, values: dict[str, Any], error: str) -> ProtocolError:
    """The schema's refusal (msgspec: "Expected ... - at `$.messages[2].content`") as the
    protocol words it: the field as the client named it, and what it must be."""
    match = _WHERE.search(error)
    path = re.findall(r"\.(\w+)|\[(\d+)\]", match["path"]) if match else []
    parts = [name or int(index) for name, index in path]
    name = str(parts[0]) if parts else "prompt"
    if name == "messages" and len(parts) > 1:
        return _turn_refusal(op, int(parts[1]), str(parts[2]) if len(parts) > 2 else "")
    if name == "messages":
        return ProtocolError("bad_request", f"{op}: 'messages' must be a list of 1-{MAX_MESSAGES} "
                             "{role, content} maps", param="messages")
    want = WANT.get(name, "as docs/protocol.md describes")
    if name == "stop" and len(parts) > 1:
        want = f"non-empty strings of at most {MAX_STOP_CHARS} characters"
    elif name == "tools" and len(parts) > 1:
        want += " (names: 1-64 letters, digits, '_', '.', '-')"
    elif name == "response_format" and parts[1:2] != ["type"]:  # the type is known: what it needs
        kind = values[name].get("type") if isinstance(values[name], dict) else None
        if kind in ("regex", "grammar"):
            want = _pattern_want(kind)
        elif kind == "json_schema":
            want = "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}"
    return _fail(op, values, name, want)
