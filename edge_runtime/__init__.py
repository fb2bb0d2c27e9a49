"""MACE-edge compute runtime: model, KV cache, LoRA, training, scheduling, memory, telemetry, feedback.

Importable without the daemon. Heavy modules (torch, transformers) load lazily so that light
users (the feedback store, the telemetry parser) do not pay for them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# torch's OpenMP workers (libgomp) otherwise spin ~300k iterations after every parallel op, on the
# cores our own threads then need (the GGUF kernels' pool, ONNX Runtime's): on a 2-core box this
# tripled an in-place decode step (docs/gguf_kernel.md "Threads"). Read once, when torch loads
# libgomp, so it is set here, before any torch import; a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__all__ = ["Engine", "SamplingParams", "EngineConfig"]

if TYPE_CHECKING:
    from edge_runtime.config import EngineConfig
    from edge_runtime.engine import Engine
    from edge_runtime.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from edge_runtime.engine import Engine

        return Engine
    if name == "SamplingParams":
        from edge_runtime.sampling import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from edge_runtime.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'edge_runtime' has no attribute {name!r}")
