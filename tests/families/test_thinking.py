"""Thinking models on the engine: Qwen3's and SmolLM3's real templates render thinking on and off
exactly as transformers renders them, the think tags are single tokens the stream decoder keeps,
replies split into thinking and answer (streamed and whole), and a JSON schema shapes only the
answer after `</think>`.

A random model never writes the tags by itself. Where a test needs them, either a `grammar`
constraint (which shapes the whole reply, think block included) makes the real model write them,
or the test commits the tag tokens through the engine's own commit step and lets the real model,
under the grammar, write the rest."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from edge_runtime.chat import ChatPrompt, render
from edge_runtime.constraints import Constraint
from edge_runtime.engine import Engine
from edge_runtime.reasoning import Phase, ReasoningSplitter, split_reasoning
from edge_runtime.sampling import SamplingParams
from edge_runtime.sequence import SeqStatus
from tests.families.thinking_models import FAMILIES, make_thinking_model

CONFIG = dict(dtype="float32", kv_cache_bytes=4 << 20, block_size=4, max_batched_tokens=64)
CHAT = ({"role": "user", "content": "What is the capital of France?"},)
SYSTEM_CHAT = ({"role": "system", "content": "Be brief."}, *CHAT)
# Lowercase words in the block and after it: a grammar the real model writes the tags under.
BLOCK_GRAMMAR = "start: <think> /[a-z ]{1,16}/ </think> /[a-z ]{1,16}/"
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
          "additionalProperties": False}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_thinking_model(tmp_path_factory.mktemp("thinking"), request.param)


@pytest.fixture(scope="module")
def engine(folder: Path) -> Iterator[Engine]:
    yield Engine.load(str(folder), **CONFIG)


def _transformers(folder: Path, messages, **kwargs) -> str:
    hf = AutoTokenizer.from_pretrained(str(folder))
    return hf.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False, **kwargs)


@pytest.mark.parametrize("messages", [CHAT, SYSTEM_CHAT], ids=["user", "system"])
def test_thinking_on_and_off_render_as_transformers_renders_the_real_template(engine: Engine, folder: Path,
                                                                              messages) -> None:
    hf = engine.tokenizer.hf
    for thinking in (True, False):
        ours = render(hf, ChatPrompt(messages, thinking=thinking))
        assert ours == _transformers(folder, messages, enable_thinking=thinking)
    assert render(hf, ChatPrompt(messages)) == _transformers(folder, messages)  # the template's default
    on, off = (render(hf, ChatPrompt(messages, thinking=t)) for t in (True, False))
    assert on.endswith("<|im_start|>assistant\n")
    if folder.name == "qwen3":
        assert off == on + "<think>\n\n</think>\n\n"
    else:  # SmolLM3 also says so in its system header
        assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n")
        assert "Reasoning Mode: /think" in on and "Reasoning Mode: /no_think" in off


def test_the_think_tags_are_single_tokens_the_stream_decoder_keeps(engine: Engine) -> None:
    tokenizer = engine.tokenizer
    open_ids, close_ids = tokenizer.encode("<think>", special_tokens=False), tokenizer.encode("</think>",
                                                                                              special_tokens=False)
    assert len(open_ids) == 1 and len(close_ids) == 1
    decoder = tokenizer.stream_decoder()
    assert "".join(decoder.step(t) for t in open_ids + close_ids) == "<think></think>"


def test_real_token_ids_streamed_one_by_one_split_as_the_whole_reply(engine: Engine) -> None:
    reply = "<think>\nFrance's capital: Paris.\n</think>\n\nParis is the capital of France."
    ids = engine.tokenizer.encode(reply, special_tokens=False)
    assert engine.tokenizer.encode("</think>", special_tokens=False)[0] in ids
    decoder, splitter = engine.tokenizer.stream_decoder(), ReasoningSplitter()
    pieces = [splitter.feed(decoder.step(t)) for t in ids] + [splitter.finish()]
    thinking, answer = "".join(p[0] for p in pieces), "".join(p[1] for p in pieces)
    assert (thinking, answer) == split_reasoning(reply) == ("France's capital: Paris.", "Paris is the capital of France.")


def _run(engine: Engine, prompt: ChatPrompt, params: SamplingParams) -> tuple[object, list]:
    events: list = []
    rid = engine.add_request(prompt, params, on_token=events.append)
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id == rid:
                return output, events
    raise AssertionError("the request never finished")


def test_a_reply_that_writes_the_block_is_split_streamed_and_whole(engine: Engine) -> None:
    params = SamplingParams(max_tokens=48, constraint=Constraint("lark", BLOCK_GRAMMAR))
    output, events = _run(engine, ChatPrompt(CHAT, thinking=True), params)
    candidate = output.candidates[0]
    assert candidate.finish_reason == "stop"
    assert candidate.reasoning and candidate.text  # both non-empty lowercase words
    assert "<think>" not in candidate.reasoning + candidate.text and "</think>" not in candidate.text
    assert "".join(e.reasoning for e in events) == candidate.reasoning
    assert "".join(e.text for e in events) == candidate.text
    # Feedback pairs train on the answer after the prompt with an empty block, never the thinking.
    assert output.answer_prompt == output.prompt + "<think>\n\n</think>\n\n"


def test_thinking_off_splits_nothing(engine: Engine) -> None:
    params = SamplingParams(max_tokens=48, constraint=Constraint("lark", BLOCK_GRAMMAR))
    output, events = _run(engine, ChatPrompt(CHAT, thinking=False), params)
    candidate = output.candidates[0]
    assert candidate.reasoning is None and output.answer_prompt is None
    assert candidate.text.startswith("<think>") and "</think>" in candidate.text
    assert all(e.reasoning == "" for e in events)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("shape", ["json_schema", "forced_call"])
def test_a_json_schema_or_a_forced_call_shapes_only_the_answer_after_the_block(engine: Engine, shape: str) -> None:
    """The think block's tokens go through the commit step as a model would choose them (one-hot
    rows: the grammar must not mask them); once `</think>` is in, the real model writes the
    answer under the grammar's mask."""
    from edge_runtime.chat import parse_calls

    tokenizer = engine.tokenizer
    if shape == "json_schema":
        prompt = ChatPrompt(CHAT, thinking=True)
        params = SamplingParams(max_tokens=400, constraint=Constraint.json_schema(SCHEMA))
    else:
        prompt = ChatPrompt(CHAT, tools=(WEATHER,), tool_choice="required", thinking=True)
        params = SamplingParams(max_tokens=400)
    rid = engine.add_request(prompt, params)
    seq = engine.requests[rid].seqs[0]
    assert seq.matcher is None and seq.pending_matcher is not None
    while seq.num_generated == 0:  # the prompt's forward and one free token
        engine.step()
    block = tokenizer.encode("<think>\nit is paris\n</think>", special_tokens=False)
    vocab = engine.committer.vocab_size
    for token in block:
        row = torch.full((1, vocab), -1e4)
        row[0, token] = 0.0
        assert engine.committer.commit([seq], row) == []
        assert seq.status is not SeqStatus.FINISHED
    assert seq.pending_matcher is None and seq.matcher is not None
    output = None
    while output is None:
        output = next((o for o in engine.step() if o.request_id == rid), None)
    candidate = output.candidates[0]
    assert candidate.reasoning == "it is paris" and candidate.finish_reason == "stop"
    if shape == "json_schema":
        jsonschema.validate(json.loads(candidate.text), SCHEMA)
    else:
        content, calls = parse_calls(candidate.text, (WEATHER,), "hermes")
        assert [c.name for c in calls] == ["get_weather"] and content == ""
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])


def test_the_opening_phase_follows_a_prefill_inside_the_block(engine: Engine) -> None:
    """A continued assistant message that opened the block and did not close it: the reply
    starts inside the thinking."""
    from edge_runtime import intake

    prompt = ChatPrompt((*CHAT, {"role": "assistant", "content": "<think>\nhmm"}), continue_final=True,
                        thinking=True)
    text = render(engine.tokenizer.hf, prompt)
    thinking = intake.reply_thinking(prompt, text, engine.tokenizer, SamplingParams())
    assert thinking is not None and thinking.phase is Phase.THINKING
