"""The auto backend's self-check is remembered by what it checked (graph, weights digest, backend,
check settings, software, machine) and runs again when any of it changes (#28: 37 s of every 1B
start and keep-alive reload)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from edge_runtime.backends import auto, check_memo
from edge_runtime.backends.auto import SelfCheck
from edge_runtime.config import EngineConfig

PROMPTS = [[1, 2, 3], [4, 5]]
PASSED = SelfCheck(True, [[7, 8]], [[7, 8]], 0.01, 0.08)


@pytest.fixture()
def runs(monkeypatch) -> list[str]:
    """Each self-check actually run, by the weights it ran over."""
    ran: list[str] = []

    def self_check(backend, reference, pool, prompts, quantization, tokens=auto.SELF_CHECK_TOKENS):
        ran.append(backend.weights_digest)
        return PASSED

    monkeypatch.setattr(auto, "self_check", self_check)
    return ran


def backend(weights: str = "w1", graph: str = "aaaa-ort-dense-v11", name: str = "onnxruntime"):
    return SimpleNamespace(name=name, weights_digest=weights, providers=["CPUExecutionProvider"],
                           model_path=Path("/cache") / graph / "model.onnx")


MODEL = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)


def check(tmp_path, b, quantization="q4_1", prompts=PROMPTS):
    config = EngineConfig(onnx_cache_dir=str(tmp_path))
    return auto.checked(config, b, None, MODEL, None, prompts, quantization)


def test_a_passed_check_is_remembered_and_not_run_again(tmp_path, runs):
    first, when = check(tmp_path, backend())
    assert (first, when, runs) == (PASSED, "", ["w1"])
    again, when = check(tmp_path, backend())
    assert again == PASSED and when.startswith("; remembered from ") and runs == ["w1"]
    assert len(list((tmp_path / check_memo.MEMO_DIR).iterdir())) == 1


def test_changed_weights_graph_check_or_prompts_run_it_again(tmp_path, runs):
    check(tmp_path, backend())
    check(tmp_path, backend(weights="w2"))  # another model, or the same one changed
    check(tmp_path, backend(graph="aaaa-ort-dense-v12"))  # a new graph version
    check(tmp_path, backend(), quantization="int8")  # another weight format and tolerance
    check(tmp_path, backend(), prompts=[[1, 2, 3]])  # another tokenizer's prompt ids
    assert runs == ["w1", "w2", "w1", "w1", "w1"]
    check(tmp_path, backend(weights="w2"))  # each is remembered on its own
    assert len(runs) == 5


def test_new_code_or_packages_run_it_again(tmp_path, runs, monkeypatch):
    check(tmp_path, backend())
    monkeypatch.setattr(check_memo, "code_digest", lambda: "edited")
    check(tmp_path, backend())
    monkeypatch.setattr(check_memo, "package_versions", lambda: {"onnxruntime": "9.9"})
    check(tmp_path, backend())
    assert len(runs) == 3


def test_a_failed_verdict_is_remembered_too_and_a_corrupt_memo_is_ignored(tmp_path, monkeypatch):
    failed = SelfCheck(False, [[1, 2]], [[3, 4]], 0.9, 0.08)
    ran = []
    monkeypatch.setattr(auto, "self_check", lambda *a, **k: ran.append(1) or failed)
    assert check(tmp_path, backend())[0] == failed
    assert check(tmp_path, backend())[0] == failed and ran == [1]
    [memo] = (tmp_path / check_memo.MEMO_DIR).iterdir()
    memo.write_text("{not json")
    assert check(tmp_path, backend())[0] == failed and ran == [1, 1]


def test_an_engine_loaded_again_remembers_its_self_check(tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime")
    from edge_runtime import Engine

    ran = []
    real = auto.self_check
    monkeypatch.setattr(auto, "self_check", lambda *a, **k: ran.append(1) or real(*a, **k))
    config = dict(dtype="float32", kv_cache_bytes=4 << 20, cost_profile="off", num_threads=1, device="cpu",
                  backend="auto", onnx_quantization="none", onnx_cache_dir=str(tmp_path))
    first = Engine.load(str(tiny_model_dir), **config)
    second = Engine.load(str(tiny_model_dir), **config)
    assert ran == [1]
    assert first.backend.name == second.backend.name == "onnxruntime"
    assert second.backend_choice.reason.startswith(first.backend_choice.reason + "; remembered from ")
