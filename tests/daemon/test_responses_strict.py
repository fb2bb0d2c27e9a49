"""Every reply shape of `/v1/responses` (and chat's usage) read by the installed `openai`
package's own pydantic types in strict mode: no required field missing, no value of the wrong
type, no enum value the client does not know. Built without a daemon from the reply builders;
tests/daemon/test_responses.py reads real replies the same way."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types import CompletionUsage
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from daemon.fronts.http.errors import GatewayError
from daemon.fronts.http.replies import _usage
from daemon.fronts.http.responses_api import _echo
from daemon.fronts.http.responses_models import ResponsesRequest
from daemon.fronts.http.responses_replies import ResponseReply

EVENTS = TypeAdapter(ResponseStreamEvent)
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}
BODIES = [
    {"model": "m", "input": "hi"},
    {"model": "m", "input": "hi", "instructions": "be brief", "max_output_tokens": 5, "temperature": 0.5,
     "top_p": 0.9, "metadata": {"k": "v"}, "user": "u", "store": False, "reasoning": {"effort": "high"},
     "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
     "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
     "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}}},
    {"model": "m", "input": "hi", "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
]
USAGE = {"prompt_tokens": 40, "completion_tokens": 9, "cached_prompt_tokens": 32, "cache_write_tokens": 0,
         "reasoning_tokens": 4}


def strict_response(value: dict[str, Any]) -> Response:
    return Response.model_validate(value, strict=True)


def strict_event(value: dict[str, Any]) -> Any:
    return EVENTS.validate_python(value, strict=True)


def _result(text: str, reasoning: str | None, calls: list | None, finish: str) -> dict[str, Any]:
    return {"interaction_id": "ix-1", "adapter": None, "recorded": False, "timing": {"ttft_s": 0.1},
            "usage": USAGE, "candidates": [{"index": 0, "text": text, "tool_calls": calls,
                                            "finish_reason": finish, "reasoning": reasoning}]}


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize(("text", "reasoning", "calls", "finish"), [
    ("hello", None, None, "stop"),
    ("hel", None, None, "length"),
    ("", "hmm", None, "length"),  # cut inside the thinking
    ("ok", "hmm", [CALL], "tool_calls"),
    ("", None, [CALL, dict(CALL, id="call_2")], "tool_calls"),
])
def test_whole_and_streamed_replies_validate_strictly(body: dict, text: str, reasoning: str | None,
                                                      calls: list | None, finish: str) -> None:
    echo = _echo(ResponsesRequest(**body))
    result = _result(text, reasoning, calls, finish)
    reply = ResponseReply("m", echo)
    whole = strict_response(reply.whole(result))
    assert whole.usage.input_tokens_details.cached_tokens == 32
    assert whole.usage.output_tokens_details.reasoning_tokens == 4
    streamed = ResponseReply("m", echo)
    streamed.id = "ix-1"
    events = [*streamed.opening()]
    if reasoning:
        events += streamed.delta("", {"reasoning": reasoning})
    if text:
        events += streamed.delta(text, None)
    for call in calls or ():
        events += streamed.delta("", {"tool_calls": [call]})
    events += streamed.finals(result)
    parsed = [strict_event(e) for e in events]
    assert parsed[-1].response.output == whole.output


def test_a_failed_stream_validates_strictly_with_a_code_the_client_knows() -> None:
    for code, expected in (("shutting_down", "server_error"), ("busy", "rate_limit_exceeded"),
                           ("bad_request", "invalid_prompt"), ("internal", "server_error")):
        reply = ResponseReply("m", _echo(ResponsesRequest(model="m", input="hi")))
        reply.id = "ix-1"
        events = [*reply.opening(), *reply.delta("a", None), *reply.failed(GatewayError(code, "why", param="x"))]
        parsed = [strict_event(e) for e in events]
        assert parsed[-2].code == code  # the error event keeps the daemon's own code
        assert parsed[-1].response.error.code == expected and parsed[-1].response.error.type == code


def test_chat_usage_validates_strictly_with_its_details() -> None:
    usage = CompletionUsage.model_validate(_usage([{"usage": USAGE}, {"usage": USAGE}]), strict=True)
    assert usage.prompt_tokens_details.cached_tokens == 64 and usage.prompt_tokens_details.cache_write_tokens == 0
    assert usage.completion_tokens_details.reasoning_tokens == 8 and usage.total_tokens == 98
