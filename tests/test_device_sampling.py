"""Sampling on the logits' device (edge_runtime.device_sampling, issue #33 item 2), run on CPU
tensors against the host path (edge_runtime.sampling): the same greedy tokens, shaped rows,
supports, distribution and log-probabilities; counter-based draws that do not follow the batch;
and whole requests through an Engine with `device_sampling="on"` (grammars, speculation)."""

from __future__ import annotations

import json

import pytest
import torch

from edge_runtime import Engine, SamplingParams
from edge_runtime.commit import sampling_key
from edge_runtime.constraints import Constraint
from edge_runtime.device_sampling import NOT_FINITE, RowChoice, choose_rows, row_scores, shape_rows
from edge_runtime.sampling import SamplingError, sampling_probs, shape_logits, token_logprobs

V = 64


def _logits(rows: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _mixed_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=t, top_k=k, top_p=p, logprobs=lp, logit_bias=b,
                           presence_penalty=pp, frequency_penalty=fp)
            for t in (0.0, 0.7, 1.3) for k, p in ((0, 1.0), (5, 1.0), (0, 0.8), (7, 0.6), (V + 3, 0.95))
            for lp, b, pp, fp in ((None, (), 0.0, 0.0), (3, ((2, 4.0), (9, -1.5), (2, 0.25)), 0.4, 0.3))]


COUNTS = {2: 3, 5: 1, 40: 2}


def test_greedy_tokens_equal_the_host_argmax_ties_included():
    logits = _logits(16)
    logits[3, [7, 20]] = 50.0  # a tie: the first maximal index, as torch.argmax
    rows = [RowChoice(i, SamplingParams()) for i in range(16)]
    assert [c.token for c in choose_rows(logits, rows)] == logits.argmax(dim=1).tolist()


def test_shaped_rows_equal_shape_logits_bit_for_bit():
    logits = _logits(len(_mixed_params()))
    rows = [RowChoice(i, p, COUNTS) for i, p in enumerate(_mixed_params())]
    shaped = shape_rows(logits, rows)
    for i, r in enumerate(rows):
        assert torch.equal(shaped[i], shape_logits(logits[i], r.params, COUNTS))


def test_supports_and_distribution_equal_sampling_probs():
    params = [p for p in _mixed_params() if not p.greedy]
    logits = _logits(len(params), seed=1)
    rows = [RowChoice(i, p, COUNTS) for i, p in enumerate(params)]
    probs = torch.softmax(row_scores(logits, rows), dim=1)
    for i, r in enumerate(rows):
        ref = sampling_probs(shape_logits(logits[i], r.params, COUNTS), r.params)
        assert torch.equal(probs[i] > 0, ref > 0)
        assert torch.allclose(probs[i], ref, atol=1e-12)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=6),
                                    SamplingParams(temperature=1.2, top_p=0.7)])
def test_the_draws_follow_sampling_probs(params):
    # Fixed keys and steps: the draws are a pure function of them, so this cannot flake.
    logits = _logits(1, seed=2, vocab=24)
    ref = sampling_probs(logits[0], params)
    draws = 20_000
    seen = torch.zeros(24, dtype=torch.float64)
    for start in range(0, draws, 2_000):
        rows = [RowChoice(0, params, {}, key=7, step=s) for s in range(start, start + 2_000)]
        for c in choose_rows(logits, rows):
            seen[c.token] += 1
    assert (seen[ref == 0] == 0).all()
    assert 0.5 * (seen / draws - ref).abs().sum() < 0.02  # total variation; sampling error ~0.01


def test_a_seeded_row_draws_the_same_token_alone_and_in_a_batch_of_8():
    logits = _logits(8, seed=3)
    mine = RowChoice(5, SamplingParams(temperature=1.0, top_p=0.9, seed=11), {}, key=11, step=4)
    others = [RowChoice(i, p, COUNTS, key=100 + i, step=i) for i, p in zip(range(8), _mixed_params()[5:], strict=False)
              if i != 5]
    alone = [choose_rows(logits, [mine])[0].token for _ in range(2)]
    batched = choose_rows(logits, others[:3] + [mine] + others[3:])[3].token
    assert alone == [batched, batched]
    # Another step or another key gives another draw somewhere over a few steps.
    later = [choose_rows(logits, [RowChoice(5, mine.params, {}, key=11, step=s)])[0].token for s in range(4, 12)]
    assert len(set(later)) > 1


def test_logprobs_equal_token_logprobs():
    params = [p for p in _mixed_params() if p.logprobs is not None]
    logits = _logits(len(params), seed=4)
    rows = [RowChoice(i, p, COUNTS, key=i) for i, p in enumerate(params)]
    for i, c in enumerate(choose_rows(logits, rows)):
        chosen, top = token_logprobs(shape_logits(logits[i], params[i], COUNTS), c.token, params[i].logprobs)
        assert abs(c.logprobs[0] - chosen) < 1e-5
        assert [t for t, _ in c.logprobs[1]] == [t for t, _ in top]
        assert all(abs(a - b) < 1e-5 for (_, a), (_, b) in zip(c.logprobs[1], top, strict=True))


def test_edge_values_pick_as_the_host_does():
    logits = _logits(1, seed=5)
    best = int(logits[0].argmax())
    for params in (SamplingParams(temperature=5e-324), SamplingParams(temperature=1.0, top_p=5e-324),
                   SamplingParams(temperature=3.0, top_k=1)):
        assert {choose_rows(logits, [RowChoice(0, params, {}, key=s)])[0].token for s in range(20)} == {best}
    wide = SamplingParams(temperature=1.0, top_k=V)
    assert torch.equal(row_scores(logits, [RowChoice(0, wide, {})]),
                       row_scores(logits, [RowChoice(0, SamplingParams(temperature=1.0), {})]))
    forced = SamplingParams(temperature=1.0, logit_bias={9: 100.0})
    assert {choose_rows(logits, [RowChoice(0, forced, {}, key=s)])[0].token for s in range(20)} == {9}
    banned = SamplingParams(temperature=50.0, logit_bias={best: -100.0})
    assert best not in {choose_rows(logits, [RowChoice(0, banned, {}, key=s)])[0].token for s in range(200)}


def test_a_non_finite_sampled_row_fails_alone_and_a_greedy_one_does_not():
    logits = _logits(4, seed=6)
    logits[1, 3] = float("nan")
    logits[2, 0] = float("inf")
    logits[3, 5] = float("nan")
    rows = [RowChoice(0, SamplingParams(temperature=1.0), {}), RowChoice(1, SamplingParams(temperature=1.0), {}),
            RowChoice(2, SamplingParams(temperature=0.5, top_p=0.5), {}), RowChoice(3, SamplingParams(), {})]
    out = choose_rows(logits, rows)
    assert out[0].error is None and out[3].error is None
    assert out[1].error == NOT_FINITE and out[2].error == NOT_FINITE
    with pytest.raises(SamplingError, match=NOT_FINITE):  # the host's words for the same row
        sampling_probs(logits[1], rows[1].params)


def test_a_bias_past_the_vocabulary_fails_its_row_without_touching_the_device():
    out = choose_rows(_logits(2), [RowChoice(0, SamplingParams(logit_bias={V: 1.0}), {}), RowChoice(1, SamplingParams())])
    assert out[0].error and "vocabulary" in out[0].error and out[1].error is None


def test_a_step_costs_the_same_torch_calls_for_1_row_as_for_16():
    class Count(torch.overrides.TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    def calls(n: int) -> int:
        rows = [RowChoice(i, SamplingParams(temperature=0.8, top_k=5, top_p=0.9, logprobs=2, logit_bias={1: 2.0},
                                            presence_penalty=0.5), {3: 1}, key=i) for i in range(n)]
        logits = _logits(n)
        Count.calls = 0
        with Count():
            choose_rows(logits, rows)
        return Count.calls

    assert calls(1) == calls(16) < 160  # host-side packing and views included


# Whole requests through the tiny model's engine, the device path forced on for CPU logits.

def _engine(tiny_model_dir, **overrides) -> Engine:
    settings = dict(dtype="float32", kv_cache_bytes=8 << 20, block_size=8, backend="torch", cost_profile="off",
                    deterministic=True)
    settings.update(overrides)
    return Engine.load(str(tiny_model_dir), **settings)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    return {mode: _engine(tiny_model_dir, device_sampling=mode) for mode in ("off", "on")}


PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "Hello there", "abc abc abc"]


def _outs(engine: Engine, params: SamplingParams, prompts=PROMPTS):
    return [[(c.token_ids, c.text, c.finish_reason) for c in out.candidates] for out in engine.generate(prompts, params)]


def test_greedy_output_with_the_device_path_equals_the_host_path(engines):
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2, presence_penalty=0.3, logit_bias={5: 1.5})
    assert _outs(engines["on"], params) == _outs(engines["off"], params)
    assert engines["on"].committer.sampling_stats["device_rows"] > 0
    assert engines["off"].committer.sampling_stats["device_rows"] == 0


def test_seeded_sampling_is_reproducible_and_candidates_differ(engines):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=5, n=2, ignore_eos=True)
    first = _outs(engines["on"], params)
    assert first == _outs(engines["on"], params)
    alone = _outs(engines["on"], params, PROMPTS[:1])
    assert alone[0] == first[0]  # the other prompts' rows beside it changed nothing
    assert all(out[0][0] != out[1][0] for out in first)


def test_sampling_keys_are_the_seed_plus_the_candidate_index(engines):
    engine = engines["on"]
    engine.add_request("hi", SamplingParams(max_tokens=1, temperature=1.0, seed=40, n=2))
    seqs = list(engine.requests.values())[-1].seqs
    assert [sampling_key(s) for s in seqs] == [40, 41]
    while engine.has_unfinished():
        engine.step()


def test_constrained_and_speculative_rows_go_the_host_way_with_the_same_output(tiny_model_dir, engines):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    constrained = SamplingParams(max_tokens=300, temperature=0.7, seed=2, n=2, constraint=Constraint.json_schema(schema))
    on = _outs(engines["on"], constrained)
    assert on == _outs(engines["on"], constrained)  # reproducible
    ended = [c for out in on for c in out if c[2] == "stop"]
    assert ended and all(json.loads(c[1]) in ({"ok": True}, {"ok": False}) for c in ended)
    greedy_constrained = SamplingParams(max_tokens=40, constraint=Constraint("regex", r"[a-c]{3,9}"))
    assert _outs(engines["on"], greedy_constrained) == _outs(engines["off"], greedy_constrained)
    assert engines["on"].committer.sampling_stats["host_rows_grammar"] > 0
    spec = {mode: _engine(tiny_model_dir, device_sampling=mode, speculation="on") for mode in ("off", "on")}
    greedy = SamplingParams(max_tokens=24, ignore_eos=True, speculation="on")
    assert _outs(spec["on"], greedy) == _outs(spec["off"], greedy)
    assert spec["on"].committer.sampling_stats["host_rows_speculative"] > 0
    seeded = SamplingParams(max_tokens=24, temperature=0.8, seed=9, ignore_eos=True, speculation="on")
    assert _outs(spec["on"], seeded) == _outs(spec["on"], seeded)


def test_a_non_finite_row_fails_its_request_alone_through_the_engine(engines):
    engine = engines["on"]
    execute = engine.backend.execute

    def poisoned(batch, *args, **kwargs):
        out = execute(batch, *args, **kwargs).clone()
        at = 0
        for item in (i for i in batch.items if i.samples):
            if item.seq.request.prompt == PROMPTS[0]:
                out[at] = float("nan")
            at += item.num_logits
        return out

    engine.backend.execute = poisoned
    try:
        outs = engine.generate(PROMPTS[:2], SamplingParams(max_tokens=3, temperature=1.0, seed=1))
    finally:
        engine.backend.execute = execute
    assert outs[0].error and NOT_FINITE in outs[0].error
    assert outs[1].error is None and len(outs[1].candidates[0].token_ids) == 3


def test_a_device_that_fails_sends_its_rows_to_the_host(engines, monkeypatch):
    import edge_runtime.commit as commit

    def broken(logits, rows):
        raise RuntimeError("no kernel image is available")

    monkeypatch.setattr(commit, "choose_rows", broken)
    engine = engines["on"]
    monkeypatch.setattr(engine.committer, "device_sampling", "on")
    before = dict(engine.committer.sampling_stats)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    assert _outs(engine, params) == _outs(engines["off"], params)
    stats = engine.committer.sampling_stats
    assert stats["device_failures"] == before["device_failures"] + 1  # once: the host chooses from then on
    assert "no kernel image" in stats["last_device_failure"] and engine.committer.device_sampling == "off"


def test_auto_keeps_cpu_logits_on_the_host_path_and_a_wrong_setting_is_refused(tiny_model_dir):
    engine = _engine(tiny_model_dir)  # device_sampling "auto", the default
    engine.generate(PROMPTS[:1], SamplingParams(max_tokens=3))
    stats = engine.committer.sampling_stats
    assert stats["device_rows"] == 0 and stats["host_rows"] == 3
    with pytest.raises(ValueError, match="device_sampling"):
        _engine(tiny_model_dir, device_sampling="gpu")
