"""Chat prompts with tools, tool results and prefills, on the default model's own chat template
(ChatML, which knows no tools) and on a template that renders tools itself; forced calls; calls
parsed back out of answers, whole and streamed."""

from __future__ import annotations

import copy
import json

import pytest

from edge_runtime import SamplingParams
from edge_runtime.chat import (
    CallStreamer,
    ChatPrompt,
    parse_calls,
    render,
    template_tool_style,
    tool_style,
)
from edge_runtime.errors import BadRequest
from tests.engine.helpers import make_engine

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir, max_batched_tokens=64)


def test_a_template_without_tools_gets_them_described_in_a_system_message(engine):
    text = render(engine.tokenizer.hf, ChatPrompt(tuple(ASK), (WEATHER,)))
    assert "<tools>" in text and '"name": "get_weather"' in text and "<tool_call>" in text
    assert text.index("<tools>") < text.index("What's the weather")
    assert "<tools>" not in render(engine.tokenizer.hf, ChatPrompt(tuple(ASK), (WEATHER,), tool_choice="none"))


def test_tool_calls_and_results_in_the_history_are_rendered(engine):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    text = render(engine.tokenizer.hf, ChatPrompt(tuple(history), (WEATHER,)))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_final_assistant_message_is_continued_not_closed(engine):
    prompt = ChatPrompt(tuple(ASK + [{"role": "assistant", "content": "It is"}]), continue_final=True)
    text = render(engine.tokenizer.hf, prompt)
    assert text.endswith("<|im_start|>assistant\nIt is")
    closed = render(engine.tokenizer.hf, ChatPrompt(tuple(ASK + [{"role": "assistant", "content": "It is"}])))
    assert closed.endswith("It is<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("choice", ["required", "get_weather", "get_time"])
def test_a_forced_call_is_always_a_valid_call_of_an_offered_tool(engine, choice):
    prompt = ChatPrompt(tuple(ASK), (WEATHER, TIME), tool_choice=choice)
    outs = engine.generate([prompt] * 3, SamplingParams(max_tokens=300, temperature=1.0, seed=4))
    for out in outs:
        assert out.candidates[0].finish_reason == "stop", out.text
        content, calls = parse_calls(out.text, (WEATHER, TIME), tool_style(engine.tokenizer))
        assert content == "" and len(calls) == 1
        call = calls[0]
        assert call.name in (("get_weather", "get_time") if choice == "required" else (choice,))
        arguments = json.loads(call.arguments)
        assert set(arguments) == ({"city", "unit"} if call.name == "get_weather" else {"zone"})


def test_a_forced_call_and_a_response_format_are_refused_together(engine):
    from edge_runtime.constraints import Constraint

    with pytest.raises(BadRequest, match="forced tool call"):
        engine.add_request(ChatPrompt(tuple(ASK), (WEATHER,), tool_choice="required"),
                           SamplingParams(constraint=Constraint("json")))


@pytest.mark.parametrize("kwargs,words", [
    ({"tools": (WEATHER, WEATHER)}, "same name"),
    ({"tools": (WEATHER,), "tool_choice": "nope"}, "not one of the tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": ({"type": "function", "function": {"name": "bad name!"}},)}, "each tool"),
    ({"continue_final": True}, "assistant message last"),
])
def test_malformed_tool_prompts_are_bad_requests(kwargs, words):
    with pytest.raises(BadRequest, match=words):
        ChatPrompt(tuple(ASK), **kwargs)


def test_parse_keeps_content_and_ignores_calls_of_unknown_functions():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}\n'
            '</tool_call>\n<tool_call>{"name": "launch", "arguments": {}}</tool_call>')
    content, calls = parse_calls(text, (WEATHER,), "hermes")
    assert [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Rome", "unit": "C"}
    assert content.startswith("Let me check.") and "launch" in content
    assert parse_calls("no calls here", (WEATHER,), "hermes") == ("no calls here", [])
    _, [unclosed] = parse_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "A", "unit": "F"}}',
                                (WEATHER,), "hermes")
    assert unclosed.name == "get_weather"
    _, [bare] = parse_calls('{"name": "get_weather", "parameters": {"city": "B", "unit": "C"}}', (WEATHER,), "json")
    assert json.loads(bare.arguments) == {"city": "B", "unit": "C"}


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7])
def test_the_streamer_gives_the_same_calls_and_content_for_any_split(cut):
    text = ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>'
            ' and <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call> done <tool')
    streamer = CallStreamer((WEATHER, TIME), "hermes")
    events = []
    for i in range(0, len(text), cut):
        events += streamer.feed(text[i:i + cut])
    events += streamer.finish()
    content = "".join(v for k, v in events if k == "content")
    calls = [v for k, v in events if k == "call"]
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert content == "Sure.  and  done <tool"
    # Nothing of a call's text ever streamed as content, however the text was split.
    assert "get_weather" not in content


def test_template_styles():
    assert template_tool_style(None) == (False, "hermes")
    assert template_tool_style("{% for tool in tools %}<tool_call>{% endfor %}") == (True, "hermes")
    assert template_tool_style("{{ tools }} <|python_tag|> \"parameters\"") == (True, "json")


def test_token_id_prompts_run_as_given(engine):
    ids = engine.tokenizer.hf.encode("The quick brown fox")
    [by_ids] = engine.generate(ids, SamplingParams(max_tokens=5, ignore_eos=True))
    [by_text] = engine.generate("The quick brown fox", SamplingParams(max_tokens=5, ignore_eos=True))
    assert by_ids.token_ids == by_text.token_ids and by_ids.prompt_token_ids == ids
    with pytest.raises(BadRequest, match="token ids"):
        engine.add_request([len(engine.tokenizer.hf) + 5], SamplingParams())


NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_renders_tools_gets_them_and_the_calls_as_objects(engine):
    hf = copy.deepcopy(engine.tokenizer.hf)
    hf.chat_template = NATIVE_TEMPLATE
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5 C"}]
    text = render(hf, ChatPrompt(tuple(history), (WEATHER,)))
    assert text.startswith("<|im_start|>system\n# Tools\n<tools>") and '"get_weather"' in text
    # The arguments reach the template as an object (as transformers' templates expect), not as text.
    assert '"arguments": {"city": "Oslo", "unit": "C"}' in text
    assert "<|im_start|>tool\n5 C<|im_end|>" in text and "You may call functions" not in text
