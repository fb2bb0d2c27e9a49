"""What a staged update optimises: DPO for a preference pair, KTO for one judged answer. An
objective turns the two summed log-probs a task's forward measured into a score and seeds the
backward with the loss's gradient; it knows nothing of stages, windows or the trainer.

Both read the same two rows of a `PairTokens` (chosen/rejected for DPO; the judged answer and the
mismatched answer for KTO), so a task's stages and costs are the same for either.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from edge_runtime.train.dpo import DPOScore, rpo_loss
from edge_runtime.train.kto import KTOScore, kto_loss
from edge_runtime.train.unpaired import UnpairedTokens

Score = DPOScore | KTOScore


class Objective(Protocol):
    def score(self, policy: tuple[float, float], reference: tuple[float, float]) -> Score:
        """The score at these summed log-probs (the policy's and the reference's, per row)."""
        ...

    def seed(self, result: Score, accumulation_steps: int) -> Tensor:
        """d(this example's share of the accumulated loss)/d(summed log-probs), one per row."""
        ...

    def stepped(self, result: Score) -> None:
        """Called as the task's optimizer stage runs, before the trainer counts it."""
        ...


@dataclass(frozen=True)
class DPOObjective:
    """Direct preference optimisation of one pair (train/dpo.py); with `rpo_alpha` > 0 plus the
    chosen answer's per-token NLL (RPO), `chosen_tokens` being that answer's length."""

    beta: float
    rpo_alpha: float = 0.0
    chosen_tokens: int = 1

    def score(self, policy: tuple[float, float], reference: tuple[float, float]) -> DPOScore:
        return DPOScore(policy[0], policy[1], reference[0], reference[1], self.beta, self.rpo_alpha,
                        self.chosen_tokens)

    def seed(self, result: Score, accumulation_steps: int) -> Tensor:
        """dL/d(sum log pi(chosen)), dL/d(sum log pi(rejected)): two scalars, so the top group's
        seed is exact and cheap."""
        assert isinstance(result, DPOScore)
        r = result
        logps = torch.tensor([r.policy_chosen, r.policy_rejected], dtype=torch.float64, requires_grad=True)
        ref = torch.tensor([r.ref_chosen, r.ref_rejected], dtype=torch.float64)
        loss = rpo_loss(logps[0], logps[1], ref[0], ref[1], r.beta, r.rpo_alpha, r.chosen_tokens) / accumulation_steps
        loss.backward()
        assert logps.grad is not None
        return logps.grad

    def stepped(self, result: Score) -> None:
        return None


@dataclass(frozen=True)
class KTOObjective:
    """KTO of one judged answer (train/kto.py, see train/unpaired.py for the rows). `kl_samples`
    is the adapter's window of recent mismatched log-ratios: this example reads z0 from it and,
    once its update is in, adds its own sample."""

    example: UnpairedTokens
    kl_samples: deque[float]
    beta: float
    desirable_weight: float = 1.0  # lambda_D
    undesirable_weight: float = 1.0  # lambda_U

    def reference_point(self, kl_logratio: float | None) -> float:
        """z0 from the user's recent mismatched log-ratios plus this example's (if it has one)."""
        samples = list(self.kl_samples) + ([] if kl_logratio is None else [kl_logratio])
        return max(0.0, sum(samples) / len(samples)) if samples else 0.0

    def score(self, policy: tuple[float, float], reference: tuple[float, float]) -> KTOScore:
        (answer, kl), (ref, ref_kl) = policy, reference
        z0 = self.reference_point(kl - ref_kl if self.example.has_kl else None)
        return KTOScore(answer, ref, kl, ref_kl, self.example.desirable, z0, self.beta,
                        self.desirable_weight, self.undesirable_weight)

    def seed(self, result: Score, accumulation_steps: int) -> Tensor:
        """dL/d(sum log pi(answer)); 0 for the mismatched answer (z0 is detached)."""
        assert isinstance(result, KTOScore)
        r = result
        policy = torch.tensor(r.policy, dtype=torch.float64, requires_grad=True)
        loss = kto_loss(policy, torch.tensor(r.ref, dtype=torch.float64), torch.tensor(r.desirable), r.z0,
                        r.beta, r.desirable_weight, r.undesirable_weight)
        (loss / accumulation_steps).backward()
        assert policy.grad is not None
        return torch.stack([policy.grad, torch.zeros((), dtype=torch.float64)])

    def stepped(self, result: Score) -> None:
        if isinstance(result, KTOScore) and self.example.has_kl:
            self.kl_samples.append(result.kl_logratio)
