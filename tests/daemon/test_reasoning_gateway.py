"""Thinking models through a real `maced` and the official `openai` client: a tiny Qwen3 and a
tiny SmolLM3 with their real chat templates (tests/families/templates). Thinking is turned on and
off with `reasoning_effort` and `chat_template_kwargs`; the thinking comes back in
`reasoning_content`, apart from `content`, whole and streamed; the SDK and `macectl` carry it too.

A random model writes no think block by itself: a `grammar` response format (which shapes the
whole reply, think block included; docs/thinking.md) makes the real model write one, with
lowercase words inside and after it. What the switch did to the prompt shows in the prompt's
token count, checked against transformers' rendering of the same template."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from tests.daemon.test_cli import macectl
from tests.daemon.test_gateway import Gateway, start_gateway
from tests.families.thinking_models import FAMILIES, make_thinking_model

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
BLOCK = {"type": "grammar", "grammar": "start: <think> /[a-z ]{1,16}/ </think> /[a-z ]{1,16}/"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def gw(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp(f"reasoning-{request.param}")
    model = make_thinking_model(root, request.param)
    (root / "daemon").mkdir()
    g = start_gateway(root / "daemon", model, extra=["--set", "finetune.enabled=false"])
    g.model = model  # type: ignore[attr-defined]
    yield g
    code, _ = g.daemon.stop()
    assert code == 0, g.daemon.log()


def _prompt_tokens(model: Path, **kwargs: bool) -> int:
    hf = AutoTokenizer.from_pretrained(str(model))
    text = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False, **kwargs)
    return len(hf.encode(text, add_special_tokens=False))


def _create(gw: Gateway, **kwargs):
    kwargs = {"max_tokens": 48, "response_format": BLOCK, **kwargs}
    return gw.openai().chat.completions.create(model="default", messages=CHAT, temperature=0, **kwargs)


def test_thinking_on_reasoning_content_apart_whole_and_streamed(gw: Gateway) -> None:
    whole = _create(gw, reasoning_effort="high")
    message = whole.choices[0].message
    assert message.reasoning_content and message.content  # lowercase words, both
    assert "think>" not in message.reasoning_content + message.content
    assert whole.usage.prompt_tokens == _prompt_tokens(gw.model, enable_thinking=True)
    stream = _create(gw, reasoning_effort="high", stream=True)
    thinking, content = [], []
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            thinking.append(getattr(delta, "reasoning_content", None) or "")
            content.append(delta.content or "")
    assert "".join(thinking) == message.reasoning_content  # greedy: the same reply, streamed
    assert "".join(content) == message.content


def test_thinking_off_by_either_switch_leaves_no_reasoning_content(gw: Gateway) -> None:
    off_tokens = _prompt_tokens(gw.model, enable_thinking=False)
    assert off_tokens != _prompt_tokens(gw.model, enable_thinking=True)  # the switch changes the prompt
    for switch in ({"reasoning_effort": "none"}, {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}):
        reply = _create(gw, **switch)
        message = reply.choices[0].message
        assert reply.usage.prompt_tokens == off_tokens
        assert getattr(message, "reasoning_content", None) is None
        assert message.content.startswith("<think>")  # nothing is taken out of the answer
    default = _create(gw)  # both templates think unless told not to
    assert default.usage.prompt_tokens == _prompt_tokens(gw.model)
    assert default.choices[0].message.reasoning_content


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
_CALL = '"<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"%s\\"}}\\n</tool_call>"'
# The model thinks a call to Paris, then answers with a call to Rome.
CALLS = {"type": "grammar", "grammar": f"start: <think> {_CALL % 'Paris'} </think> {_CALL % 'Rome'}"}


def test_tool_calls_are_parsed_from_the_answer_never_the_thinking(gw: Gateway) -> None:
    whole = _create(gw, tools=[WEATHER], response_format=CALLS, max_tokens=300)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == [{"city": "Rome"}]
    assert '"Paris"' in choice.message.reasoning_content and "<tool_call>" in choice.message.reasoning_content
    stream = _create(gw, tools=[WEATHER], response_format=CALLS, max_tokens=300, stream=True)
    thinking, calls = [], []
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            thinking.append(getattr(delta, "reasoning_content", None) or "")
            calls += [json.loads(c.function.arguments) for c in delta.tool_calls or ()]
    assert "".join(thinking) == choice.message.reasoning_content and calls == [{"city": "Rome"}]


def test_bad_switches_are_refused_by_name(gw: Gateway) -> None:
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        _create(gw, reasoning_effort="extreme")
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        _create(gw, extra_body={"chat_template_kwargs": {"tools_in_user_message": True}})


def test_sdk_and_macectl_carry_the_switch_and_the_thinking(gw: Gateway) -> None:
    with gw.daemon.client() as client:
        result = client.generate(messages=CHAT, max_tokens=48, thinking=True,
                                 response_format=BLOCK)
        assert result.reasoning and result.text and "think>" not in result.text
        tokens = list(client.stream(messages=CHAT, max_tokens=48, thinking=True, response_format=BLOCK))
        assert "".join(t.reasoning or "" for t in tokens) == result.reasoning
        assert "".join(t.text for t in tokens) == result.text
        off = client.generate(messages=CHAT, max_tokens=4, thinking=False)
        assert off.reasoning is None
    # macectl: the switch reaches the template (a reply split or not), the thinking is kept apart.
    for flag, split in (("--think", True), ("--no-think", False)):
        done = macectl(gw.daemon.endpoint, "generate", "hello", flag, "--max-tokens", "4", "--json")
        assert done.returncode == 0, done.stderr
        assert ("reasoning" in json.loads(done.stdout)["candidates"][0]) is split
    shown = macectl(gw.daemon.endpoint, "generate", "hello", "--think", "--show-thinking", "--max-tokens", "4")
    assert shown.returncode == 0, shown.stderr


def test_feedback_pairs_hold_the_answers_the_user_saw_never_the_thinking(gw: Gateway) -> None:
    with gw.daemon.client() as client:
        client.consent("thinker")
        result = client.generate(messages=CHAT, max_tokens=48, n=2, temperature=1.0, seed=5, thinking=True,
                                 response_format=BLOCK, user="thinker")
        assert result.recorded and all(c.reasoning for c in result.candidates)
        client.choose("thinker", result.interaction_id, 1)
        data = client.export("thinker")
    [interaction] = data["interactions"]
    assert interaction["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert [c["text"] if isinstance(c, dict) else c for c in interaction["candidates"]] == \
        [c.text for c in result.candidates]
    [pair] = data["preference_pairs"]
    assert (pair["chosen"], pair["rejected"]) == (result.candidates[1].text, result.candidates[0].text)
    assert pair["prompt"] == interaction["prompt"]


def _thinking_token_count(logprobs: list) -> int:
    """Tokens of the reply up to and including the one that completes `</think>`, read off the
    bytes each generated token spelled (chat's `logprobs.content`)."""
    spelled = b""
    for i, entry in enumerate(logprobs):
        spelled += bytes(entry.bytes)
        if b"</think>" in spelled:
            return i + 1
    raise AssertionError(f"no closing tag in {spelled!r}")


def test_usage_counts_the_thinking_tokens_whole_streamed_and_through_responses(gw: Gateway) -> None:
    whole = _create(gw, reasoning_effort="high", logprobs=True)
    expected = _thinking_token_count(whole.choices[0].logprobs.content)
    assert 2 < expected < whole.usage.completion_tokens  # the tags and words; an answer after them
    assert whole.usage.completion_tokens_details.reasoning_tokens == expected
    stream = _create(gw, reasoning_effort="high", stream=True, stream_options={"include_usage": True})
    [usage] = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage.completion_tokens_details.reasoning_tokens == expected
    off = _create(gw, reasoning_effort="none")
    assert off.usage.completion_tokens_details.reasoning_tokens == 0  # the tags are answer text then
    client = gw.openai()
    kwargs = {"model": "default", "input": CHAT[0]["content"], "temperature": 0, "max_output_tokens": 48,
              "reasoning": {"effort": "high"}, "text": {"format": BLOCK}}
    response = client.responses.create(**kwargs)
    assert response.usage.output_tokens_details.reasoning_tokens == expected
    assert response.output[0].type == "reasoning"
    events = list(client.responses.create(stream=True, **kwargs))
    assert events[-1].type == "response.completed"
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == expected
    with gw.daemon.client() as sdk:
        result = sdk.generate(messages=CHAT, max_tokens=48, thinking=True, response_format=BLOCK)
    assert result.usage["reasoning_tokens"] == expected
