"""The ONNX Runtime backend on the real default model (slow): logits within 1e-3 of the torch
backend and identical greedy output for 20 chat prompts, two users' adapters and base-model
requests decoding in one continuous batch."""

from __future__ import annotations

import pytest

pytest.importorskip("onnxruntime")

from edge_runtime import SamplingParams  # noqa: E402
from edge_runtime.lora import LoraSettings  # noqa: E402
from edge_runtime.model.config import ModelConfig  # noqa: E402
from tests.backends.helpers import ALL_LINEAR, make_engine, random_adapter, run_recording  # noqa: E402

TOPICS = ["the sea", "a mountain", "a robot", "the moon", "a library", "a bakery", "a river", "winter",
          "a violin", "a garden", "a train", "the desert", "a lighthouse", "a volcano", "a forest",
          "a city", "a clock", "the rain", "a bridge", "a cat"]


@pytest.mark.slow
def test_default_model_onnxruntime_matches_torch_with_two_adapters(default_model_dir, tmp_path):
    cfg = ModelConfig.from_dir(default_model_dir)
    adapters = {
        "alice": random_adapter(cfg, LoraSettings(rank=8, alpha=16), seed=11, std=0.02),
        "bob": random_adapter(cfg, LoraSettings(rank=4, alpha=8, target_modules=ALL_LINEAR), seed=12, std=0.02),
    }
    prompts = [[{"role": "user", "content": f"Write one sentence about {t}."}] for t in TOPICS]
    users = [("alice", "bob", None)[i % 3] for i in range(len(prompts))]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    config = dict(dtype="float32", kv_cache_bytes=64 << 20, max_batched_tokens=256, onnx_cache_dir=str(tmp_path))
    ref_logits, ref_tokens = run_recording(make_engine(default_model_dir, "torch", adapters, **config),
                                           prompts, users, params)
    logits, tokens = run_recording(make_engine(default_model_dir, "onnxruntime", adapters, **config),
                                   prompts, users, params)
    worst = max((a - b).abs().max().item() for a, b in zip(logits, ref_logits, strict=True))
    assert worst < 1e-3, worst
    assert tokens == ref_tokens
    # The adapters matter: alice's and bob's answers differ from what the base model says.
    base = run_recording(make_engine(default_model_dir, "onnxruntime", {}, **config), prompts,
                         [None] * len(prompts), params)[1]
    assert any(t != b for t, b, u in zip(tokens, base, users, strict=True) if u is not None)
