"""`backend = "auto"`: ONNX Runtime on a CPU when its graph agrees with torch on a few greedy
tokens; torch, with the reason, when it cannot start, disagrees, or is not installed; an
explicit backend always wins; the weight format follows the perplexity margin."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("onnxruntime")

from edge_runtime import Engine, SamplingParams  # noqa: E402
from edge_runtime.backends import auto  # noqa: E402
from edge_runtime.backends.onnxruntime_backend import OnnxRuntimeBackend  # noqa: E402
from edge_runtime.errors import ModelNotAvailable  # noqa: E402

CONFIG = dict(dtype="float32", kv_cache_bytes=4 << 20, cost_profile="off", num_threads=1, device="cpu")


def load(model_dir, tmp_path, **overrides):
    return Engine.load(str(model_dir), **{**CONFIG, "onnx_cache_dir": str(tmp_path), **overrides})


def greedy_text(engine: Engine) -> str:
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    return engine.generate(["The quick brown fox"], params)[0].text


def test_auto_serves_onnxruntime_on_cpu_and_answers_like_torch(tiny_model_dir, tmp_path):
    engine = load(tiny_model_dir, tmp_path, backend="auto", onnx_quantization="none")
    choice = engine.backend_choice
    assert (engine.backend.name, choice.requested, choice.name, choice.quantization) == (
        "onnxruntime", "auto", "onnxruntime", "none")
    assert "self-check: greedy tokens equal" in choice.reason
    torch_engine = load(tiny_model_dir, tmp_path, backend="torch")
    assert greedy_text(engine) == greedy_text(torch_engine)


def test_self_check_failure_falls_back_to_torch_with_the_reason(tiny_model_dir, tmp_path, monkeypatch):
    real = OnnxRuntimeBackend.execute

    def off_by_a_lot(self, batch, lora=None):  # a graph that computes something else
        logits = real(self, batch, lora)
        return logits + torch.randn(logits.shape, generator=torch.Generator().manual_seed(0)) * 100

    monkeypatch.setattr(OnnxRuntimeBackend, "execute", off_by_a_lot)
    engine = load(tiny_model_dir, tmp_path, backend="auto", onnx_quantization="none")
    assert engine.backend.name == "torch" and engine.backend_choice.name == "torch"
    assert "onnxruntime failed the self-check" in engine.backend_choice.reason
    assert greedy_text(engine)  # and it serves


def test_backend_that_cannot_start_falls_back_to_torch_with_the_reason(tiny_model_dir, tmp_path, monkeypatch):
    def broken(self, *args, **kwargs):
        raise ModelNotAvailable("no provider for this device")

    monkeypatch.setattr(OnnxRuntimeBackend, "__init__", broken)
    engine = load(tiny_model_dir, tmp_path, backend="auto")
    assert engine.backend.name == "torch"
    assert "onnxruntime failed to start (ModelNotAvailable: no provider for this device)" in engine.backend_choice.reason


def test_nothing_faster_installed_means_torch(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(auto, "installed", lambda module: False)
    engine = load(tiny_model_dir, tmp_path, backend="auto")
    assert engine.backend.name == "torch"
    assert "no faster backend installed" in engine.backend_choice.reason


def test_explicit_backend_wins(tiny_model_dir, tmp_path):
    engine = load(tiny_model_dir, tmp_path, backend="torch", onnx_quantization="auto")
    assert engine.backend_choice == auto.BackendChoice("torch", "torch", "none", "set explicitly")
    engine = load(tiny_model_dir, tmp_path, backend="onnxruntime", onnx_quantization="auto")
    assert (engine.backend.name, engine.backend_choice.quantization) == ("onnxruntime", "q4_1")
    assert (engine.backend.spec.quantization, engine.backend.spec.offsets) == ("int4", True)


def test_auto_loads_float32_weights_for_onnxruntime_on_cpu(tiny_model_dir, tmp_path):
    engine = load(tiny_model_dir, tmp_path, backend="auto", dtype="auto", onnx_quantization="none")
    assert engine.model.dtype == torch.float32 and engine.backend.name == "onnxruntime"


@pytest.mark.parametrize("margin,expected", [(0.0, "none"), (0.0005, "none"), (0.001, "q4_1"), (0.05, "q4_1"),
                                             (0.2, "int4"), (0.3, "int4-compact")])
def test_quantization_is_the_fastest_within_the_perplexity_margin(margin, expected):
    assert auto.pick_quantization(margin) == expected


def test_candidates_follow_the_device_and_what_is_installed(monkeypatch):
    from edge_runtime.backends import ort_session

    have = {"onnx", "onnxruntime", "tensorrt"}
    monkeypatch.setattr(auto, "installed", lambda module: module in have)
    monkeypatch.setattr(ort_session, "onnxruntime_has_gpu", lambda: True)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert auto.candidates(cuda) == ["tensorrt", "onnxruntime"]  # native TensorRT, then the EPs
    assert auto.candidates(cpu) == ["onnxruntime"]  # TensorRT needs a GPU
    monkeypatch.setattr(ort_session, "onnxruntime_has_gpu", lambda: False)
    assert auto.candidates(cuda) == ["tensorrt"]  # a CPU-only onnxruntime cannot read a CUDA cache
    have.discard("tensorrt")
    assert auto.candidates(cuda) == [] and auto.first_candidate(cuda) == "torch"


class _Scripted:
    """A backend whose logits are a function of the tokens so far: token 1 leads token 2 by
    `gap` (of a 10-wide range); `lift` raises token 2 above token 1 (a flipped choice)."""

    def __init__(self, gap: float, lift: bool) -> None:
        self.gap, self.lift = gap, lift

    def execute(self, batch, lora=None):
        row = torch.linspace(0.0, 10.0 - 2 * self.gap, 16)
        row[1], row[2] = 10.0, 10.0 + 0.001 if self.lift else 10.0 - self.gap
        return torch.stack([row] * len(batch.items))


def test_self_check_lets_a_near_tie_differ_but_not_a_clear_choice(tmp_path):
    from edge_runtime.kv.block_pool import BlockPool

    pool = BlockPool(64, 16, False)
    prompts = [[5, 6, 7]]
    tie = auto.self_check(_Scripted(0.05, True), _Scripted(0.05, False), pool, prompts, "int4", tokens=2)
    assert tie.ok and tie.tokens != tie.reference_tokens and tie.near_ties == 2
    assert "near tie" in tie.describe()
    clear = auto.self_check(_Scripted(0.5, True), _Scripted(0.5, False), pool, prompts, "int4", tokens=2)
    assert not clear.ok and clear.relative_error <= 0.3  # within the logits' tolerance, still refused
    assert auto.self_check(_Scripted(0.05, False), _Scripted(0.05, False), pool, prompts, "int4", tokens=2).ok
