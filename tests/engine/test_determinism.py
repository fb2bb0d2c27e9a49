"""Greedy is greedy (issue #31): the same request gets the same greedy tokens alone, repeated and
in batches of 3 and 16 beside other requests, under the MACE policy, with cost calibration off
and with the cost estimates another machine would have (x0.25, x4), on torch and ONNX Runtime."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from edge_runtime import Engine, SamplingParams
from tests.backends.helpers import PROMPTS

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


def _tokens(engine: Engine, prompts: list[str]) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("onnx")


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, onnx_dir: Path) -> dict[str, list[list[int]]]:
    """Each subject alone on an engine with nominal costs, per backend."""
    refs = {}
    for backend in ("torch", "onnxruntime"):
        if backend == "onnxruntime":
            pytest.importorskip("onnxruntime")
        engine = _engine(tiny_model_dir, backend, None, onnx_dir)
        refs[backend] = [_tokens(engine, [p])[0] for p in SUBJECTS]
    return refs


def _check(engine: Engine, expected: list[list[int]], batched: bool) -> list[str]:
    """Which runs of the subjects disagreed with `expected`."""
    bad = []
    for rep in range(2):  # alone, and again (with the prefix cache warm)
        for i, p in enumerate(SUBJECTS):
            if _tokens(engine, [p])[0] != expected[i]:
                bad.append(f"alone#{rep} {i}")
    if batched:
        for start in (0, 3):
            got = _tokens(engine, SUBJECTS[start : start + 3])
            bad += [f"batch3 {start + k}" for k, t in enumerate(got) if t != expected[start + k]]
        mixed = SUBJECTS + OTHERS[: 16 - len(SUBJECTS)]
        got = _tokens(engine, mixed)[: len(SUBJECTS)]
        bad += [f"batch16 {k}" for k, t in enumerate(got) if t != expected[k]]
    return bad


SCALES = [None, 0.25, 4.0]


@pytest.mark.parametrize("scale", SCALES)
def test_torch_greedy_tokens_do_not_depend_on_load_costs_or_batch(tiny_model_dir, onnx_dir, reference, scale):
    engine = _engine(tiny_model_dir, "torch", scale, onnx_dir)
    assert _check(engine, reference["torch"], batched=True) == []


@pytest.mark.parametrize("scale", SCALES)
def test_onnxruntime_greedy_tokens_alone_do_not_depend_on_costs(tiny_model_dir, onnx_dir, reference, scale):
    pytest.importorskip("onnxruntime")
    engine = _engine(tiny_model_dir, "onnxruntime", scale, onnx_dir)
    assert _check(engine, reference["onnxruntime"], batched=False) == []


@pytest.mark.parametrize("scale", SCALES)
def test_onnxruntime_greedy_tokens_do_not_depend_on_batch(tiny_model_dir, onnx_dir, reference, scale):
    pytest.importorskip("onnxruntime")
    engine = _engine(tiny_model_dir, "onnxruntime", scale, onnx_dir)
    assert _check(engine, reference["onnxruntime"], batched=True) == []
