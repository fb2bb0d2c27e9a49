"""Greedy is greedy (issue #31), in-process on the default model: the same chat gets the same greedy
tokens and logits, bit for bit, alone, repeated (the second time from the prefix cache), in batches of 3 and 16 beside
other requests of other lengths, under the MACE policy with cost calibration off and with the cost
estimates another machine would have (x0.25, x4), with a token budget one row short of the prompt,
on torch and on ONNX Runtime (q4_1, the default backend's format). The reference is each chat
alone, in one chunk, with no prefix cache."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from edge_runtime import Engine, SamplingParams
from edge_runtime.lora import LoraSettings
from tests.backends.helpers import ALL_LINEAR, random_adapter, run_spying

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
_WORDS = ("Rivers carry water from the mountains to the sea, shaping valleys, feeding farms and cities, "
          "and moving sand and stones over thousands of years. ").split()
# Chats from a few tokens to a few hundred (the MACE policy chunks the long ones by estimated cost).
SUBJECTS = ["What is the capital of Italy?", "Summarise: " + " ".join(_WORDS * 2),
            "Translate into French: " + " ".join(_WORDS * 6)]
# 49 tokens once templated (16k + 1): a prefix hit, or a budget one row short, left its last row
# to run alone (on ONNX Runtime through the decode path's attention, which rounds otherwise).
GRID_PLUS_ONE = "Name three rivers in Europe and say where each one meets the sea, in one line each."
OTHERS = ["Write a haiku about " + " ".join(_WORDS[i : i + 1 + i % 4]) for i in range(16)]
# A TBT SLO of its own, so scaled estimates change how much prefill fits one iteration.
SETTINGS = dict(dtype="float32", device="cpu", kv_cache_bytes=64 << 20, policy="mace", cost_profile="off",
                slo_tbt_ms=10.0, deterministic=True)
BACKENDS = {"torch": {}, "onnxruntime": {"onnx_quantization": "q4_1"}}


def _chats(prompts: list[str]) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": p}] for p in prompts]


def _engine(backend: str, scale: float | None = None, **overrides) -> Engine:
    engine = Engine.load(None, backend=backend, **{**SETTINGS, **BACKENDS[backend], **overrides})
    if scale is not None:  # what another machine's calibration would have given
        f = engine.costs.forward
        engine.costs.forward = dataclasses.replace(f, base_s=f.base_s * scale, token_s=f.token_s * scale,
                                                   attend_s=f.attend_s * scale, logit_s=f.logit_s * scale)
    return engine


def _tokens(engine: Engine, prompts: list[str], users: list[str | None] | None = None
            ) -> list[tuple[list[int], torch.Tensor]]:
    """Each chat's greedy tokens and its every sampling step's logits: a near-tie flips a token
    only now and then, a moved rounding shows in the logits at once."""
    rows: dict[str, list[torch.Tensor]] = {}

    def on_step(batch, out: torch.Tensor) -> None:
        # A decode row with a draft (ONNX Runtime speculates by default) yields a row per draft
        # token after its own; whether a draft fits a bin follows the measured step times, so
        # under load it comes and goes: its first row is the one every run has.
        sampling = [i for i in batch.items if i.samples]
        for item, part in zip(sampling, out.split([i.num_logits for i in sampling]), strict=True):
            rows.setdefault(item.seq.request.request_id, []).append(part[0].detach().float().cpu().clone())

    outs = run_spying(engine, _chats(prompts), users or [None] * len(prompts), GREEDY, on_step)
    return [(o.candidates[0].token_ids, torch.stack(rows[o.request_id])) for o in outs]


def _same(a: tuple[list[int], torch.Tensor], b: tuple[list[int], torch.Tensor]) -> bool:
    return a[0] == b[0] and torch.equal(a[1], b[1])


@pytest.fixture(scope="module", params=list(BACKENDS))
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "onnxruntime":
        pytest.importorskip("onnxruntime")
    return request.param


@pytest.fixture(scope="module")
def reference(backend: str, default_model_dir: Path) -> list:
    """Each chat alone, in one chunk, nothing cached."""
    engine = _engine(backend, policy="fcfs", max_batched_tokens=4096, enable_prefix_cache=False)
    return [_tokens(engine, [p])[0] for p in SUBJECTS]


def _disagreements(engine: Engine, expected: list, batched: bool = True) -> list[str]:
    """Which runs of the subjects got other tokens or logits than `expected`."""
    bad = []
    for rep in range(2):  # alone, and again (now resuming from the prefix cache)
        bad += [f"alone#{rep} {i}" for i, p in enumerate(SUBJECTS) if not _same(_tokens(engine, [p])[0], expected[i])]
    if batched:
        got = _tokens(engine, SUBJECTS)
        bad += [f"batch3 {k}" for k, t in enumerate(got) if not _same(t, expected[k])]
        mixed = OTHERS[:7] + SUBJECTS + OTHERS[7 : 16 - len(SUBJECTS)]
        got = _tokens(engine, mixed)[7 : 7 + len(SUBJECTS)]
        bad += [f"batch16 {k}" for k, t in enumerate(got) if not _same(t, expected[k])]
    return bad


def test_greedy_tokens_do_not_depend_on_load_chunking_or_batch(backend, reference):
    # Calibration off: the nominal cost estimates chunk the long chats.
    assert _disagreements(_engine(backend), reference) == []


@pytest.mark.slow
@pytest.mark.parametrize("scale", [0.25, 4.0])
def test_greedy_tokens_do_not_depend_on_cost_estimates(backend, reference, scale):
    assert _disagreements(_engine(backend, scale), reference) == []


def test_base_rows_do_not_depend_on_other_users_adapter_rows(backend, reference):
    engine = _engine(backend)
    settings = LoraSettings(rank=4, alpha=8, target_modules=ALL_LINEAR)
    engine.publish_adapter("alice", random_adapter(engine.model.cfg, settings, seed=1))
    got = _tokens(engine, OTHERS[:2] + SUBJECTS, ["alice"] * 2 + [None] * len(SUBJECTS))[2:]
    assert [k for k, t in enumerate(got) if not _same(t, reference[k])] == []


def test_a_prompts_last_row_never_runs_alone(backend, default_model_dir):
    """Fails on main before the grid (8dbd47d) on ONNX Runtime, at any load: a token budget one
    row short of the prompt, or a repeat resuming from the prefix cache, left the last row to a
    forward of its own."""
    expected = _tokens(_engine(backend, policy="fcfs", max_batched_tokens=4096, enable_prefix_cache=False),
                       [GRID_PLUS_ONE])[0]
    short = _engine(backend, policy="fcfs", max_batched_tokens=48)
    bad = [f"budget 48, run {rep}" for rep in range(2) if not _same(_tokens(short, [GRID_PLUS_ONE])[0], expected)]
    assert bad == []



@pytest.mark.parametrize("repeats", [(0, 2), pytest.param((12, 24), marks=pytest.mark.slow)],
                         ids=["under-16-keys", "past-300-keys"])
def test_a_decode_rows_logits_do_not_depend_on_the_contexts_beside_it(default_model_dir, repeats):
    """Torch only: its decode rows attend in one call padded to the longest context among them.
    Fails on cb9c6d6 at any load (logits moved by 2.5e-5 and 3.5e-5): the softmax rounds a row of
    under 16 keys otherwise once padded past 16, and the weighted sum's GEMM splits a 337-key
    row's reduction by the length of the 673-key row beside it. Raw prompts: 2 tokens beside 57,
    337 beside 673."""
    engine = _engine("torch", policy="fcfs", max_batched_tokens=1024, enable_prefix_cache=False)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = [" ".join(_WORDS * n) if n else _WORDS[0] for n in repeats]

    def logits(batch: list[str]) -> torch.Tensor:
        rows: dict[str, list[torch.Tensor]] = {}

        def on_step(step, out: torch.Tensor) -> None:
            for item, row in zip((i for i in step.items if i.samples), out, strict=True):
                rows.setdefault(item.seq.request.request_id, []).append(row.clone())

        outs = run_spying(engine, batch, [None] * len(batch), params, on_step)
        return torch.stack(rows[outs[0].request_id])

    assert torch.equal(logits(prompts), logits(prompts[:1]))
