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
