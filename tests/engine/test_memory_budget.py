"""A memory budget below what the model needs is refused when the engine is built, with the
figures, instead of an engine that holds more than its budget and fails later."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_runtime import Engine
from edge_runtime.errors import InsufficientMemory, ModelNotAvailable


def test_budget_below_the_weights_is_refused_at_load_with_the_numbers(tiny_model_dir: Path) -> None:
    with pytest.raises(InsufficientMemory) as info:
        Engine.load(tiny_model_dir, dtype="float32", kv_cache_bytes=1 << 20, memory_budget_bytes=64 << 10,
                    cost_profile="off")
    message = str(info.value)
    assert "memory budget (0 MiB" in message and "weights" in message and "KV cache minimum" in message
    assert isinstance(info.value, ModelNotAvailable)  # the daemon's "model could not be loaded" path


def test_budget_that_fits_the_needs_builds_and_serves(tiny_model_dir: Path) -> None:
    from edge_runtime import SamplingParams
    from edge_runtime.sizing import memory_needs
    from edge_runtime.sizing import weights_bytes as _weights_bytes

    probe = Engine.load(tiny_model_dir, dtype="float32", kv_cache_bytes=1 << 20, cost_profile="off")
    needs = memory_needs(probe.config, probe.model.cfg, probe.model.dtype, _weights_bytes(probe.model))
    assert needs["weights"] == probe.ledger.held()  # the ledger's weights entry, nothing else yet
    engine = Engine(probe.model, probe.tokenizer, probe.config.replace(memory_budget_bytes=sum(needs.values())))
    assert engine.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids
    with pytest.raises(InsufficientMemory):
        Engine(probe.model, probe.tokenizer, probe.config.replace(memory_budget_bytes=sum(needs.values()) - 1))


def test_a_model_the_machine_cannot_hold_is_refused_before_its_weights_are_read(tiny_model_dir: Path,
                                                                                monkeypatch) -> None:
    from edge_runtime import loading

    read = []
    monkeypatch.setattr(loading, "available_memory_bytes", lambda: 1 << 20)
    monkeypatch.setattr(loading, "load_llama", lambda *a, **k: read.append(a))
    with pytest.raises(InsufficientMemory) as info:
        Engine.load(tiny_model_dir, dtype="float32", kv_cache_bytes=1 << 20, cost_profile="off")
    message = str(info.value)
    assert "the memory this machine has available (1 MiB" in message and "one training stage 256 MiB" in message
    assert read == []  # refused before a byte of weights


def test_a_block_cache_is_sized_by_its_blocks_not_a_float_shell(tmp_path: Path) -> None:
    import torch

    from edge_runtime.model.block_cache import BLOCKS_FILE
    from edge_runtime.model.config import ModelConfig
    from edge_runtime.model.testing import make_tiny_model_dir
    from edge_runtime.sizing import stored_weights_bytes

    folder = make_tiny_model_dir(tmp_path / "m")
    cfg = ModelConfig.from_dir(folder)
    shell = stored_weights_bytes(folder, cfg, torch.float32)
    assert shell > 0
    (folder / BLOCKS_FILE).write_bytes(b"\0" * 1000)
    assert stored_weights_bytes(folder, cfg, torch.float32) == 1000
