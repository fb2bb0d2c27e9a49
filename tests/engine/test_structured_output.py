"""Structured output on the tiny random model: whatever a random model prefers, a grammar's mask
makes the text valid (JSON, a JSON schema, a regex), per sequence, and leaves the other rows of
the batch alone; grammars that do not compile are the request's error."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from edge_runtime import SamplingParams
from edge_runtime.constraints import Constraint
from edge_runtime.errors import BadRequest
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
