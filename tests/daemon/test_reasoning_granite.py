"""Granite 3.3 thinking through a real `maced` and the official `openai` client (a tiny random
Granite with its real chat template, tests/families/templates): chat's `reasoning_effort` and
`chat_template_kwargs` (`thinking`, Granite's own name, or `enable_thinking`) turn it on,
`reasoning_content` comes apart and `content` without Granite's `<response>` wrapper, whole and
streamed; `/v1/responses` carries the thinking as a `reasoning` item before the message, whole
and streamed, switched by `reasoning.effort`, and `previous_response_id` does not feed it back.

A random model writes no think block by itself: a `grammar` response format makes the real model
write the block and the wrapped answer, with lowercase words the model picks inside them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from tests.daemon.test_gateway import Gateway, start_gateway
from tests.families.thinking_models import make_granite_model

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
GRAMMAR = 'start: <think> /[a-z ]{1,16}/ </think> "<response>" /[a-z ]{1,16}/ "</response>"'
BLOCK = {"type": "grammar", "grammar": GRAMMAR}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("reasoning-granite")
    model = make_granite_model(root)
    (root / "daemon").mkdir()
    g = start_gateway(root / "daemon", model, extra=["--set", "finetune.enabled=false"])
    g.model = model  # type: ignore[attr-defined]
    yield g
    code, _ = g.daemon.stop()
    assert code == 0, g.daemon.log()


def _prompt_tokens(model: Path, messages: list[dict], **kwargs: bool) -> int:
    hf = AutoTokenizer.from_pretrained(str(model))
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    return len(hf.encode(text, add_special_tokens=False))


def _create(gw: Gateway, **kwargs):
    kwargs = {"max_tokens": 80, "response_format": BLOCK, **kwargs}
    return gw.openai().chat.completions.create(model="default", messages=CHAT, temperature=0, **kwargs)


def test_chat_thinking_on_reasoning_content_apart_and_the_answer_unwrapped(gw: Gateway) -> None:
    whole = _create(gw, reasoning_effort="high")
    message = whole.choices[0].message
    assert message.reasoning_content and message.content  # lowercase words, both
    assert "<" not in message.reasoning_content + message.content  # no tag, nor a piece of one
    assert whole.usage.prompt_tokens == _prompt_tokens(gw.model, CHAT, thinking=True)
    for switch in ({"reasoning_effort": "high", "stream": True},
                   {"extra_body": {"chat_template_kwargs": {"thinking": True}}, "stream": True},
                   {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}):
        reply = _create(gw, **switch)
        if switch.get("stream"):
            thinking, content = [], []
            for chunk in reply:
                if chunk.choices:
                    delta = chunk.choices[0].delta
                    thinking.append(getattr(delta, "reasoning_content", None) or "")
                    content.append(delta.content or "")
            got = ("".join(thinking), "".join(content))
        else:
            got = (reply.choices[0].message.reasoning_content, reply.choices[0].message.content)
        assert got == (message.reasoning_content, message.content), switch  # greedy: the same reply


def test_chat_thinking_off_or_by_default_leaves_the_reply_whole(gw: Gateway) -> None:
    off_tokens = _prompt_tokens(gw.model, CHAT)
    assert off_tokens < _prompt_tokens(gw.model, CHAT, thinking=True)  # the switch changes the prompt
    for switch in ({}, {"reasoning_effort": "none"}, {"extra_body": {"chat_template_kwargs": {"thinking": False}}}):
        reply = _create(gw, **switch)
        message = reply.choices[0].message
        assert reply.usage.prompt_tokens == off_tokens
        assert getattr(message, "reasoning_content", None) is None
        assert message.content.startswith("<think>") and message.content.endswith("</response>")
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        _create(gw, extra_body={"chat_template_kwargs": {"thinking": True, "enable_thinking": False}})


def _respond(gw: Gateway, **kwargs):
    kwargs = {"max_output_tokens": 80, "text": {"format": BLOCK}, "temperature": 0, **kwargs}
    return gw.openai().responses.create(model="default", **kwargs)


def test_responses_carry_a_reasoning_item_before_the_message_whole_and_streamed(gw: Gateway) -> None:
    chat = _create(gw, reasoning_effort="high").choices[0].message
    whole = _respond(gw, input=CHAT[0]["content"], reasoning={"effort": "high"})
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.status == "completed" and reasoning.summary == []
    assert [c.text for c in reasoning.content] == [chat.reasoning_content]  # the same greedy reply as chat's
    assert message.type == "message" and whole.output_text == chat.content
    assert whole.usage.input_tokens == _prompt_tokens(gw.model, CHAT, thinking=True)
    deltas, kinds, final = [], [], None
    for event in _respond(gw, input=CHAT[0]["content"], reasoning={"effort": "high"}, stream=True):
        kinds.append(event.type)
        if event.type == "response.reasoning_text.delta":
            deltas.append(event.delta)
        elif event.type == "response.completed":
            final = event.response
    assert "".join(deltas) == chat.reasoning_content
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert final is not None and [o.model_dump() for o in final.output[:1]] == \
        [reasoning.model_dump() | {"id": final.output[0].id}]
    assert final.output_text == chat.content
    off = _respond(gw, input=CHAT[0]["content"], reasoning={"effort": "none"})
    assert [o.type for o in off.output] == ["message"] and off.output_text.startswith("<think>")
    with pytest.raises(openai.BadRequestError, match="reasoning.effort"):
        _respond(gw, input="hi", reasoning={"effort": "extreme"})


def test_previous_response_id_does_not_feed_the_thinking_back(gw: Gateway) -> None:
    first = _respond(gw, input=CHAT[0]["content"], reasoning={"effort": "high"})
    assert first.output[0].type == "reasoning"
    second = _respond(gw, input="Are you sure?", previous_response_id=first.id, reasoning={"effort": "high"},
                      max_output_tokens=4, text=None)
    turns = [*CHAT, {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "Are you sure?"}]
    assert second.usage.input_tokens == _prompt_tokens(gw.model, turns, thinking=True)


def test_the_sdk_carries_the_switch_and_feedback_pairs_hold_the_unwrapped_answers(gw: Gateway) -> None:
    with gw.daemon.client() as client:
        client.consent("granite-user")
        result = client.generate(messages=CHAT, max_tokens=80, n=2, temperature=1.0, seed=5, thinking=True,
                                 response_format=BLOCK, user="granite-user")
        assert result.recorded and all(c.reasoning and c.text and "<" not in c.text for c in result.candidates)
        tokens = list(client.stream(messages=CHAT, max_tokens=80, thinking=True, response_format=BLOCK))
        assert "".join(t.reasoning or "" for t in tokens) and "<" not in "".join(t.text for t in tokens)
        client.choose("granite-user", result.interaction_id, 1)
        data = client.export("granite-user")
    [interaction] = data["interactions"]
    hf = AutoTokenizer.from_pretrained(str(gw.model))
    # The prompt Granite writes with thinking off: the answers follow it, whatever each one thought.
    assert interaction["prompt"] == hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False,
                                                           thinking=False)
    [pair] = data["preference_pairs"]
    assert (pair["chosen"], pair["rejected"]) == (result.candidates[1].text, result.candidates[0].text)
