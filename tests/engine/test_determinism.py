"""Greedy is greedy (issue #31): the same request gets the same greedy tokens alone, repeated and
in batches of 3 and 16 beside other requests, under the MACE policy, with cost calibration off
and with the cost estimates another machine would have (x0.25, x4), on torch and ONNX Runtime:
the tokens and every sampling step's logits, bit for bit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from edge_runtime import Engine, SamplingParams
from tests.backends.helpers import PROMPTS, run_spying

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# Prompts from under one chunk to several: the MACE policy chunks the long ones by estimated cost.
SUBJECTS = [PROMPTS[i] + " " + " ".join(PROMPTS[j % len(PROMPTS)] for j in range(i, i + reps))
            for i, reps in ((0, 0), (1, 3), (2, 7), (3, 12), (4, 18), (5, 25))]
OTHERS = [" ".join(PROMPTS[(i + j) % len(PROMPTS)] for j in range(1 + 3 * (i % 6))) for i in range(16)]
# A TBT SLO of its own, so scaled estimates change how much prefill fits one iteration.
SETTINGS = dict(dtype="float32", kv_cache_bytes=16 << 20, block_size=8, max_batched_tokens=128,
                policy="mace", cost_profile="off", slo_tbt_ms=15.0, device="cpu")


def _engine(model_dir: Path, backend: str, scale: float | None, onnx_dir: Path) -> Engine:
    extra = {"onnx_cache_dir": str(onnx_dir)} if backend == "onnxruntime" else {}
    engine = Engine.load(str(model_dir), backend=backend, **SETTINGS, **extra)
    if scale is not None:  # what another machine's calibration would have given
        f = engine.costs.forward
        engine.costs.forward = dataclasses.replace(f, base_s=f.base_s * scale, token_s=f.token_s * scale,
                                                   attend_s=f.attend_s * scale, logit_s=f.logit_s * scale)
    return engine


def _tokens(engine: Engine, prompts: list[str]) -> list[tuple[list[int], torch.Tensor]]:
    """Each prompt's greedy tokens and the logits of its every sampling step, bit for bit: a
    near-tie flips a token only now and then, a moved rounding shows in the logits at once."""
    rows: dict[str, list[torch.Tensor]] = {}

    def on_step(batch, out: torch.Tensor) -> None:
        for item, row in zip((i for i in batch.items if i.samples), out, strict=True):
            rows.setdefault(item.seq.request.request_id, []).append(row.detach().float().cpu().clone())

    outs = run_spying(engine, prompts, [None] * len(prompts), GREEDY, on_step)
    return [(o.candidates[0].token_ids, torch.stack(rows[o.request_id])) for o in outs]


def _same(a: tuple[list[int], torch.Tensor], b: tuple[list[int], torch.Tensor], bitwise: bool = True) -> bool:
    return a[0] == b[0] and (not bitwise or torch.equal(a[1], b[1]))


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("onnx")


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, onnx_dir: Path) -> dict[str, list]:
    """Each subject alone on an engine with nominal costs, per backend."""
    refs = {}
    for backend in ("torch", "onnxruntime"):
        if backend == "onnxruntime":
            pytest.importorskip("onnxruntime")
        engine = _engine(tiny_model_dir, backend, None, onnx_dir)
        refs[backend] = [_tokens(engine, [p])[0] for p in SUBJECTS]
    return refs


def _check(engine: Engine, expected: list, alone: bool = True, batched: bool = True, bitwise: bool = True) -> list[str]:
    """Which runs of the subjects disagreed with `expected`."""
    bad = []
    for rep in range(2 if alone else 0):  # alone, and again (with the prefix cache warm)
        for i, p in enumerate(SUBJECTS):
            if not _same(_tokens(engine, [p])[0], expected[i], bitwise):
                bad.append(f"alone#{rep} {i}")
    if batched:
        for start in (0, 3):
            got = _tokens(engine, SUBJECTS[start : start + 3])
            bad += [f"batch3 {start + k}" for k, t in enumerate(got) if not _same(t, expected[start + k], bitwise)]
        mixed = SUBJECTS + OTHERS[: 16 - len(SUBJECTS)]
        got = _tokens(engine, mixed)[: len(SUBJECTS)]
        bad += [f"batch16 {k}" for k, t in enumerate(got) if not _same(t, expected[k], bitwise)]
    return bad


SCALES = [None, 0.25, 4.0]


@pytest.mark.parametrize("scale", SCALES)
def test_torch_greedy_logits_alone_do_not_depend_on_costs(tiny_model_dir, onnx_dir, reference, scale):
    # Fails on 5352aa0 (MACE's chunks followed the cost estimates: 'alone#0 1', 'alone#1 0', ...).
    engine = _engine(tiny_model_dir, "torch", scale, onnx_dir)
    assert _check(engine, reference["torch"], batched=False) == []


@pytest.mark.parametrize("scale", SCALES)
def test_torch_greedy_tokens_do_not_depend_on_batch(tiny_model_dir, onnx_dir, reference, scale):
    engine = _engine(tiny_model_dir, "torch", scale, onnx_dir)
    assert _check(engine, reference["torch"], alone=False, bitwise=False) == []


@pytest.mark.xfail(strict=True, reason="torch's CPU kernels round a row differently with the rows sharing the "
                                      "step: batches of 3 and 16 move logits by ulps (tokens stay equal here); #31 item 2")
def test_torch_greedy_logits_do_not_depend_on_batch(tiny_model_dir, onnx_dir, reference):
    engine = _engine(tiny_model_dir, "torch", None, onnx_dir)
    assert _check(engine, reference["torch"], alone=False) == []


@pytest.mark.parametrize("scale", SCALES)
def test_onnxruntime_greedy_logits_alone_do_not_depend_on_costs(tiny_model_dir, onnx_dir, reference, scale):
    pytest.importorskip("onnxruntime")
    engine = _engine(tiny_model_dir, "onnxruntime", scale, onnx_dir)
    assert _check(engine, reference["onnxruntime"], batched=False) == []


@pytest.mark.parametrize("scale", SCALES)
def test_onnxruntime_greedy_logits_do_not_depend_on_batch(tiny_model_dir, onnx_dir, reference, scale):
    pytest.importorskip("onnxruntime")
    engine = _engine(tiny_model_dir, "onnxruntime", scale, onnx_dir)
    assert _check(engine, reference["onnxruntime"], alone=False) == []
