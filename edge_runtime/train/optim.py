"""AdamW on LoRA parameters only, with gradient accumulation over pairs and norm clipping.

Backward stages add into `.grad` of the LoRA leaves; `accumulate()` counts finished pairs and
steps once `accumulation_steps` have been added. The base weights are never given to it. How
often a version is published (`finetune.pairs_per_version`) does not change when it steps
(docs/training.md, "Optimizer steps and versions").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class OptimizerSettings:
    learning_rate: float = 5e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0  # decaying LoRA's B towards zero pulls the policy back to the base
    # One step per trained example (TRL's gradient_accumulation_steps default). It used to be 4,
    # which with pairs_per_version = 4 meant one step per published version (issue #32).
    accumulation_steps: int = 1
    max_grad_norm: float | None = 1.0


class LoraOptimizer:
    def __init__(self, params: Sequence[Tensor], settings: OptimizerSettings) -> None:
        if any(not p.requires_grad for p in params):
            raise ValueError("LoraOptimizer takes trainable LoRA leaves only")
        if settings.accumulation_steps < 1:
            raise ValueError("accumulation_steps must be >= 1")
        self.params = list(params)
        self.settings = settings
        self.adamw = torch.optim.AdamW(
            self.params, lr=settings.learning_rate, betas=settings.betas, weight_decay=settings.weight_decay
        )
        self.accumulated = 0  # pairs whose gradients sit in .grad
        self.steps = 0
        self.last_grad_norm: float | None = None

    @property
    def will_step(self) -> bool:
        """Whether the next `accumulate()` completes an accumulation window."""
        return self.accumulated + 1 >= self.settings.accumulation_steps

    def accumulate(self) -> bool:
        """One more pair's gradients are in; steps (and zeroes grads) when the window is full.
        Returns whether it stepped."""
        self.accumulated += 1
        if self.accumulated < self.settings.accumulation_steps:
            return False
        self.step()
        return True

    def step(self) -> None:
        """Apply what has accumulated (also used to flush a partial window)."""
        if self.accumulated == 0:
            return
        if self.settings.max_grad_norm is not None:
            self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.settings.max_grad_norm))
        self.adamw.step()
        self.adamw.zero_grad(set_to_none=True)
        self.accumulated = 0
        self.steps += 1

    @property
    def state_bytes(self) -> int:
        """Adam's two moments per parameter (allocated on the first step)."""
        return 2 * sum(p.numel() * p.element_size() for p in self.params)
