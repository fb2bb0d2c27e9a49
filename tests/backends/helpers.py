"""Helpers for the backend tests: engines over one model with the same adapters, and the logits
each backend produced, step by step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from edge_runtime import Engine, SamplingParams
from edge_runtime.lora import LoraSettings, LoraWeights
from edge_runtime.model.config import ModelConfig


def ort_device() -> str:
    """The torch device an engine whose graphs run on this onnxruntime build must use: the GPU
    only where the build has a GPU provider (the plain wheel has not, whatever torch sees)."""
    from edge_runtime.backends.ort_session import onnxruntime_has_gpu

    return "cuda" if torch.cuda.is_available() and onnxruntime_has_gpu() else "cpu"


ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(cfg: ModelConfig, settings: LoraSettings, seed: int, std: float = 0.05) -> LoraWeights:
    """An adapter with non-zero B (a fresh one is the identity and would prove nothing)."""
    weights = LoraWeights.init(cfg, settings, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    for b in weights.b.values():
        b.copy_(torch.randn(b.shape, generator=gen) * std)
    return weights


def two_adapters(cfg: ModelConfig) -> dict[str, LoraWeights]:
    """Different ranks and targets, so stacking has to line up columns of unequal adapters."""
    return {
        "alice": random_adapter(cfg, LoraSettings(rank=4, alpha=8, target_modules=ALL_LINEAR), seed=1),
        "bob": random_adapter(cfg, LoraSettings(rank=2, alpha=4, target_modules=("q_proj", "v_proj")), seed=2),
    }


def make_engine(model_dir: Path, backend: str, adapters: dict[str, LoraWeights], **config) -> Engine:
    engine = Engine.load(str(model_dir), backend=backend, **config)
    for user, weights in adapters.items():
        engine.publish_adapter(user, weights)
    return engine


def run_spying(engine: Engine, prompts: list, users: list[str | None], params: SamplingParams,
               on_step: Callable[[Any, torch.Tensor], None]) -> list:
    """Generate every prompt (as its user) in one continuous batch, calling `on_step(batch,
    logits)` after each forward; returns each request's output, in the prompts' order."""
    execute = engine.backend.execute

    def spy(batch):
        out = execute(batch)
        on_step(batch, out)
        return out

    engine.backend.execute = spy
    try:
        ids = [engine.add_request(p, params, adapter=u) for p, u in zip(prompts, users, strict=True)]
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                done[out.request_id] = out
    finally:
        engine.backend.execute = execute
    return [done[i] for i in ids]


def run_recording(engine: Engine, prompts: list, users: list[str | None], params: SamplingParams):
    """Generate every prompt (as its user) in one continuous batch; returns (logits of every
    step, in order, and each request's output token ids)."""
    captured: list[torch.Tensor] = []
    outputs = run_spying(engine, prompts, users, params,
                         lambda batch, out: captured.append(out.detach().float().cpu().clone()))
    return captured, [o.candidates[0].token_ids for o in outputs]


PROMPTS = [
    "Hello, how are you today?", "What is the capital of France?", "The quick brown fox jumps",
    "Please write a short poem about the sea.", "Fine-tuning on the device keeps data local.",
    "I am fine, thank you.", "Paris is the capital", "The user asks and the assistant answers.",
    "Write about the sky", "How are you", "What is", "Please write", "The lazy dog sleeps.",
    "A poem about the device", "the capital of the user", "thank you, assistant",
    "Hello", "jumps over the lazy dog", "keeps the data of the user on the device", "Fine",
]
