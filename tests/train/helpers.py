"""Helpers for the training tests: a trainer with a non-zero adapter, and the gradients of one
full-sequence autograd pass against those the staged task leaves (tests/families reuses them)."""

from __future__ import annotations

import torch

from edge_runtime.lora import LoraSettings
from edge_runtime.train import AdapterTrainer, DPOSettings, PreferenceRecord, StageKind
from edge_runtime.train.dpo import dpo_loss
from edge_runtime.train.logprobs import pair_logps_dense
from edge_runtime.train.optim import OptimizerSettings
from tests.lora.helpers import ALL_LINEAR, random_adapter


def make_trainer(model, tokenizer, window=None, group=1, accumulation=1, targets=ALL_LINEAR, lr=5e-4) -> AdapterTrainer:
    settings = LoraSettings(rank=4, alpha=8, target_modules=targets)
    dpo = DPOSettings(beta=0.1, window_tokens=window, layers_per_group=group,
                      optimizer=OptimizerSettings(accumulation_steps=accumulation, learning_rate=lr))
    # Non-zero B: with B = 0 the gradient of A is identically zero and proves nothing.
    return AdapterTrainer(model, tokenizer, dpo=dpo, init=random_adapter(model.cfg, settings, seed=7, std=0.1))


def full_autograd_grads(trainer, records, accumulation):
    for p in trainer.weights.parameters():
        p.grad = None
    for record in records:
        tokens = trainer.tokenize(record)
        ref_c, ref_r = (torch.tensor(v) for v in trainer.reference_logps(tokens))
        logps = pair_logps_dense(trainer.model, tokens, trainer.weights)
        (dpo_loss(logps[0], logps[1], ref_c, ref_r, trainer.dpo.beta) / accumulation).backward()
    grads = [p.grad.clone() for p in trainer.weights.parameters()]
    for p in trainer.weights.parameters():
        p.grad = None
    return grads


def staged_grads(trainer, records):
    for record in records:
        task = trainer.task(record)
        while task.next_stage().kind is not StageKind.OPTIMIZER:
            task.run_next()
        trainer.release(task)
    return [p.grad.clone() for p in trainer.weights.parameters()]


def max_rel_error(got, want):
    return max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want, strict=True))


def chat(text: str) -> tuple[dict[str, str], ...]:
    return ({"role": "user", "content": text},)


def preference_records() -> list[PreferenceRecord]:
    return [
        PreferenceRecord(chat("What is the capital of France?"), "Paris is the capital of France.", "Lyon."),
        PreferenceRecord(chat("Hello, how are you today?"), "I am fine, thank you.", "The quick brown fox jumps over the lazy dog."),
        PreferenceRecord(chat("Please write a short poem about the sea."), "The sea and the sky.", "No."),
        PreferenceRecord(chat("Fine-tuning on the device?"), "The data of the user stays on the device.", "Sure"),
    ]
