"""Prefix reuse down to the token through the engine, on a backend whose rows are invariant today
(torch on the CPU with `engine.deterministic`): a repeated prompt computes its last row alone, a
chat's next turn reuses the previous answer's rows, a prompt diverging mid-block reuses the rows
before it; every sampling step's logits equal a cold engine's to the bit. Elsewhere (ONNX
Runtime, torch without it) reuse stays on whole blocks and never the last two tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edge_runtime import Engine, SamplingParams
from tests.backends.helpers import run_spying

from .helpers import make_engine

STEPS = 4
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
PROMPT = [(7 * i + 3) % 200 + 5 for i in range(37)]  # 2 full blocks of 16 and 5 rows


def _engine(model_dir: Path, **overrides) -> Engine:
    return make_engine(model_dir, backend="torch", deterministic=True, block_size=16, speculation="off",
                       policy="fcfs", **overrides)


def _run(engine: Engine, prompt: list) -> tuple[list[int], torch.Tensor, int, int]:
    """(greedy tokens, every sampling step's logits, cached prompt tokens, rows the model ran)."""
    logits: list[torch.Tensor] = []
    rows = [0]

    def on_step(batch, out: torch.Tensor) -> None:
        rows[0] += sum(item.num_tokens for item in batch.items)
        logits.extend(out.detach().float().cpu().clone())

    (out,) = run_spying(engine, [prompt], [None], GREEDY, on_step)
    return out.candidates[0].token_ids, torch.stack(logits), out.metrics.cached_prompt_tokens, rows[0]


@pytest.fixture(scope="module")
def cold(tiny_model_dir: Path) -> Engine:
    return _engine(tiny_model_dir, enable_prefix_cache=False)


@pytest.fixture(scope="module")
def warm(tiny_model_dir: Path) -> Engine:
    engine = _engine(tiny_model_dir)
    assert engine.stats()["deterministic"] and engine.scheduler.copy_rows is not None
    return engine


def _same(a, b) -> bool:
    return a[0] == b[0] and torch.equal(a[1], b[1])


def test_a_repeated_prompt_computes_only_its_last_row(cold: Engine, warm: Engine):
    reference = _run(cold, PROMPT)
    first = _run(warm, PROMPT)
    again = _run(warm, PROMPT)
    assert _same(first, reference) and _same(again, reference)
    assert again[2] == len(PROMPT) - 1 and again[3] == 1 + (STEPS - 1)
    assert warm.stats()["prefix_cache_partial_rows"] >= len(PROMPT) - 1 - 32


def test_a_next_turn_reuses_the_previous_answers_rows(cold: Engine, warm: Engine):
    prompt = [(5 * i + 11) % 200 + 5 for i in range(45)]
    answer = _run(warm, prompt)[0]
    follow = [9, 8, 7, 6, 5]
    turn = prompt + answer + follow
    got = _run(warm, turn)
    assert _same(got, _run(cold, turn))
    # The answer's last token never ran through the model: every row before it is reused.
    assert got[2] == len(prompt) + len(answer) - 1 and got[3] == len(follow) + 1 + (STEPS - 1)


def test_a_prompt_diverging_mid_block_reuses_the_rows_before(cold: Engine, warm: Engine):
    base = [(3 * i + 1) % 200 + 5 for i in range(40)]
    _run(warm, base)
    diverging = base[:21] + [4, 4, 4, 4, 4, 4, 4]
    got = _run(warm, diverging)
    assert _same(got, _run(cold, diverging))
    assert got[2] == 21


def test_without_invariant_rows_reuse_stays_on_whole_blocks(tiny_model_dir: Path):
    engine = make_engine(tiny_model_dir, backend="torch", deterministic=False, block_size=16, speculation="off")
    assert engine.scheduler.copy_rows is None
    _run(engine, PROMPT)
    again = _run(engine, PROMPT)
    assert again[2] == 32 and engine.stats()["prefix_cache_partial_hits"] == 0



def test_a_chats_next_turn_on_the_default_model_answers_as_a_cold_engine(default_model_dir: Path):
    """The real chat template: turn 2 resends turn 1 and its answer as text, re-tokenized."""
    settings = dict(dtype="float32", device="cpu", kv_cache_bytes=64 << 20, backend="torch", deterministic=True,
                    speculation="off", cost_profile="off", policy="fcfs")
    warm = Engine.load(None, **settings)
    cold = Engine.load(None, enable_prefix_cache=False, **settings)
    turn1 = [{"role": "user", "content": "Name three rivers in Europe and say where each one meets the sea."}]
    (first,) = run_spying(warm, [turn1], [None], GREEDY, lambda batch, out: None)
    turn2 = turn1 + [{"role": "assistant", "content": first.candidates[0].text},
                     {"role": "user", "content": "And one in Asia?"}]
    reference = _run(cold, turn2)
    ids = cold.generate([turn2], SamplingParams(max_tokens=1))[0].prompt_token_ids
    computed = first.prompt_token_ids + first.candidates[0].token_ids[:-1]  # rows turn 1 left in the cache
    shared = next(i for i, (a, b) in enumerate(zip(computed + [-1], ids, strict=False)) if a != b)
    assert shared > len(first.prompt_token_ids)  # the template resends the answer as it was generated
    got = _run(warm, turn2)
    assert _same(got, reference) and got[2] == min(shared, len(ids) - 1)
    again = _run(warm, turn2)  # now all but the last token comes from the cache
    assert _same(again, reference) and again[2] == len(ids) - 1
