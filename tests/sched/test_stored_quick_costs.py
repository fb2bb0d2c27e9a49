"""A start before any full cost calibration is stored reuses the quick fit an earlier start stored
under the same key (model shape, machine, dtype, backend, graph), and still calibrates in the
background; a start on another backend or graph measures its own (#28: 44 s of a cached 1B start)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from edge_runtime.kv.block_pool import BlockPool
from edge_runtime.model.config import ModelConfig
from edge_runtime.sched import cost_model
from edge_runtime.sched.cost_model import ForwardCoefficients, load_cost_model

FITS = [ForwardCoefficients(0.01, 0.002, 1e-6, 0.003), ForwardCoefficients(0.05, 0.004, 2e-6, 0.006)]


@pytest.fixture()
def quick_runs(monkeypatch) -> list[str]:
    """Each quick calibration measured (the fits in FITS, in turn), by backend."""
    runs: list[str] = []

    def quick(execute, pool, cfg, seed=0, max_tokens=None):
        runs.append(execute.__name__)
        return FITS[(len(runs) - 1) % len(FITS)]

    monkeypatch.setattr(cost_model, "quick_calibration", quick)
    monkeypatch.setattr(cost_model, "machine_busy", lambda: False)
    return runs


def start(cfg: ModelConfig, cache: Path, backend: str = "onnxruntime/q4_1", graph: str = "ort-dense-v11"):
    def execute(batch):  # never run: the quick calibration is the fixture's
        raise AssertionError("no forward expected")

    execute.__name__ = backend
    pool = BlockPool(64, 16, False)
    return load_cost_model(cfg, torch.float32, torch.device("cpu"), backend, execute, pool, 4096,
                           mode="background", cache_dir=str(cache), graph=graph)


def test_the_next_start_reuses_the_stored_quick_fit_and_still_calibrates(tiny_model_dir, tmp_path, quick_runs):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    first, calibration = start(cfg, tmp_path)
    assert first.source == "quick" and first.forward == FITS[0] and calibration is not None
    second, calibration = start(cfg, tmp_path)
    assert quick_runs == ["onnxruntime/q4_1"]  # measured once
    assert second.source == "stored" and second.forward == FITS[0]
    assert calibration is not None and not calibration.done  # the full one still runs while idle


def test_another_backend_or_graph_measures_its_own(tiny_model_dir, tmp_path, quick_runs):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    start(cfg, tmp_path)
    other_backend, _ = start(cfg, tmp_path, backend="torch", graph="")
    other_graph, _ = start(cfg, tmp_path, graph="ort-dense-v12")
    assert quick_runs == ["onnxruntime/q4_1", "torch", "onnxruntime/q4_1"]
    assert (other_backend.source, other_graph.source) == ("quick", "quick")
    assert other_backend.forward == FITS[1] and other_graph.forward == FITS[0]
    # ...and each is reused by its own next start.
    assert start(cfg, tmp_path, backend="torch", graph="")[0].forward == FITS[1]
    assert len(quick_runs) == 3


def test_a_full_calibration_replaces_the_stored_quick_one(tiny_model_dir, tmp_path, quick_runs):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    start(cfg, tmp_path)
    full = ForwardCoefficients(0.02, 0.003, 1e-6, 0.004)
    [stored] = list(tmp_path.iterdir())  # only the quick fit so far
    key = stored.name.removeprefix("quick-")
    # What BackgroundCalibration stores once its last shape is measured (here: on a busy
    # machine, so provisional; a quiet start does not take it as calibrated but starts from it).
    cost_model.store(tmp_path / key, asdict(full), provisional=True)
    started, calibration = start(cfg, tmp_path)
    assert started.source == "stored" and started.forward == full and calibration is not None
    cost_model.store(tmp_path / key, asdict(full), provisional=False)
    cached, calibration = start(cfg, tmp_path)
    assert cached.source == "cached" and cached.forward == full and calibration is None
    assert len(quick_runs) == 1


def test_an_unreadable_stored_fit_is_measured_again(tiny_model_dir, tmp_path, quick_runs):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    start(cfg, tmp_path)
    stored = next(tmp_path.glob("quick-*"))
    stored.write_text('{"version": 1, "values": {"base_s": 1}}')
    again, _ = start(cfg, tmp_path)
    assert again.source == "quick" and len(quick_runs) == 2
