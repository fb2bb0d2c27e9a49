"""Every backend states that it implements `Backend`, and the engine's backend answers the
questions the engine asks (no name probes, no getattr defaults)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_runtime.backends import Backend
from edge_runtime.backends.onnxruntime_backend import OnnxRuntimeBackend
from edge_runtime.backends.torch_backend import TorchBackend
from tests.engine.helpers import make_engine


@pytest.mark.parametrize("cls", [TorchBackend, OnnxRuntimeBackend])
def test_every_backend_class_declares_the_protocol(cls: type) -> None:
    assert Backend in cls.__mro__  # stated, not merely matching in shape
    assert isinstance(cls.name, str) and cls.name


def test_the_tensorrt_backend_declares_the_protocol() -> None:
    from trt_plugins.backend import TensorRTBackend

    assert Backend in TensorRTBackend.__mro__
    assert TensorRTBackend.runs_onnx_weights and not TensorRTBackend.reads_pruned_kv


def test_only_the_torch_backend_reads_a_pruned_kv_layout() -> None:
    assert TorchBackend.reads_pruned_kv and not OnnxRuntimeBackend.reads_pruned_kv
    assert OnnxRuntimeBackend.runs_onnx_weights and not TorchBackend.runs_onnx_weights


def test_the_engine_backend_is_a_backend_holding_nothing_beside_the_cache(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    backend = engine.backend
    assert isinstance(backend, Backend)
    assert backend.held_bytes == 0 and backend.reserved_bytes == 0
