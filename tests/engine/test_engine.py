"""Engine behaviour on a tiny random llama: continuous batching, prefix caching, preemption,
chunked prefill, sampling, stopping, streaming and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_runtime import SamplingParams
from edge_runtime.chat import encode_prompt
from edge_runtime.errors import BadRequest, UnknownRequest
from edge_runtime.outputs import TokenEvent

from .helpers import make_engine

PROMPTS = [f"Prompt number {i}: tell me about the sea and the sky {'again ' * (i % 5)}" for i in range(16)]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def alone_outputs(tiny_model_dir: Path) -> list[list[int]]:
    engine = make_engine(tiny_model_dir, enable_prefix_cache=False)
    return [engine.generate(p, GREEDY)[0].token_ids for p in PROMPTS]


def test_greedy_outputs_batched_equal_each_prompt_alone(tiny_model_dir: Path, alone_outputs) -> None:
    engine = make_engine(tiny_model_dir, enable_prefix_cache=False)
    batched = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in batched] == alone_outputs
    assert all(len(o.token_ids) == 24 and o.candidates[0].finish_reason == "length" for o in batched)


def test_prefix_cache_hit_gives_identical_output_and_is_counted(tiny_model_dir: Path, alone_outputs) -> None:
    engine = make_engine(tiny_model_dir)
    first = engine.generate(PROMPTS[3], GREEDY)[0]
    second = engine.generate(PROMPTS[3], GREEDY)[0]
    assert first.token_ids == second.token_ids == alone_outputs[3]
    assert second.metrics.cached_prompt_tokens >= 8
    assert engine.stats()["prefix_cache_hit_rate"] > 0
    # A batch that shares a long system prompt reuses its blocks across requests.
    system = "You are a careful assistant. " * 6
    outs = engine.generate([system + p for p in PROMPTS[:4]], GREEDY)
    assert sum(o.metrics.cached_prompt_tokens for o in outs) > 0


def test_preemption_under_kv_pressure_keeps_greedy_outputs(tiny_model_dir: Path, alone_outputs) -> None:
    # Room for only a few sequences at once: the scheduler must preempt and recompute.
    engine = make_engine(tiny_model_dir, kv_cache_bytes=0, enable_prefix_cache=False)
    small = make_engine(tiny_model_dir, kv_cache_bytes=engine.cache.nbytes // engine.pool.num_blocks * 24,
                        enable_prefix_cache=False)
    outs = small.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == alone_outputs
    assert small.stats()["preemptions"] > 0
    assert small.pool.num_used == 0


@pytest.mark.parametrize("chunk", [5, 16])
def test_chunked_prefill_gives_identical_outputs(tiny_model_dir: Path, alone_outputs, chunk: int) -> None:
    engine = make_engine(tiny_model_dir, max_batched_tokens=chunk, enable_prefix_cache=False)
    outs = engine.generate(PROMPTS[:6], GREEDY)
    assert [o.token_ids for o in outs] == alone_outputs[:6]


def test_seeded_sampling_is_reproducible_and_candidates_differ(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=7, n=3, ignore_eos=True)
    a = engine.generate(PROMPTS[0], params)[0]
    b = engine.generate(PROMPTS[0], params)[0]
    assert [c.token_ids for c in a.candidates] == [c.token_ids for c in b.candidates]
    assert len({tuple(c.token_ids) for c in a.candidates}) == 3
    assert [c.index for c in a.candidates] == [0, 1, 2]


def test_candidates_share_the_prompt_blocks(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    prompt = "A long shared prompt for every candidate. " * 4
    out = engine.generate(prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=1, n=4, ignore_eos=True))[0]
    assert len(out.candidates) == 4
    assert engine.pool.stats.hit_blocks == 3 * ((len(out.prompt_token_ids) - 1) // engine.pool.block_size)


def test_stop_string_cuts_text_and_stream_never_shows_it(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    full = engine.generate(PROMPTS[1], SamplingParams(max_tokens=40, ignore_eos=True))[0].text
    stop = full[10:14]
    assert stop and stop in full
    pieces: list[str] = []
    events: list[TokenEvent] = []

    def on_token(event: TokenEvent) -> None:
        events.append(event)
        pieces.append(event.text)

    rid = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=40, stop=[stop], ignore_eos=True), on_token=on_token)
    out = None
    while engine.has_unfinished():
        for done in engine.step():
            out = done
    assert out.request_id == rid
    assert out.text == full[: full.index(stop)]
    assert "".join(pieces) == out.text
    assert events[-1].finished and events[-1].finish_reason == "stop"
    assert sum(e.finished for e in events) == 1


def test_stop_token_id_and_max_tokens_finish_reasons(tiny_model_dir: Path, alone_outputs) -> None:
    engine = make_engine(tiny_model_dir)
    target = alone_outputs[2][5]
    out = engine.generate(PROMPTS[2], SamplingParams(max_tokens=24, stop_token_ids=[target], ignore_eos=True))[0]
    first = alone_outputs[2].index(target)
    assert out.token_ids == alone_outputs[2][: first + 1]
    assert out.candidates[0].finish_reason == "stop"
    out = engine.generate(PROMPTS[2], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.candidates[0].finish_reason == "length"


def test_stream_yields_the_generated_text(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    whole = engine.generate(PROMPTS[4], GREEDY)[0].text
    assert "".join(engine.stream(PROMPTS[4], GREEDY)) == whole
    assert not engine.has_unfinished()


def test_incremental_detokenisation_is_utf8_safe(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    text = "Grüße, 世界! 🙂👍 naïve café"
    ids = engine.tokenizer.hf.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2  # byte-level tokens split the multi-byte characters
    decoder = engine.tokenizer.stream_decoder()
    pieces = [decoder.step(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_chat_messages_use_the_models_chat_template(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    out = engine.generate([[{"role": "user", "content": "Hi there"}]], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert out.prompt == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"


def test_bad_input_gets_typed_errors_and_leaves_engine_serving(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, max_context=64)
    with pytest.raises(BadRequest):
        engine.add_request("")
    with pytest.raises(BadRequest):
        engine.add_request(123)  # type: ignore[arg-type]
    with pytest.raises(BadRequest):
        engine.add_request([{"role": "user"}])
    with pytest.raises(BadRequest, match="tokens"):
        engine.add_request("word " * 200)
    with pytest.raises(BadRequest):
        SamplingParams(max_tokens=0)
    with pytest.raises(BadRequest):
        SamplingParams(top_p=0.0)
    with pytest.raises(BadRequest):
        engine.add_request("hello", request_id="bad id with spaces")
    engine.add_request("hello", request_id="dup")
    with pytest.raises(BadRequest):
        engine.add_request("hello", request_id="dup")
    with pytest.raises(UnknownRequest):
        engine.abort("nope")
    assert engine.abort("dup").candidates[0].finish_reason == "abort"
    assert engine.generate("still serving", SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids


def test_context_limit_finishes_with_length(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, max_context=40)
    prompt_len = len(encode_prompt(engine.tokenizer, PROMPTS[0])[1])
    out = engine.generate(PROMPTS[0], SamplingParams(max_tokens=500, ignore_eos=True))[0]
    assert prompt_len + len(out.token_ids) == 40
    assert out.candidates[0].finish_reason == "length"


def test_abort_frees_blocks_mid_generation(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, enable_prefix_cache=False)
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.pool.num_used > 0
    engine.abort(rid)
    assert engine.pool.num_used == 0 and not engine.has_unfinished()


def test_batched_greedy_pick_matches_per_row_argmax() -> None:
    """The engine's one-call greedy pick (numpy) chooses what `sample_next` (torch.argmax) does
    row by row, ties included (the first maximal index), and steps aside for other dtypes."""
    import torch

    from edge_runtime.commit import greedy_tokens as _greedy_tokens
    from edge_runtime.sampling import sample_next

    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0))
    logits[1, 10] = logits[1, 500] = logits[1].max() + 1.0  # a tie: the first index wins
    logits[2] = 0.0  # all equal
    greedy = SamplingParams()
    assert _greedy_tokens(logits) == [sample_next(row, greedy, None) for row in logits]
    assert _greedy_tokens(logits)[1] == 10 and _greedy_tokens(logits)[2] == 0
    assert _greedy_tokens(logits.to(torch.bfloat16)) is None
