"""Chat prompts beyond plain turns, and tool calls.

Owns: tool definitions rendered into the prompt the way the model's own chat template does it
(or, for a template that knows no tools, in the `<tool_call>` convention of Hermes-style models,
described in a system message), assistant tool calls and tool results in the history, a final
assistant message continued instead of closed, thinking turned on or off (edge_runtime.reasoning
knows the templates that can), the grammar of a call the client forces, and the
calls parsed back out of an answer (whole, or as the text streams). Knows nothing of sampling or
of the wire protocols.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from edge_runtime.constraints import JSON_WHITESPACE, Constraint
from edge_runtime.errors import BadRequest
from edge_runtime.reasoning import template_style

if TYPE_CHECKING:
    from edge_runtime.model.tokenizer import Tokenizer

ToolStyle = Literal["hermes", "json"]
ChatMessages = Sequence[dict[str, Any]]
MAX_TOOLS = 128
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


@dataclass(frozen=True)
class ToolCall:
    """One function call the model made: `arguments` is JSON text (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ChatPrompt:
    """Messages (OpenAI's shapes: `tool_calls` on assistant turns, `tool` turns with
    `tool_call_id`), the functions the model may call, which of them it must call
    (`tool_choice`: "auto", "none", "required" or a function's name) and whether the last
    assistant message is continued (a prefill) instead of closed. `thinking` turns a thinking
    model's think block on or off (None: the template's default; ignored by templates without
    the switch)."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str = "auto"
    continue_final: bool = False
    thinking: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", tuple(self.messages))
        object.__setattr__(self, "tools", tuple(self.tools))
        if len(self.tools) > MAX_TOOLS:
            raise BadRequest(f"at most {MAX_TOOLS} tools", param="tools")
        names = [function_of(t)["name"] for t in self.tools]
        if len(set(names)) != len(names):
            raise BadRequest("two tools have the same name", param="tools")
        if self.tool_choice not in ("auto", "none", "required") and self.tool_choice not in names:
            raise BadRequest(f"tool_choice names {self.tool_choice!r}, which is not one of the tools",
                             param="tool_choice")
        if self.tool_choice == "required" and not self.tools:
            raise BadRequest("tool_choice 'required' needs tools", param="tool_choice")
        if self.continue_final and (not self.messages or self.messages[-1].get("role") != "assistant"):
            raise BadRequest("continue_final_message needs an assistant message last", param="continue_final_message")

    @property
    def offers_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def function_of(tool: Any) -> dict[str, Any]:
    """The `function` of an OpenAI tool entry, checked: a name, a description, JSON-schema
    parameters."""
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not _FUNCTION_NAME.fullmatch(function["name"]):
        raise BadRequest("each tool must be {'type': 'function', 'function': {'name': 1-64 letters, digits, "
                         "'_', '.', '-', 'description': ..., 'parameters': a JSON schema}}", param="tools")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise BadRequest(f"tool {function['name']!r}: 'parameters' must be a JSON schema object", param="tools")
    description = function.get("description", "")
    if not isinstance(description, str):
        raise BadRequest(f"tool {function['name']!r}: 'description' must be a string", param="tools")
    return {"name": function["name"], "description": description, "parameters": parameters}


# -- what the chat template can do ---------------------------------------------------------------


def template_tool_style(template: str | None) -> tuple[bool, ToolStyle]:
    """(whether the template renders `tools` itself, the call format its model writes): models
    whose template mentions `<tool_call>` (Qwen 2.5/3, SmolLM3, Hermes) or knows no tools at all
    write Hermes's tagged JSON; Llama 3.x's templates ask for a bare JSON object."""
    text = template or ""
    native = "tools" in text
    if native and CALL_OPEN not in text and ("<|python_tag|>" in text or '"parameters"' in text):
        return True, "json"
    return native, "hermes"


def _system_tools_text(tools: Sequence[dict[str, Any]]) -> str:
    specs = "\n".join(json.dumps({"type": "function", "function": function_of(t)}, ensure_ascii=False)
                      for t in tools)
    return ("You may call functions to answer. The functions, as JSON schemas:\n<tools>\n" + specs
            + "\n</tools>\nTo call one, answer with a JSON object in a block of its own, one block per call:\n"
            + CALL_OPEN + '\n{"name": <function name>, "arguments": <the arguments as a JSON object>}\n'
            + CALL_CLOSE + "\nThe results come back in <tool_response> blocks.")


def _arguments_value(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def template_messages(prompt: ChatPrompt, native: bool) -> list[dict[str, Any]]:
    """The messages as the template gets them. A template with tool support gets OpenAI's shapes
    (arguments as objects, as transformers' templates expect); one without gets the calls
    written into the assistant's text and the results in `<tool_response>` blocks, plus a system
    message that describes the tools."""
    out: list[dict[str, Any]] = []
    for m in prompt.messages:
        role, content = m["role"], m.get("content") or ""
        calls = m.get("tool_calls") or []
        if role == "assistant" and calls:
            if native:
                out.append({"role": "assistant", "content": content, "tool_calls": [
                    {"id": c.get("id", ""), "type": "function",
                     "function": {"name": c["function"]["name"],
                                  "arguments": _arguments_value(c["function"].get("arguments", {}))}}
                    for c in calls]})
            else:
                blocks = [f"{CALL_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                        "arguments": _arguments_value(c["function"].get("arguments", {}))},
                                                       ensure_ascii=False) + f"\n{CALL_CLOSE}" for c in calls]
                out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + blocks)})
        elif role == "tool":
            if native:
                entry = {"role": "tool", "content": content}
                if m.get("tool_call_id"):
                    entry["tool_call_id"] = m["tool_call_id"]
                if m.get("name"):
                    entry["name"] = m["name"]
                out.append(entry)
            else:
                out.append({"role": "tool", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if prompt.offers_tools and not native:
        text = _system_tools_text(prompt.tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def render(hf_tokenizer: Any, prompt: ChatPrompt) -> str:
    """The prompt text through the model's chat template (raises BadRequest if the template
    refuses the conversation)."""
    template = getattr(hf_tokenizer, "chat_template", None)
    if not template:
        raise BadRequest("this model has no chat template; send a plain prompt instead")
    native, _ = template_tool_style(template if isinstance(template, str) else None)
    kwargs: dict[str, Any] = {"tokenize": False}
    if prompt.continue_final:
        kwargs["continue_final_message"] = True
    else:
        kwargs["add_generation_prompt"] = True
    style = template_style(template if isinstance(template, str) else None)
    if prompt.thinking is not None and style is not None:
        kwargs[style.switch] = prompt.thinking
    if prompt.offers_tools and native:
        kwargs["tools"] = [{"type": "function", "function": function_of(t)} for t in prompt.tools]
    messages = template_messages(prompt, native)
    try:
        return hf_tokenizer.apply_chat_template(messages, **kwargs)
    except Exception:  # noqa: BLE001 - jinja raises what the template author chose
        if not native and any(m["role"] == "tool" for m in messages):
            # Templates that only alternate user and assistant: the results as the user's turn.
            messages = [{"role": "user", "content": m["content"]} if m["role"] == "tool" else m for m in messages]
            try:
                return hf_tokenizer.apply_chat_template(messages, **kwargs)
            except Exception as again:  # noqa: BLE001
                exc = again
        raise BadRequest(f"the model's chat template refused these messages: {exc}", param="messages") from None


def render_messages(hf_tokenizer: Any, messages: ChatMessages) -> str:
    """Plain turns (dicts with string `role` and `content`) through the model's chat template,
    ready for the assistant's answer."""
    if not messages:
        raise BadRequest("chat messages must not be empty")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRequest("each chat message must be a dict with string 'role' and 'content'")
    if not getattr(hf_tokenizer, "chat_template", None):
        raise BadRequest("this model has no chat template; send a plain prompt instead")
    return hf_tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)


def encode_prompt(tokenizer: Tokenizer, prompt: str | ChatMessages | ChatPrompt | Sequence[int]) -> tuple[str, list[int]]:
    """The prompt's text (a conversation rendered through the chat template) and its token ids.
    A list of ints is taken as the token ids themselves (checked against the vocabulary)."""
    if isinstance(prompt, str):
        text = prompt
        ids = tokenizer.encode(text)
    elif isinstance(prompt, ChatPrompt):
        text = render(tokenizer.hf, prompt)
        ids = tokenizer.encode(text, special_tokens=False)
    elif isinstance(prompt, (list, tuple)) and prompt and all(type(t) is int for t in prompt):
        ids = tokenizer.checked_ids(prompt)
        text = tokenizer.text_of(ids)
    elif isinstance(prompt, (list, tuple)):
        text = render_messages(tokenizer.hf, prompt)
        # The template already placed every special token it wants.
        ids = tokenizer.encode(text, special_tokens=False)
    else:
        raise BadRequest(f"prompt must be a string, chat messages or token ids, got {type(prompt).__name__}")
    if not ids:
        raise BadRequest("prompt is empty")
    return text, ids


def tool_style(tokenizer: Tokenizer) -> ToolStyle:
    """How the tokenizer's model writes a tool call (see template_tool_style)."""
    return template_tool_style(tokenizer.chat_template)[1]


# -- forcing and parsing calls -------------------------------------------------------------------


def _call_schema(function: dict[str, Any], style: ToolStyle) -> dict[str, Any]:
    key = "parameters" if style == "json" else "arguments"
    return {"type": "object", "properties": {"name": {"const": function["name"]}, key: function["parameters"]},
            "required": ["name", key], "additionalProperties": False}


def forced_call_constraint(prompt: ChatPrompt, style: ToolStyle) -> Constraint | None:
    """The grammar of the answer when the client forces a call (`required`: any one of the
    tools; a name: that one), in the model's call format; None when nothing is forced."""
    if not prompt.tools or prompt.tool_choice in ("auto", "none"):
        return None
    functions = [function_of(t) for t in prompt.tools]
    if prompt.tool_choice != "required":
        functions = [f for f in functions if f["name"] == prompt.tool_choice]
    schema = {"anyOf": [_call_schema(f, style) for f in functions]} if len(functions) > 1 \
        else _call_schema(functions[0], style)
    if style == "json":
        return Constraint("json_schema", json.dumps(schema))
    # Inside Lark, %json takes its options from the schema's "x-guidance" (the JSON constraint's
    # bounded whitespace, as constraints.py sets for the other JSON kinds).
    schema["x-guidance"] = {"whitespace_pattern": JSON_WHITESPACE}
    return Constraint("lark", f'start: "{CALL_OPEN}\\n" call "\\n{CALL_CLOSE}"\ncall: %json ' + json.dumps(schema))


def _as_call(obj: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def parse_calls(text: str, tools: Sequence[dict[str, Any]], style: ToolStyle) -> tuple[str, list[ToolCall]]:
    """(the answer's content without its calls, the calls), for the functions offered. Text
    that looks like a call but names no offered function or is not JSON stays content."""
    names = {function_of(t)["name"] for t in tools}
    if style == "json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        try:
            call = _as_call(json.loads(body), names) if body.startswith("{") else None
        except ValueError:
            call = None
        return ("", [call]) if call is not None else (text, [])
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for match in _HERMES_CALL.finditer(text):
        try:
            call = _as_call(json.loads(match.group(1)), names)
        except ValueError:
            call = None
        if call is None:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    return ("".join(kept).strip() if calls else text), calls


class CallStreamer:
    """Splits streamed text into content to show now and tool calls as they complete (Hermes
    style): text that could still turn into `<tool_call>` is held back, a call's JSON is
    buffered until its closing tag. `feed()` and `finish()` return events: ("content", text) or
    ("call", ToolCall)."""

    def __init__(self, tools: Sequence[dict[str, Any]], style: ToolStyle) -> None:
        self.tools = tools
        self.style = style
        self.buffer = ""
        self.in_call = False

    def feed(self, text: str) -> list[tuple[str, Any]]:
        if self.style == "json":  # a bare JSON answer is a call or content only once complete
            self.buffer += text
            return []
        self.buffer += text
        events: list[tuple[str, Any]] = []
        while True:
            if self.in_call:
                end = self.buffer.find(CALL_CLOSE)
                if end < 0:
                    return events
                block, self.buffer = self.buffer[: end + len(CALL_CLOSE)], self.buffer[end + len(CALL_CLOSE):]
                self.in_call = False
                events += self._block(CALL_OPEN + block)
                continue
            start = self.buffer.find(CALL_OPEN)
            if start >= 0:
                if start:
                    events.append(("content", self.buffer[:start]))
                self.buffer = self.buffer[start + len(CALL_OPEN):]
                self.in_call = True
                continue
            keep = _partial_suffix(self.buffer, CALL_OPEN)
            if len(self.buffer) > keep:
                events.append(("content", self.buffer[: len(self.buffer) - keep]))
                self.buffer = self.buffer[len(self.buffer) - keep:]
            return events

    def finish(self) -> list[tuple[str, Any]]:
        rest, self.buffer = self.buffer, ""
        if self.style == "json":
            content, calls = parse_calls(rest, self.tools, "json")
            return [("call", c) for c in calls] or ([("content", content)] if content else [])
        if self.in_call:
            self.in_call = False
            return self._block(CALL_OPEN + rest)
        return [("content", rest)] if rest else []

    def _block(self, block: str) -> list[tuple[str, Any]]:
        content, calls = parse_calls(block, self.tools, "hermes")
        return [("call", c) for c in calls] if calls else [("content", content)]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
