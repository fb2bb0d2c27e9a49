"""KTO loss for unpaired feedback (Ethayarajh et al., 2024, eq. 7), as TRL's `KTOTrainer` computes
it, and the held-out desirable-vs-undesirable margin. Pure tensor math, no model.

For an answer y to x with r = log pi_theta(y|x) - log pi_ref(y|x) and the reference point z0:

  desirable    L = lambda_D * (1 - sigma(beta * (r - z0)))
  undesirable  L = lambda_U * (1 - sigma(beta * (z0 - r)))

z0 estimates KL(pi_theta || pi_ref) from mismatched completions (an answer the user got to another
prompt, scored under this prompt): z0 = max(0, mean(log pi_theta(y'|x) - log pi_ref(y'|x))),
detached, so it shifts the point the answer's reward is judged from but carries no gradient.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor


def kto_reference_point(policy_kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """z0: the mean log-ratio of mismatched completions, clamped at 0 and detached (as TRL)."""
    if policy_kl_logps.numel() == 0:
        return torch.zeros((), dtype=policy_kl_logps.dtype, device=policy_kl_logps.device)
    return (policy_kl_logps - ref_kl_logps).mean().detach().clamp(min=0)


def kto_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    desirable: Tensor,
    z0: Tensor | float,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> Tensor:
    """Per-example loss; `desirable` is a bool tensor (thumbs up / rating at or above the
    threshold). TRL's batch loss is the mean of these."""
    logratios = policy_logps - ref_logps  # r
    desirable_losses = desirable_weight * (1 - torch.sigmoid(beta * (logratios - z0)))
    undesirable_losses = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - logratios)))
    return torch.where(desirable, desirable_losses, undesirable_losses)


@dataclass(frozen=True)
class KTOScore:
    """One unpaired example's log-probs and loss (the score/forward stages' output): its answer
    and the mismatched answer in the same forward, and the reference point it was judged from."""

    policy: float
    ref: float
    policy_kl: float  # the mismatched completion under this prompt (a z0 sample)
    ref_kl: float
    desirable: bool
    z0: float
    beta: float
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    @property
    def logratio(self) -> float:
        return self.policy - self.ref

    @property
    def kl_logratio(self) -> float:
        return self.policy_kl - self.ref_kl

    @property
    def loss(self) -> float:
        return kto_loss(torch.tensor(self.policy, dtype=torch.float64), torch.tensor(self.ref, dtype=torch.float64),
                        torch.tensor(self.desirable), self.z0, self.beta, self.desirable_weight,
                        self.undesirable_weight).item()


@dataclass(frozen=True)
class UnpairedMetrics:
    """Held-out unpaired examples: the mean log-ratio r of desirable answers minus that of
    undesirable ones (0 for the base model, where r = 0; up means the adapter separates them),
    and the share of examples on their right side of z0 = 0 (r > 0 desirable, r < 0 undesirable)."""

    margin: float
    desirable_logratio: float
    undesirable_logratio: float
    accuracy: float
    desirable: int
    undesirable: int

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def unpaired_metrics(policy_logps: Tensor, ref_logps: Tensor, desirable: Tensor) -> UnpairedMetrics:
    n = int(policy_logps.numel())
    if n == 0:
        raise ValueError("unpaired metrics need at least one example")
    r = (policy_logps - ref_logps).double()
    up, down = r[desirable], r[~desirable]
    mean_up = up.mean().item() if up.numel() else 0.0
    mean_down = down.mean().item() if down.numel() else 0.0
    right = torch.where(desirable, r > 0, r < 0).float().mean().item()
    return UnpairedMetrics(mean_up - mean_down, mean_up, mean_down, right, int(up.numel()), int(down.numel()))
