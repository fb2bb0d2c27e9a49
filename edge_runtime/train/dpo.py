"""DPO loss and the MACE paper's alignment metrics (sec. 3.1), in the paper's notation.

For a pair (x, y+, y-): Delta+ = log pi_theta(y+|x) - log pi_ref(y+|x), Delta- likewise, and
L_DPO = -log sigma(beta * (Delta+ - Delta-)). (The paper prints the expectation without the
minus sign; minimising it as printed would push the policy away from the preferred answer.)
RPO (Pang et al. 2024) adds alpha * the chosen answer's per-token NLL (docs/training.md). Win rate and CLPD use the policy's log-probs only. Pure tensor math, no model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float,
) -> Tensor:
    """Per-pair loss; sequence log-probs are sums over completion tokens."""
    chosen_logratios = policy_chosen_logps - ref_chosen_logps  # Delta+
    rejected_logratios = policy_rejected_logps - ref_rejected_logps  # Delta-
    logits = beta * (chosen_logratios - rejected_logratios)
    return -F.logsigmoid(logits)


def rpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float,
    alpha: float,
    chosen_tokens: int,
) -> Tensor:
    """DPO plus `alpha` times the chosen answer's mean per-token negative log-likelihood under the
    policy ("Iterative Reasoning Preference Optimization", Pang et al. 2024, eq. 1; TRL's
    `rpo_alpha`). DPO alone can raise the margin by pushing both answers down; the NLL term keeps
    the chosen answer itself likely, so the preferred word is learned in its context."""
    if chosen_tokens < 1:
        raise ValueError("the chosen answer needs at least one token for its NLL")
    nll = -policy_chosen_logps / chosen_tokens
    return dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta) + alpha * nll


def win_rate(policy_chosen_logps: Tensor, policy_rejected_logps: Tensor) -> float:
    """E[1[pi_theta(y+|x) > pi_theta(y-|x)]]."""
    return (policy_chosen_logps > policy_rejected_logps).float().mean().item()


def clpd(policy_chosen_logps: Tensor, policy_rejected_logps: Tensor) -> float:
    """Contrastive log-probability difference E[log pi_theta(y+|x) - log pi_theta(y-|x)]."""
    return (policy_chosen_logps - policy_rejected_logps).mean().item()


@dataclass(frozen=True)
class AlignmentMetrics:
    win_rate: float
    clpd: float
    dpo_loss: float  # mean over the pairs
    reward_accuracy: float  # share of pairs with Delta+ > Delta- (what DPO optimises directly)
    pairs: int

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def alignment_metrics(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float,
) -> AlignmentMetrics:
    n = int(policy_chosen_logps.numel())
    if n == 0:
        raise ValueError("alignment metrics need at least one pair")
    loss = dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta)
    margin = (policy_chosen_logps - ref_chosen_logps) - (policy_rejected_logps - ref_rejected_logps)
    return AlignmentMetrics(
        win_rate=win_rate(policy_chosen_logps, policy_rejected_logps),
        clpd=clpd(policy_chosen_logps, policy_rejected_logps),
        dpo_loss=loss.mean().item(),
        reward_accuracy=(margin > 0).float().mean().item(),
        pairs=n,
    )


@dataclass(frozen=True)
class DPOScore:
    """One pair's log-probs and loss: the score stage's output, the scheduler's priority input."""

    policy_chosen: float
    policy_rejected: float
    ref_chosen: float
    ref_rejected: float
    beta: float
    rpo_alpha: float = 0.0  # weight of the chosen answer's per-token NLL in what is optimised
    chosen_tokens: int = 1

    @property
    def loss(self) -> float:
        """The DPO loss alone: the scheduler's priority input and what status reports, comparable
        whatever `rpo_alpha` is."""
        return dpo_loss(*(torch.tensor(v, dtype=torch.float64) for v in (
            self.policy_chosen, self.policy_rejected, self.ref_chosen, self.ref_rejected)), self.beta).item()

    @property
    def objective_loss(self) -> float:
        """What the update minimises: DPO plus `rpo_alpha` times the chosen answer's NLL per token."""
        return self.loss + self.rpo_alpha * -self.policy_chosen / self.chosen_tokens

    @property
    def chosen_logratio(self) -> float:
        return self.policy_chosen - self.ref_chosen

    @property
    def rejected_logratio(self) -> float:
        return self.policy_rejected - self.ref_rejected
