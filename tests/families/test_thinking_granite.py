"""Granite 3.3 thinking on the engine: its real template turns thinking on with `thinking=True`
(only its default system message changes), replies split into the thinking and the answer without
Granite's `<response>` wrapper (streamed and whole, the wrapper's tags split across tokens), and a
JSON schema shapes only the answer after `</think>`. Thinking off (Granite's default) leaving the
reply whole is checked through the gateway (tests/daemon/test_reasoning_granite.py).

A random model never writes the tags by itself: a `grammar` constraint makes the real model write
them, or the test commits the block's tokens through the engine's own commit step and lets the
real model, under the schema's mask, write the answer (as tests/families/test_thinking.py does)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from transformers import AutoTokenizer

from edge_runtime.chat import ChatPrompt, render
from edge_runtime.constraints import Constraint
from edge_runtime.engine import Engine
from edge_runtime.reasoning import GRANITE, ReasoningSplitter, split_reasoning
from edge_runtime.sampling import SamplingParams
from tests.families.thinking_models import make_granite_model

CONFIG = dict(dtype="float32", kv_cache_bytes=4 << 20, block_size=4, max_batched_tokens=256)
CHAT = ({"role": "user", "content": "What is the capital of France?"},)
SYSTEM_CHAT = ({"role": "system", "content": "Be brief."}, *CHAT)
# The block, then the answer in its wrapper: lowercase words the real model picks.
BLOCK_GRAMMAR = 'start: <think> /[a-z ]{1,16}/ </think> "<response>" /[a-z ]{1,16}/ "</response>"'
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_granite_model(tmp_path_factory.mktemp("granite"))


@pytest.fixture(scope="module")
def engine(folder: Path) -> Iterator[Engine]:
    yield Engine.load(str(folder), **CONFIG)


def _transformers(folder: Path, messages, **kwargs) -> str:
    hf = AutoTokenizer.from_pretrained(str(folder))
    return hf.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False, **kwargs)


def test_thinking_on_and_off_render_as_transformers_renders_the_real_template(engine: Engine, folder: Path) -> None:
    hf = engine.tokenizer.hf
    on, off, default = (render(hf, ChatPrompt(CHAT, thinking=t)) for t in (True, False, None))
    assert on == _transformers(folder, CHAT, thinking=True)
    assert off == _transformers(folder, CHAT, thinking=False) == default  # Granite does not think by default
    assert "between <think></think>" in on and "<think>" not in off
    assert on.endswith("<|start_of_role|>assistant<|end_of_role|>") and off.endswith("assistant<|end_of_role|>")
    # With the client's own system message the template leaves the switch unread.
    assert render(hf, ChatPrompt(SYSTEM_CHAT, thinking=True)) == render(hf, ChatPrompt(SYSTEM_CHAT, thinking=False))


def test_real_token_ids_streamed_one_by_one_split_as_the_whole_reply(engine: Engine) -> None:
    reply = "<think>France's capital: Paris.</think><response>Paris is the capital of France.</response>"
    tokenizer = engine.tokenizer
    ids = tokenizer.encode(reply, special_tokens=False)
    assert len(tokenizer.encode("<response>", special_tokens=False)) > 1  # the wrapper's tags span tokens
    decoder, splitter = tokenizer.stream_decoder(), ReasoningSplitter(answer_tags=GRANITE.answer_tags)
    pieces = [splitter.feed(decoder.step(t)) for t in ids] + [splitter.finish()]
    assert all("<" not in p[1] and ">" not in p[1] for p in pieces)  # no piece of a tag is ever given out
    thinking, answer = "".join(p[0] for p in pieces), "".join(p[1] for p in pieces)
    assert (thinking, answer) == split_reasoning(reply, answer_tags=GRANITE.answer_tags) == \
        ("France's capital: Paris.", "Paris is the capital of France.")


def _run(engine: Engine, prompt: ChatPrompt, params: SamplingParams) -> tuple[object, list]:
    events: list = []
    rid = engine.add_request(prompt, params, on_token=events.append)
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id == rid:
                return output, events
    raise AssertionError("the request never finished")


def test_a_reply_that_writes_the_block_is_split_streamed_and_whole(engine: Engine) -> None:
    params = SamplingParams(max_tokens=80, constraint=Constraint("lark", BLOCK_GRAMMAR))
    prompt = ChatPrompt(CHAT, thinking=True)
    output, events = _run(engine, prompt, params)
    candidate = output.candidates[0]
    assert candidate.finish_reason == "stop"
    assert candidate.reasoning and candidate.text  # both non-empty lowercase words
    assert "<" not in candidate.reasoning + candidate.text and ">" not in candidate.reasoning + candidate.text
    assert "".join(e.reasoning for e in events) == candidate.reasoning
    assert "".join(e.text for e in events) == candidate.text
    # Feedback pairs train on the answer after the prompt Granite writes with thinking off.
    assert output.answer_prompt == render(engine.tokenizer.hf, ChatPrompt(CHAT, thinking=False))


def test_a_json_schema_shapes_only_the_answer_after_the_block(engine: Engine,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The block's tokens are the rows the commit step gets for the first tokens (one-hot, after
    the real forward: the pending grammar must not mask them); once `</think>` is in, the real
    model writes the answer under the schema's mask."""
    params = SamplingParams(max_tokens=400, constraint=Constraint.json_schema(SCHEMA))
    rid = engine.add_request(ChatPrompt(CHAT, thinking=True), params)
    seq = engine.requests[rid].seqs[0]
    assert seq.matcher is None and seq.pending_matcher is not None
    block = engine.tokenizer.encode("<think>it is paris</think>", special_tokens=False)
    commit = engine.committer.commit

    def chosen(seqs, logits):
        if logits is not None and seq in seqs and seq.num_generated < len(block):
            logits = logits.clone()
            logits[seqs.index(seq)] = -1e4
            logits[seqs.index(seq), block[seq.num_generated]] = 0.0
        return commit(seqs, logits)

    monkeypatch.setattr(engine.committer, "commit", chosen)
    output = None
    while output is None:
        output = next((o for o in engine.step() if o.request_id == rid), None)
    candidate = output.candidates[0]
    assert output.candidates[0].token_ids[:len(block)] == block
    assert candidate.reasoning == "it is paris" and candidate.finish_reason == "stop"
    jsonschema.validate(json.loads(candidate.text), SCHEMA)
