"""The `generate` op's arguments: prompt or chat messages, sampling, stops, logprobs, logit bias,
response format and tools, with their bounds, and their validation from a request's fields.

Pure standard library.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from daemon.wire.errors import ProtocolError
from daemon.wire.fields import MAX_ID_CHARS, MAX_PROMPT_TOKEN_IDS, Fields

ROLES = ("system", "user", "assistant", "tool")
MAX_MESSAGES = 1024
MAX_TOOLS = 128
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024
TOOL_CHOICES = ("none", "auto", "required")
# response_format types: OpenAI's, plus `regex` and `grammar` (a Lark grammar, llguidance's dialect).
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "regex", "grammar")
MAX_GRAMMAR_CHARS = 1 << 18
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOKENS_CAP = 1 << 20  # the engine also stops at its context length; this only bounds input
MAX_N = 16
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # = edge_runtime.chat


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
    thinking: bool | None = None  # a thinking model's think block on or off (None: the model's default)

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


def parse_generate(f: Fields) -> GenerateArgs:
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
        thinking=_parse_thinking(f, has_messages),
    )


def _parse_thinking(f: Fields, chat: bool) -> bool | None:
    value = f.flag("thinking")
    if value is not None and not chat:
        raise ProtocolError("bad_request", "generate: 'thinking' needs 'messages' (the chat template "
                            "turns it on or off)", param="thinking")
    return value


def _parse_logit_bias(f: Fields) -> tuple[tuple[int, float], ...]:
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


def _parse_response_format(f: Fields) -> tuple[str, str] | None:
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


def _parse_tools(f: Fields) -> tuple[dict[str, Any], ...]:
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


def _parse_tool_choice(f: Fields, tools: tuple[dict[str, Any], ...]) -> str:
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


GENERATE_FIELDS = frozenset({
    "prompt", "messages", "max_tokens", "temperature", "top_k", "top_p", "seed", "n", "stop",
    "stop_token_ids", "ignore_eos", "stream", "user", "record", "adapter", "timeout_s", "logprobs",
    "presence_penalty", "frequency_penalty", "logit_bias", "response_format", "tools", "tool_choice",
    "continue_final_message", "echo", "thinking"})
