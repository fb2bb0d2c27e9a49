"""Greedy tokens that do not depend on how a position's keys/values were computed (#31): on ONNX
Runtime with the default model's q4_1 weights and `engine.deterministic`, a request preempted
mid-generation (its generated tokens recomputed as a prefill) and a chat's next turn served from
cached blocks of generated tokens answer exactly as the uninterrupted run and a fresh engine.
"""

from __future__ import annotations

import pytest

from edge_runtime import Engine, SamplingParams
from edge_runtime.backends.step_inputs import StepItem, pad_lone_row, plan_dense_step, plan_gqa_step

pytest.importorskip("onnxruntime")

PROMPTS = ["Write a short story about a lighthouse keeper and a cat.",
           "Explain in simple words why the sky is blue.",
           "List three ideas for a rainy weekend with children."]
FOLLOW_UP = " Continue."
TOKENS = 24


def _engine(prefix_cache: bool) -> Engine:
    return Engine.load(None, backend="onnxruntime", onnx_quantization="q4_1", cost_profile="off", speculation="off",
                       deterministic=True, enable_prefix_cache=prefix_cache)


def _greedy(engine: Engine, prompts: list, preempt_after: int | None = None) -> list:
    """Every prompt's greedy tokens, all in one continuous batch; with `preempt_after`, each
    request is preempted once it has generated that many tokens (its KV freed, so the tokens so
    far are computed again as a prefill when it resumes)."""
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done, preempted = {}, set()
    while engine.has_unfinished():
        for rid in ids:
            request = engine.requests.get(rid)
            if preempt_after is None or request is None or rid in preempted:
                continue
            seq = request.seqs[0]
            if seq in engine.scheduler.running and len(seq.token_ids) - seq.num_prompt >= preempt_after:
                engine.scheduler._preempt(seq)
                preempted.add(rid)
        for out in engine.step():
            done[out.request_id] = out
    if preempt_after is not None:
        assert preempted == set(ids)
    return [done[rid] for rid in ids]


def _tokens(outputs: list) -> list[list[int]]:
    return [o.candidates[0].token_ids for o in outputs]


def test_a_lone_decode_row_becomes_two_query_rows_whose_copy_leaves_no_trace():
    """The copy repeats the token one position on (where the rotary table has a row): it yields
    no logits and its key/value is not kept, in either KV layout's plan."""
    row = StepItem([7], 20, [0, 1], True)
    (padded,) = pad_lone_row([row], table_rows=64)
    assert (padded.tokens, padded.start, padded.pad) == ([7, 7], 20, 1)
    assert pad_lone_row([row], table_rows=21) == [row]  # position 21 has no rotary row
    assert pad_lone_row([row, row], table_rows=64) == [row, row]  # only a run of one sequence
    paged = plan_gqa_step([padded], block_size=16, num_kv_heads=2)
    assert paged.inputs["logit_rows"].tolist() == [0] and paged.real_rows.tolist() == [0]
    assert paged.slot_mapping.tolist() == [16 + 4] and paged.inputs["seqlens_k"].tolist() == [21]
    dense = plan_dense_step([padded], [False], block_size=16)
    assert dense.inputs["logit_rows"].tolist() == [0] and dense.real_positions.tolist() == [20]


@pytest.fixture(scope="module")
def fresh() -> Engine:
    """No prefix cache: every prompt computed whole, as on a fresh engine."""
    return _engine(prefix_cache=False)


@pytest.mark.slow
def test_a_preempted_request_continues_as_it_would_have(fresh: Engine):
    uninterrupted = _tokens(_greedy(fresh, PROMPTS))
    assert _tokens(_greedy(fresh, PROMPTS, preempt_after=9)) == uninterrupted


@pytest.mark.slow
def test_a_next_turn_from_cached_generated_tokens_answers_as_a_fresh_engine(fresh: Engine):
    warm = _engine(prefix_cache=True)
    first = [warm.tokenizer.encode(p) for p in PROMPTS]
    answers = _tokens(_greedy(warm, first))
    follow = warm.tokenizer.encode(FOLLOW_UP)
    second = [p + a + follow for p, a in zip(first, answers, strict=True)]
    served = _greedy(warm, second)
    # The cache served each first turn's generated tokens too (their full blocks), not its prompt alone.
    assert all(o.metrics.cached_prompt_tokens > len(p) for o, p in zip(served, first, strict=True))
    assert _tokens(served) == _tokens(_greedy(fresh, second))
