"""`/v1/responses` without a daemon: Responses shapes onto chat's (input items, tools,
tool_choice, text.format), and the bounded per-principal store of responses."""

from __future__ import annotations

import pytest

from daemon.fronts.http.errors import GatewayError
from daemon.fronts.http.responses_api import (
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    input_messages,
)
from daemon.fronts.http.responses_replies import ResponseReply, assistant_turn
from daemon.fronts.http.responses_store import ResponseStore
from daemon.principals import Principal

A, B = Principal("app", "a"), Principal("app", "b")


def test_input_items_become_chat_turns() -> None:
    assert input_messages("hi", []) == [{"role": "user", "content": "hi"}]
    items = [{"role": "developer", "content": "be brief"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                              {"type": "input_text", "text": "b"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "let me look", "annotations": []}]},
             {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}", "id": "fc_1"},
             {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{\"x\": 1}"},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call_output", "call_id": "call_1", "output": "one"},
             {"type": "function_call_output", "call_id": "call_9", "output": [{"type": "input_text", "text": "x"}]}]
    assert input_messages(items, []) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "let me look", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "one", "name": "f"},
        {"role": "tool", "tool_call_id": "call_9", "content": "x"}]
    # A call made in an earlier (stored) response names the tool turn that answers it.
    history = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_7", "type": "function", "function": {"name": "h", "arguments": "{}"}}]}]
    assert input_messages([{"type": "function_call_output", "call_id": "call_7", "output": "ok"}], history) == [
        {"role": "tool", "tool_call_id": "call_7", "content": "ok", "name": "h"}]


@pytest.mark.parametrize(("items", "param"), [
    ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "input.0.content.0"),
    ([{"role": "tool", "content": "x"}], "input.0.role"),
    ([{"type": "function_call", "call_id": "c", "name": "f"}], "input.0.arguments"),
    ([{"type": "web_search_call", "id": "ws"}], "input.0.type"),
    ([], "input"),
])
def test_input_items_this_server_cannot_read_are_named(items: list, param: str) -> None:
    with pytest.raises(GatewayError) as info:
        input_messages(items, [])
    assert info.value.code == "bad_request" and info.value.param == param


def test_tools_choice_and_format_in_chat_shape() -> None:
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}
    assert chat_tools([tool]) == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert chat_tool_choice({"type": "function", "name": "f"}) == {"type": "function", "function": {"name": "f"}}
    assert chat_tool_choice("required") == "required"
    fmt = {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}
    assert chat_response_format({"format": fmt}) == {"type": "json_schema", "json_schema": {
        "name": "w", "schema": {"type": "object"}, "strict": True}}
    assert chat_response_format({"format": {"type": "text"}}) == {"type": "text"}
    assert chat_response_format(None) is None
    with pytest.raises(GatewayError):
        chat_tools([{"type": "file_search"}])
    with pytest.raises(GatewayError):
        chat_tool_choice({"type": "allowed_tools", "tools": []})


def _result(text: str, calls: list | None = None, finish: str = "stop") -> dict:
    return {"interaction_id": "ix-1", "adapter": None, "recorded": False,
            "usage": {"prompt_tokens": 5, "completion_tokens": 3},
            "candidates": [{"index": 0, "text": text, "tool_calls": calls, "finish_reason": finish}]}


def test_streamed_events_build_the_same_output_as_the_whole_reply() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}
    whole = ResponseReply("m", {}).whole(_result("ok ", [call], "tool_calls"))
    streamed = ResponseReply("m", {})
    streamed.id = "ix-1"
    events = [*streamed.opening(), *streamed.delta("ok", None), *streamed.delta(" ", {"tool_calls": [call]}),
              *streamed.finals(_result("ok ", [call], "tool_calls"))]
    assert events[-1]["response"]["output"] == whole["output"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert assistant_turn(whole["output"]) == {"role": "assistant", "content": "ok ", "tool_calls": [call]}
    empty = ResponseReply("m", {})
    empty.id = "ix-2"
    finals = list(empty.finals(_result("", finish="length")))
    assert finals[-1]["type"] == "response.incomplete"
    assert finals[-1]["response"]["output"][0]["content"][0]["text"] == ""


def test_an_error_after_the_first_token_is_an_error_event_then_response_failed() -> None:
    reply = ResponseReply("m", {})
    reply.id = "ix-3"
    events = [*reply.opening(), *reply.delta("a", None),
              *reply.failed(GatewayError("shutting_down", "the daemon is stopping"))]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "shutting_down" and events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"]["type"] == "shutting_down" and events[-1]["response"]["id"] == "ix-3"


def test_the_store_is_per_principal_and_user_and_bounded() -> None:
    now = [0.0]
    store = ResponseStore(max_responses=3, max_bytes=10_000, max_age_s=60.0, clock=lambda: now[0])
    turns = [{"role": "user", "content": "x"}]
    store.put(A, "alice", "r1", turns, {"id": "r1"})
    assert store.get(A, "alice", "r1") is not None and store.get(A, None, "r1") is not None
    assert store.get(B, "alice", "r1") is None and store.get(A, "bob", "r1") is None
    for rid in ("r2", "r3", "r4"):
        store.put(A, "alice", rid, turns, {"id": rid})
    assert store.get(A, None, "r1") is None and store.count() == 3  # the oldest went first
    store.put(A, "alice", "big", [{"role": "user", "content": "y" * 20_000}], {"id": "big"})
    assert store.get(A, None, "big") is None  # larger than the whole budget: not kept
    now[0] = 61.0
    assert store.get(A, None, "r4") is None  # expired
    store.put(A, "alice", "r5", turns, {"id": "r5"})
    store.put(B, "alice", "r6", turns, {"id": "r6"})
    assert store.forget_user("alice") == 2 and store.count() == 0
    store.put(A, "carol", "r7", turns, {"id": "r7"})
    assert store.delete(B, "r7") is False and store.delete(A, "r7") is True
