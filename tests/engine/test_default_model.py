"""The foundation's bar on the real default model (SmolLM2-135M-Instruct): logits match
`transformers`, and greedy outputs do not depend on batching or on prefix-cache hits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from edge_runtime import Engine, SamplingParams

from .helpers import engine_logits_for, reference_logits

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain photosynthesis to a child.",
    "Write a haiku about the sea.",
    "What is 17 times 23?",
    "Name a famous painting by Leonardo da Vinci.",
    "How do I boil an egg?",
    "Translate 'good morning' into Spanish.",
    "What causes rain?",
    "Suggest a name for a pet turtle.",
    "Why is the sky blue?",
    "List the planets of the solar system.",
    "What is a prime number?",
    "Describe a cat in one sentence.",
    "How many legs does a spider have?",
    "What does a Jetson Orin do?",
]


def test_forward_matches_transformers_on_200_token_prefill_and_20_decode_steps(default_model_dir: Path) -> None:
    engine = Engine.load(str(default_model_dir), dtype="float32", kv_cache_bytes=64 << 20, max_batched_tokens=96)
    ref = AutoModelForCausalLM.from_pretrained(str(default_model_dir), local_files_only=True, dtype=torch.float32).eval()
    text = " ".join(QUESTIONS) * 2
    prompt = engine.tokenizer.hf.encode(text)[:220]
    assert len(prompt) == 220
    logits, generated = engine_logits_for(engine, prompt, steps=21)  # prefill + 20 decode steps
    expected = reference_logits(ref, prompt + generated)[len(prompt) - 1 : len(prompt) + 20]
    diff = (logits - expected).abs().max().item()
    assert diff <= 1e-3, f"max |logit diff| {diff}"


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_sixteen_prompts_batched_equal_alone_and_with_prefix_hits(default_model_dir: Path, dtype: str) -> None:
    params = SamplingParams(max_tokens=24)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    alone_engine = Engine.load(str(default_model_dir), dtype=dtype, kv_cache_bytes=64 << 20, enable_prefix_cache=False)
    alone = [alone_engine.generate([chat], params)[0].token_ids for chat in chats]
    engine = Engine.load(str(default_model_dir), dtype=dtype, kv_cache_bytes=64 << 20)
    batched = engine.generate(chats, params)
    assert [o.token_ids for o in batched] == alone
    # Every chat shares SmolLM2's default system prompt: the batch hits the prefix cache.
    assert sum(o.metrics.cached_prompt_tokens for o in batched) > 0
    again = engine.generate(chats, params)
    assert [o.token_ids for o in again] == alone
    assert all(o.metrics.cached_prompt_tokens >= 16 for o in again)
