"""Structured output on the tiny random model: whatever a random model prefers, a grammar's mask
makes the text valid (JSON, a JSON schema, a regex), per sequence, and leaves the other rows of
the batch alone; grammars that do not compile are the request's error."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
import torch

from edge_runtime import SamplingParams
from edge_runtime.commit import greedy_tokens as _greedy_tokens
from edge_runtime.constraints import Constraint, unpack_masks
from edge_runtime.errors import BadRequest
from edge_runtime.sampling import mask_rows, shape_logits
from tests.engine.helpers import make_engine

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "inner": {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"],
                  "additionalProperties": False},
    },
    "required": ["color", "ok", "tags", "inner"],
    "additionalProperties": False,
}
PROMPTS = ["Hello there", "Give me JSON", "The quick brown fox", "1 2 3"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir, max_batched_tokens=64)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_schema_constrained_outputs_always_validate(engine, temperature):
    # A random model pads every gap with all the whitespace the grammar allows: room for that.
    params = SamplingParams(max_tokens=600, temperature=temperature, seed=3, n=2,
                            constraint=Constraint.json_schema(SCHEMA))
    for out in engine.generate(PROMPTS, params):
        for c in out.candidates:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)


def _validates(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_without_the_mask_the_random_model_writes_nothing_valid(engine):
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=40))
    assert not any(_validates(out.text) for out in outs)


def test_json_mode_gives_an_object_and_regex_a_full_match(engine):
    [obj] = engine.generate(["x"], SamplingParams(max_tokens=200, temperature=1.0, seed=1,
                                                  constraint=Constraint("json")))
    if obj.candidates[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:  # a random model may never close an unbounded object; what it wrote is still a prefix
        assert obj.text.lstrip().startswith("{")
    pattern = r"(yes|no), [a-z]{2,6}\."
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=1.0, seed=5,
                                                   constraint=Constraint("regex", pattern)))
    for out in outs:
        assert re.fullmatch(pattern, out.text), out.text
        assert out.candidates[0].finish_reason == "stop"


def test_a_constrained_row_leaves_the_other_rows_of_its_batch_alone(engine):
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = [o.token_ids for o in engine.generate(PROMPTS, plain)]
    ids = [engine.add_request(p, plain) for p in PROMPTS]
    engine.add_request("side", SamplingParams(max_tokens=30, constraint=Constraint.json_schema(SCHEMA)))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    assert [done[i].token_ids for i in ids] == alone


def _row_mask(packed_row: torch.Tensor, vocab: int) -> torch.Tensor:
    """One row's mask unpacked on its own, as the engine did per row: token t is bit t % 32 of
    word t // 32."""
    bits = torch.arange(32, dtype=torch.int32)
    return ((packed_row[:, None] >> bits) & 1).bool().reshape(-1)[:vocab]


def test_masking_the_batch_at_once_equals_masking_each_constrained_row():
    vocab = 1003  # not a multiple of 32: the last word is partly padding
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, vocab, generator=gen)
    rows = [0, 2, 3]  # rows 1 and 4 have no grammar
    packed = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    packed[2] = 0
    packed[2, 31] = 1 << 7  # row 3 allows token 31 * 32 + 7 = 999 only
    params = SamplingParams(logit_bias={5: 2.5, 999: -100.0, 1000: 3.0}, frequency_penalty=0.4, presence_penalty=-1.0)
    counts = {5: 2, 7: 1}

    shaped = mask_rows(logits, rows, unpack_masks(packed, vocab))
    greedy = _greedy_tokens(shaped)

    for r in range(len(logits)):
        if r in rows:
            allowed = _row_mask(packed[rows.index(r)], vocab)
            alone = logits[r].clone().masked_fill_(~allowed, float("-inf"))
            # bias and penalties first, then the mask: the order of the per-row path
            alone_shaped = shape_logits(logits[r], params, counts).masked_fill_(~allowed, float("-inf"))
        else:
            alone, alone_shaped = logits[r], shape_logits(logits[r], params, counts)
        assert torch.equal(shaped[r], alone)
        assert greedy[r] == int(torch.argmax(alone))
        assert torch.equal(shape_logits(shaped[r], params, counts), alone_shaped)
    assert greedy[3] == 999
    assert torch.equal(logits, torch.randn(5, vocab, generator=torch.Generator().manual_seed(0)))  # untouched


def test_constrained_and_free_rows_choose_in_a_mixed_batch_what_they_choose_alone(engine):
    schema = Constraint.json_schema(SCHEMA)
    asks = [("Hello there", SamplingParams(max_tokens=24, constraint=schema)),
            ("Give me JSON", SamplingParams(max_tokens=24, temperature=1.0, seed=7, constraint=schema)),
            ("The quick brown fox", SamplingParams(max_tokens=24, constraint=schema, logprobs=2,
                                                   logit_bias={7: 4.0}, frequency_penalty=0.5)),
            ("1 2 3", SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1)),
            ("side", SamplingParams(max_tokens=24, temperature=1.0, seed=8, ignore_eos=True))]
    alone = [engine.generate([prompt], params)[0] for prompt, params in asks]
    ids = [engine.add_request(prompt, params) for prompt, params in asks]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    for a, i in zip(alone, ids, strict=True):
        assert done[i].token_ids == a.token_ids
        batched, single = done[i].candidates[0].logprobs or [], a.candidates[0].logprobs or []
        # the forward's float32 sums differ in the last bits with the batch's size; the choice does not
        assert [[t for t, _, _ in lp.top] for lp in batched] == [[t for t, _, _ in lp.top] for lp in single]
        assert all(math.isclose(b.logprob, s.logprob, abs_tol=1e-5) for b, s in zip(batched, single, strict=True))


@pytest.mark.parametrize("constraint,words", [
    (Constraint("regex", "[a-"), "regex"),
    (Constraint("json_schema", "{not json"), "not valid JSON"),
    (Constraint("json_schema", "[1, 2]"), "must be an object"),
    (Constraint("lark", "start: 'a' undefined_rule"), "lark"),
])
def test_a_grammar_that_does_not_compile_is_a_bad_request(engine, constraint, words):
    with pytest.raises(BadRequest, match=words):
        engine.add_request("x", SamplingParams(constraint=constraint))
    assert not engine.requests


@pytest.mark.parametrize("kind,value", [("yaml", "x"), ("regex", ""), ("json_schema", "  ")])
def test_malformed_constraints_are_refused_when_built(kind, value):
    with pytest.raises(BadRequest):
        Constraint(kind, value)
