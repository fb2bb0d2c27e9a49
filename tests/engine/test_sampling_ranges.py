"""Every sampling field the protocol admits, drawn across its documented range with the edges
included (docs/protocol.md), never breaks sampling: on random logits (the sampler alone) and on
the default model (the engine, every field of a request together)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from daemon.wire import MAX_N, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from edge_runtime import Engine, SamplingParams
from edge_runtime.sampling import sample_next

TINY = 5e-324  # the smallest positive double the protocol's (0, x] ranges admit
temperatures = st.one_of(st.sampled_from([0.0, TINY, 1e-300, 1e-39, 1e-38, 1e-7, 1.0, 100.0]),
                         st.floats(min_value=TINY, max_value=100.0, allow_subnormal=True))
top_ps = st.one_of(st.sampled_from([TINY, 1e-300, 1e-39, 0.5, 1.0 - 1e-16, 1.0]),
                   st.floats(min_value=TINY, max_value=1.0, allow_subnormal=True))
top_ks = st.sampled_from([0, 1, 2, 50, 1023, 1024, 1025, 2**31 - 1])
seeds = st.one_of(st.none(), st.sampled_from([0, 2**63 - 1 - MAX_N]), st.integers(0, 2**63 - 1 - MAX_N))


@settings(max_examples=300, deadline=None)
@given(temperature=temperatures, top_p=top_ps, top_k=top_ks, seed=st.integers(0, 2**63 - 1),
       scale=st.sampled_from([1e-30, 1.0, 30.0, 1e4, 1e30]), ties=st.booleans())
@example(temperature=1e-39, top_p=1.0, top_k=0, seed=0, scale=1.0, ties=False)
@example(temperature=1.0, top_p=1e-300, top_k=0, seed=0, scale=1.0, ties=False)
@example(temperature=TINY, top_p=TINY, top_k=2**31 - 1, seed=0, scale=1e30, ties=True)
def test_sampler_returns_an_allowed_token_for_every_admitted_value(temperature, top_p, top_k, seed, scale,
                                                                    ties) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1024, generator=g) * scale
    if ties:
        logits[7] = logits[900] = logits.max() + abs(scale)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    token = sample_next(logits, params, torch.Generator().manual_seed(seed))
    assert 0 <= token < logits.numel()
    best = logits.max()
    if temperature == 0.0 or top_k == 1 or top_p <= 1e-300 or temperature <= 1e-300:
        # Greedy, or a cut that keeps only the best token (or its exact ties).
        assert logits[token] == best
    if top_k and top_k < logits.numel():
        assert logits[token] >= torch.topk(logits, top_k).values[-1]


def test_sampler_refuses_a_row_of_non_finite_logits_with_a_typed_error() -> None:
    from edge_runtime.sampling import SamplingError

    for bad in (torch.full((8,), float("nan")), torch.full((8,), float("-inf")),
                torch.tensor([0.0, float("nan"), 1.0])):
        with pytest.raises(SamplingError):
            sample_next(bad, SamplingParams(temperature=1.0), None)


@pytest.mark.slow
def test_every_sampling_field_across_its_range_on_the_default_model(default_model_dir: Path) -> None:
    engine = Engine.load(str(default_model_dir), dtype="float32", kv_cache_bytes=64 << 20)
    vocab = engine.model.cfg.vocab_size
    greedy = {}

    @settings(max_examples=16, deadline=None, suppress_health_check=list(HealthCheck))
    @given(temperature=temperatures, top_p=top_ps, top_k=top_ks, seed=seeds, n=st.sampled_from([1, 2, MAX_N]),
           max_tokens=st.integers(1, 3), ignore_eos=st.booleans(),
           stop=st.sampled_from([(), ("e",), ("x" * MAX_STOP_CHARS,) * MAX_STOP_STRINGS]),
           stop_token_ids=st.sampled_from([(), (0,), tuple(range(MAX_STOP_TOKEN_IDS)), (2**31 - 1,)]),
           prompt=st.sampled_from(["Hi", "What is the capital of France?", "Écris une phrase ✓"]))
    def generate(temperature, top_p, top_k, seed, n, max_tokens, ignore_eos, stop, stop_token_ids, prompt) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, n=n, stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
        out = engine.generate(prompt, params)[0]
        assert out.error is None and len(out.candidates) == n
        for c in out.candidates:
            assert c.finish_reason in ("stop", "length") and 0 < len(c.token_ids) <= max_tokens
            assert all(0 <= t < vocab for t in c.token_ids)
        if temperature <= 1e-300 or top_p <= 1e-300 or top_k == 1:
            # Only the best token survives: the greedy answer (the model has no exact ties here).
            key = (prompt, max_tokens, ignore_eos, stop, stop_token_ids)
            if key not in greedy:
                greedy[key] = engine.generate(prompt, SamplingParams(
                    max_tokens=max_tokens, stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos))[0].token_ids
            assert all(c.token_ids == greedy[key] for c in out.candidates)

    generate()
    assert engine.requests == {} and engine.pool.num_used == 0
