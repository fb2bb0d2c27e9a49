"""AdamW on LoRA parameters only, with gradient accumulation over pairs and norm clipping.

Backward stages add into `.grad` of the LoRA leaves; `accumulate()` counts finished pairs and
steps once `accumulation_steps` have been added. The base weights are never given to it. How
often a version is published (`finetune.pairs_per_version`) does not change when it steps
(docs/training.md, "Optimizer steps and versions").

The AdamW update is written out here (Loshchilov & Hutter, Algorithm 2): `torch.optim` imports
`torch._dynamo` (and Triton, SymPy) the first time any optimizer is built or stepped, ~120 MiB
resident for the daemon's life from its first pair on (#28). Same ops in the same order as
`torch.optim.AdamW`'s single-tensor path (the CPU's), so the same bits (tests check it).
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


EPS = 1e-8  # AdamW's epsilon (torch.optim's default, which this used to run)


@dataclass
class _Moments:
    """Adam's state of one parameter: first and second moments and its step count t."""

    m: Tensor
    v: Tensor
    t: int = 0


class LoraOptimizer:
    def __init__(self, params: Sequence[Tensor], settings: OptimizerSettings) -> None:
        if any(not p.requires_grad for p in params):
            raise ValueError("LoraOptimizer takes trainable LoRA leaves only")
        if settings.accumulation_steps < 1:
            raise ValueError("accumulation_steps must be >= 1")
        self.params = list(params)
        self.settings = settings
        self.moments: dict[int, _Moments] = {}  # per parameter index, from its first step
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
        self._adamw_step()
        for p in self.params:
            p.grad = None
        self.accumulated = 0
        self.steps += 1

    @torch.no_grad()
    def _adamw_step(self) -> None:
        lr, (beta1, beta2), decay = self.settings.learning_rate, self.settings.betas, self.settings.weight_decay
        for i, theta in enumerate(self.params):
            g = theta.grad
            if g is None:  # as torch.optim: no moments, no step for a parameter without a gradient
                continue
            if i not in self.moments:
                self.moments[i] = _Moments(torch.zeros_like(theta), torch.zeros_like(theta))
            state = self.moments[i]
            state.t += 1
            m, v, t = state.m, state.v, state.t
            if decay != 0:
                theta.mul_(1 - lr * decay)  # decoupled from the gradient
            m.lerp_(g, 1 - beta1)  # m_t = beta1 m_{t-1} + (1 - beta1) g_t
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)  # v_t = beta2 v_{t-1} + (1 - beta2) g_t^2
            # theta_t = theta_{t-1} - lr m_t / (1 - beta1^t) / (sqrt(v_t) / sqrt(1 - beta2^t) + eps)
            denom = (v.sqrt() / (1 - beta2**t) ** 0.5).add_(EPS)
            theta.addcdiv_(m, denom, value=-(lr / (1 - beta1**t)))

    def clear_state(self) -> None:
        """Drop Adam's moments (a retired trainer's); the next step starts them afresh."""
        self.moments.clear()

    @property
    def state_bytes(self) -> int:
        """Adam's two moments per parameter (allocated on the first step)."""
        return 2 * sum(p.numel() * p.element_size() for p in self.params)
