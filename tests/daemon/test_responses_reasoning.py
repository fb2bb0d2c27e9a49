"""`/v1/responses` reasoning without a daemon: a thinking model's reply carries a `reasoning`
item (its thinking as `reasoning_text` content) before its message, whole and streamed alike
(`response.reasoning_text.delta`/`.done`), each event and response read by the official `openai`
package's own types; `reasoning.effort` is chat's switch; the thinking is not fed back."""

from __future__ import annotations

import pytest
from openai.types.responses import ResponseOutputItem, ResponseReasoningItem, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

from daemon.fronts.http.errors import GatewayError
from daemon.fronts.http.responses_api import input_messages, thinking_switch
from daemon.fronts.http.responses_replies import ResponseReply, assistant_turn

EVENTS, ITEMS = TypeAdapter(ResponseStreamEvent), TypeAdapter(list[ResponseOutputItem])
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}


def _result(text: str, reasoning: str | None, calls: list | None = None, finish: str = "stop") -> dict:
    return {"interaction_id": "ix-1", "adapter": None, "recorded": False,
            "usage": {"prompt_tokens": 5, "completion_tokens": 9},
            "candidates": [{"index": 0, "text": text, "tool_calls": calls, "finish_reason": finish,
                            "reasoning": reasoning}]}


def _streamed(pieces: list[tuple[str, dict | None]], result: dict) -> list[dict]:
    reply = ResponseReply("m", {})
    reply.id = "ix-1"
    return [*reply.opening(), *(e for text, extra in pieces for e in reply.delta(text, extra)), *reply.finals(result)]


def test_the_whole_reply_puts_the_thinking_in_a_reasoning_item_before_the_message() -> None:
    whole = ResponseReply("m", {}).whole(_result("Paris.", "the capital"))
    reasoning, message = ITEMS.validate_python(whole["output"])  # the official client's own shapes
    assert isinstance(reasoning, ResponseReasoningItem) and reasoning.status == "completed"
    assert [c.text for c in reasoning.content] == ["the capital"] and reasoning.summary == []
    assert message.type == "message" and [c.text for c in message.content] == ["Paris."]
    # No thinking split off (a model that cannot think, or thinking off): no reasoning item.
    for reasoning_text in (None, ""):
        assert [o["type"] for o in ResponseReply("m", {}).whole(_result("Paris.", reasoning_text))["output"]] == \
            ["message"]


def test_streamed_reasoning_events_build_the_same_output_as_the_whole_reply() -> None:
    pieces = [("", {"reasoning": "the "}), ("", {"reasoning": "capital"}), ("Par", {"reasoning": ""}), ("is.", None)]
    events = _streamed(pieces, _result("Paris.", "the capital"))
    for event in events[2:-1]:  # every item event is one the official client knows (not the lifecycle's,
        EVENTS.validate_python(event)  # whose response echoes a request this test does not make)
    kinds = [e["type"] for e in events]
    assert kinds[2:6] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta", "response.reasoning_text.delta"]
    assert kinds[6:9] == ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds.index("response.output_item.done") < kinds.index("response.output_text.delta")
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "the capital"
    assert events[-1]["response"]["output"] == ResponseReply("m", {}).whole(_result("Paris.", "the capital"))["output"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_a_tool_call_after_thinking_and_a_reply_cut_inside_the_thinking() -> None:
    events = _streamed([("", {"reasoning": "call f"}), ("", {"tool_calls": [CALL]})],
                       _result("", "call f", [CALL], "tool_calls"))
    whole = ResponseReply("m", {}).whole(_result("", "call f", [CALL], "tool_calls"))
    assert [o["type"] for o in whole["output"]] == ["reasoning", "function_call"]
    assert events[-1]["response"]["output"] == whole["output"]
    # max_output_tokens inside the thinking: the reasoning item is incomplete, the answer empty.
    cut = _result("", "still thin", finish="length")
    events = _streamed([("", {"reasoning": "still thin"})], cut)
    whole = ResponseReply("m", {}).whole(cut)
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["output"] == whole["output"]
    assert [(o["type"], o["status"]) for o in whole["output"]] == [("reasoning", "incomplete"),
                                                                    ("message", "incomplete")]
    ITEMS.validate_python(whole["output"])


def test_the_thinking_is_not_fed_back_to_later_turns() -> None:
    whole = ResponseReply("m", {}).whole(_result("Paris.", "the capital"))
    # previous_response_id: the stored turn is the answer alone.
    assert assistant_turn(whole["output"]) == {"role": "assistant", "content": "Paris."}
    # The output sent back as input, as clients do by hand: the reasoning item is dropped.
    items = [{"role": "user", "content": "capital?"}, *whole["output"], {"role": "user", "content": "sure?"}]
    assert input_messages(items, []) == [{"role": "user", "content": "capital?"},
                                         {"role": "assistant", "content": "Paris."},
                                         {"role": "user", "content": "sure?"}]


def test_reasoning_effort_is_the_thinking_switch() -> None:
    assert thinking_switch(None) is None and thinking_switch({"summary": "auto"}) is None
    assert thinking_switch({"effort": "none"}) is False and thinking_switch({"effort": "minimal"}) is False
    assert all(thinking_switch({"effort": e}) is True for e in ("low", "medium", "high", "xhigh", "max"))
    assert thinking_switch({"effort": "high", "context": "current_turn"}) is True
    for bad, param in (({"effort": "extreme"}, "reasoning.effort"), ({"effort": ["high"]}, "reasoning.effort"),
                       ({"context": "all_turns"}, "reasoning.context")):
        with pytest.raises(GatewayError) as info:
            thinking_switch(bad)
        assert info.value.param == param
