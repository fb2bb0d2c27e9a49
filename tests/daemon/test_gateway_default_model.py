"""The official `openai` client against a real `maced` serving the default model: a tool-call
round trip (the model calls, the client answers with a `tool` message, the model answers),
whole and streamed, with every object checked as the client parses it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageToolCall  # noqa: E402
from openai.types.chat.chat_completion_chunk import ChoiceDeltaToolCall  # noqa: E402

from tests.daemon.conftest import DaemonProcess, free_tcp_port
from tests.daemon.test_gateway import KEY, Gateway

WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
                      "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                            "parameters": WEATHER_PARAMETERS}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
RESULT = '{"temperature": 18, "unit": "celsius", "sky": "sunny"}'


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Gateway]:
    port = free_tcp_port()
    daemon = DaemonProcess(tmp_path_factory.mktemp("gateway-default"), default_model_dir,
                           engine_flags=["--set", "engine.num_threads=1"],
                           extra_args=["--http", f"127.0.0.1:{port}", "--set", "finetune.enabled=false"],
                           env={"MACE_HTTP_API_KEYS": KEY})
    daemon.wait_ready(timeout_s=300)
    yield Gateway(daemon, port, KEY)
    code, _ = daemon.stop()
    assert code == 0, daemon.log()


def _check_call(call_id: str, name: str, arguments: str) -> dict:
    assert call_id.startswith("call_") and len(call_id) > len("call_")
    assert name == "get_weather"
    parsed = json.loads(arguments)
    jsonschema.validate(parsed, WEATHER_PARAMETERS)
    return parsed


def _called_whole(client) -> list[dict]:
    reply = client.chat.completions.create(
        model="default", messages=ASK, tools=[WEATHER, TIME], max_tokens=96, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert isinstance(reply, ChatCompletion) and reply.object == "chat.completion"
    [choice] = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.index == 0
    assert choice.message.role == "assistant" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert isinstance(call, ChatCompletionMessageToolCall) and call.type == "function"
    _check_call(call.id, call.function.name, call.function.arguments)
    assert reply.usage.completion_tokens > 0
    return [call.model_dump(exclude_none=True)]


def _called_streamed(client) -> list[dict]:
    stream = client.chat.completions.create(
        model="default", messages=ASK, tools=[WEATHER, TIME], max_tokens=96, temperature=0,
        tool_choice="required", stream=True, stream_options={"include_usage": True})
    calls: dict[int, dict] = {}
    roles, finishes, usage = [], [], None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            assert choice.index == 0 and not choice.delta.content  # the call never streams as text
            roles += [choice.delta.role] if choice.delta.role else []
            finishes += [choice.finish_reason] if choice.finish_reason else []
            for delta in choice.delta.tool_calls or []:
                assert isinstance(delta, ChoiceDeltaToolCall)
                entry = calls.setdefault(delta.index, {"id": "", "type": "function",
                                                       "function": {"name": "", "arguments": ""}})
                entry["id"] += delta.id or ""
                entry["function"]["name"] += delta.function.name or ""
                entry["function"]["arguments"] += delta.function.arguments or ""
    assert roles == ["assistant"] and finishes == ["tool_calls"]
    assert usage is not None and usage.completion_tokens > 0
    assert list(calls) == [0]
    _check_call(calls[0]["id"], calls[0]["function"]["name"], calls[0]["function"]["arguments"])
    return [calls[0]]


def _answer(client, tool_calls: list[dict], stream: bool) -> str:
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": tool_calls},
               {"role": "tool", "tool_call_id": tool_calls[0]["id"], "content": RESULT}]
    kwargs = dict(model="default", messages=history, tools=[WEATHER, TIME], tool_choice="none",
                  max_tokens=48, temperature=0)
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        [choice] = reply.choices
        assert choice.message.role == "assistant" and choice.message.tool_calls is None
        assert choice.finish_reason in ("stop", "length")
        return choice.message.content
    text, finishes = "", []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            assert not choice.delta.tool_calls
            text += choice.delta.content or ""
            finishes += [choice.finish_reason] if choice.finish_reason else []
    assert len(finishes) == 1 and finishes[0] in ("stop", "length")
    return text


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_tool_call_round_trip_on_the_default_model_whole_and_streamed(gw: Gateway) -> None:
    client = gw.openai().with_options(timeout=300)
    whole_calls = _called_whole(client)
    streamed_calls = _called_streamed(client)
    # Greedy, and the same function forced either way: the same call, each with its own id.
    assert whole_calls[0]["function"] == streamed_calls[0]["function"]
    assert whole_calls[0]["id"] != streamed_calls[0]["id"]
    whole = _answer(client, whole_calls, stream=False)
    streamed = _answer(client, streamed_calls, stream=True)
    assert whole.strip() and not whole.lstrip().startswith("<tool_call>")
    assert streamed == whole  # the ids are not part of what the model reads
    assert "18" in whole, whole  # the answer is the tool's result, read back
