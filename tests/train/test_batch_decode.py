"""The guard's batched greedy decode: left-padded prompts answered together give the tokens and
logits each prompt gets alone, and the batched answer logits equal the one-prompt forward's."""

from __future__ import annotations

import torch

from edge_runtime.lora import LoraSettings
from edge_runtime.train.batch_decode import BatchDecode, batch_answer_logits
from edge_runtime.train.degeneration import answer_logits, greedy_answers
from tests.lora.helpers import ALL_LINEAR, random_adapter


def test_a_batch_of_left_padded_prompts_answers_as_each_prompt_alone(tiny4, tiny4_tokenizer):
    prompts = [list(tiny4_tokenizer.encode(t)) for t in ("Hello there, how are you today?", "Hi", "Why is the sky")]
    lora = random_adapter(tiny4.cfg, LoraSettings(rank=4, alpha=8, target_modules=ALL_LINEAR), seed=3, std=1.0)
    alone = greedy_answers(tiny4, prompts, lora, 7)
    batch = BatchDecode(tiny4, prompts, lora, 7)
    batch.prefill()
    while not batch.done:
        batch.decode(3)
    assert batch.ids == alone.ids
    for mine, theirs in zip(batch.logits, alone.logits, strict=True):
        assert torch.allclose(torch.stack(mine), theirs, atol=1e-4)
    assert batch.held_bytes == 0  # the keys/values are given back once every answer is done
    # Each kept row owns its storage: a view would keep every step's whole [rows, vocab] alive.
    vocab_bytes = tiny4.cfg.vocab_size * 4
    assert all(t.untyped_storage().nbytes() == vocab_bytes for rows in batch.logits for t in rows)
    logits = batch_answer_logits(tiny4, prompts, batch.ids, None, 7)
    for prompt, ids, got in zip(prompts, batch.ids, logits, strict=True):
        assert torch.allclose(got, answer_logits(tiny4, prompt, ids, None), atol=1e-4)
