"""Logit bias, presence/frequency penalties and log-probabilities, against transformers' logits
for the same tokens with OpenAI's documented formula applied by hand:

    logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty
    logit[j] += logit_bias[j]

(counts over the generated tokens only), and log-probabilities the log-softmax of that row."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from edge_runtime import SamplingParams
from edge_runtime.errors import BadRequest
from edge_runtime.sampling import mask_rows, shape_logits, token_logprobs
from tests.engine.helpers import make_engine, reference_logits

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), local_files_only=True,
                                                dtype=torch.float32).eval()


def _openai_row(logits: torch.Tensor, generated: list[int], presence: float, frequency: float,
                bias: dict[int, float]) -> torch.Tensor:
    row = logits.clone().double()
    for token in set(generated):
        row[token] -= generated.count(token) * frequency + presence
    for token, b in bias.items():
        row[token] += b
    return row


def _reference_greedy(reference, prompt_ids, steps, presence=0.0, frequency=0.0, bias=None):
    ids, generated, rows = list(prompt_ids), [], []
    for _ in range(steps):
        row = _openai_row(reference_logits(reference, ids)[-1], generated, presence, frequency, bias or {})
        token = int(torch.argmax(row))
        rows.append(row)
        ids.append(token)
        generated.append(token)
    return generated, rows


def test_shape_logits_is_openais_formula():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(300, generator=gen)
    counts = {5: 3, 17: 1, 299: 2}
    bias = {5: 2.5, 0: -100.0, 42: 7.0}
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=-1.3, logit_bias=bias)
    generated = [t for t, n in counts.items() for _ in range(n)]
    expected = _openai_row(logits, generated, 0.7, -1.3, bias).float()
    assert torch.allclose(shape_logits(logits, params, counts), expected, atol=1e-5)
    allowed = torch.zeros(300, dtype=torch.bool)
    allowed[[5, 6]] = True
    masked = shape_logits(mask_rows(logits[None], [0], allowed[None])[0], params, counts)
    assert torch.isinf(masked[~allowed]).all() and torch.isfinite(masked[allowed]).all()


@pytest.mark.parametrize("presence,frequency,bias", [
    (0.0, 2.0, {}),  # a strong frequency penalty: greedy must leave a token once it repeats
    (-2.0, 0.0, {}),  # a negative presence penalty rewards repeats
    (0.5, 1.0, {7: 5.0, 9: -100.0}),
])
def test_greedy_with_penalties_and_bias_matches_the_reference(engine, reference, presence, frequency, bias):
    prompt_ids = engine.tokenizer.hf.encode(PROMPT)
    params = SamplingParams(max_tokens=16, ignore_eos=True, presence_penalty=presence,
                            frequency_penalty=frequency, logit_bias=bias)
    [out] = engine.generate([PROMPT], params)
    expected, _ = _reference_greedy(reference, prompt_ids, 16, presence, frequency, bias)
    assert out.token_ids == expected
    assert 9 not in out.token_ids or 9 not in bias


def test_logprobs_are_the_log_softmax_of_the_shaped_row(engine, reference):
    prompt_ids = engine.tokenizer.hf.encode(PROMPT)
    bias = {11: 3.0}
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=4, frequency_penalty=0.8, logit_bias=bias)
    [out] = engine.generate([PROMPT], params)
    expected, rows = _reference_greedy(reference, prompt_ids, 10, 0.0, 0.8, bias)
    assert out.token_ids == expected
    logprobs = out.candidates[0].logprobs
    assert [lp.token_id for lp in logprobs] == expected
    for lp, row in zip(logprobs, rows, strict=True):
        ref = torch.log_softmax(row, dim=-1)
        assert math.isclose(lp.logprob, float(ref[lp.token_id]), abs_tol=1e-5)
        assert [t for t, _, _ in lp.top] == torch.topk(ref, 4).indices.tolist()
        assert all(math.isclose(v, float(ref[t]), abs_tol=1e-5) for t, v, _ in lp.top)
        assert lp.bytes == engine.grammars.token_bytes(lp.token_id)
        assert lp.top[0][1] >= lp.logprob  # greedy: the chosen token is the most likely


def test_logprobs_zero_gives_the_chosen_token_only_and_none_gives_nothing(engine):
    [zero] = engine.generate([PROMPT], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0))
    assert [lp.top for lp in zero.candidates[0].logprobs] == [[], [], [], []]
    [none] = engine.generate([PROMPT], SamplingParams(max_tokens=4, ignore_eos=True))
    assert none.candidates[0].logprobs is None


def test_streamed_events_carry_the_logprobs(engine):
    events = []
    engine.add_request(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True, logprobs=1), on_token=events.append)
    while engine.has_unfinished():
        engine.step()
    assert [e.logprob.token_id for e in events] == [e.token_id for e in events]


def test_a_plus_100_bias_forces_a_token_and_minus_100_bans_one(engine):
    [forced] = engine.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={33: 100}))
    assert forced.token_ids == [33] * 6
    [free] = engine.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))
    banned = free.token_ids[0]
    [out] = engine.generate([PROMPT], SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0, seed=2,
                                                     logit_bias={banned: -100}))
    assert banned not in out.token_ids


def test_token_logprobs_leave_out_ruled_out_tokens():
    row = torch.tensor([0.0, float("-inf"), 1.0, float("-inf")])
    chosen, top = token_logprobs(row, 2, 4)
    assert [t for t, _ in top] == [2, 0] and math.isclose(chosen, -math.log1p(math.exp(-1)))


# The protocol's bounds (21 logprobs, a penalty of 2.5, a bias of 101, 1025 biased tokens) are
# the request schema's (tests/daemon/test_schema.py, on both transports); the engine refuses
# only what would break its arithmetic.
@pytest.mark.parametrize("kwargs", [
    {"logprobs": -1}, {"logprobs": True}, {"frequency_penalty": float("nan")},
    {"presence_penalty": float("inf")}, {"logit_bias": {1: float("nan")}}, {"logit_bias": {-1: 1}},
    {"logit_bias": {"x": 1}},
])
def test_out_of_range_shaping_is_a_bad_request(kwargs):
    with pytest.raises(BadRequest):
        SamplingParams(**kwargs)


def test_a_bias_on_a_token_outside_the_vocabulary_is_a_bad_request(engine):
    with pytest.raises(BadRequest, match="vocabulary"):
        engine.add_request(PROMPT, SamplingParams(logit_bias={engine.model.cfg.vocab_size: 1.0}))
