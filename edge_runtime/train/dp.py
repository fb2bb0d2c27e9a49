"""Differential privacy of what a device sends in a fleet round: the update clipped to an L2
bound C and Gaussian noise N(0, (sigma C)^2) added to every coordinate (DP-FedAvg, McMahan et al.
2018, with the noise added on the device), and the accounting of epsilon over rounds.

Accounting: each round is one Gaussian mechanism of L2 sensitivity C (the device's whole update,
add/remove of its local data) and noise multiplier sigma, whose Renyi DP at order alpha is
alpha / (2 sigma^2) (Mironov 2017, Prop. 7); rounds compose by adding RDP; (epsilon, delta)
follows from Canonne, Kamath & Steinke 2020, Prop. 12: epsilon = min over alpha of
RDP(alpha) + log(1 - 1/alpha) - log(delta alpha) / (alpha - 1). Orders and formula are those of
Google's `dp-accounting` (RdpAccountant, version 0.6.0), so the numbers match it; that library is
not a dependency (it pins scipy, dm-tree and an old attrs), tests compare against its values.
No subsampling amplification: a device cannot know how the server samples devices.
Knows tensors and numbers only; nothing of rounds' transport or storage.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

# dp_accounting.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS
RDP_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64))
                                      + [128, 256, 512, 1024])


def l2_norm(tensors: Iterable[Tensor]) -> float:
    """The L2 norm of several tensors taken as one vector (float64 sum of squares)."""
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def clip_and_noise(update: Mapping[str, Tensor], clip: float, noise_multiplier: float,
                   generator: torch.Generator | None = None) -> tuple[dict[str, Tensor], float]:
    """`update` scaled to an L2 norm of at most `clip` (as one vector), plus N(0, (sigma C)^2)
    noise on every coordinate; returns it (float32) and the norm before clipping. The noise comes
    from `generator` when given (tests), else from the OS's randomness: a seed the server knew
    would let it subtract the noise."""
    if not clip > 0 or not math.isfinite(clip):
        raise ValueError(f"the clipping bound must be a positive number; got {clip}")
    if noise_multiplier < 0 or not math.isfinite(noise_multiplier):
        raise ValueError(f"the noise multiplier must be >= 0; got {noise_multiplier}")
    norm = l2_norm(update.values())
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    if generator is None and noise_multiplier > 0:
        generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
    std = noise_multiplier * clip
    out: dict[str, Tensor] = {}
    for name, tensor in update.items():
        clipped = tensor.detach().to(torch.float64, copy=True).cpu() * scale
        if std > 0:
            clipped += torch.randn(clipped.shape, generator=generator, dtype=torch.float64) * std
        out[name] = clipped.to(torch.float32)
    return out, norm


def gaussian_rdp(noise_multiplier: float, orders: Iterable[float] = RDP_ORDERS) -> list[float]:
    """RDP of one Gaussian mechanism (sensitivity 1, std `noise_multiplier`) at each order:
    alpha / (2 sigma^2); infinite without noise."""
    if noise_multiplier <= 0:
        return [math.inf for _ in orders]
    return [a / (2 * noise_multiplier**2) for a in orders]


def epsilon_from_rdp(rdp: Iterable[float], delta: float, orders: Iterable[float] = RDP_ORDERS) -> float:
    """The smallest epsilon the RDP curve gives at `delta` (Canonne, Kamath & Steinke 2020,
    Prop. 12, as dp-accounting computes it)."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1); got {delta}")
    best = math.inf
    for a, r in zip(orders, rdp, strict=True):
        if math.isinf(r):
            continue
        if r < 0:
            eps = 0.0
        elif delta**2 + math.expm1(-r) > 0:
            eps = 0.0  # the KL bound alone gives delta already
        elif a > 1.01:
            eps = r + math.log1p(-1 / a) - math.log(delta * a) / (a - 1)
        else:
            continue
        best = min(best, eps)
    return max(0.0, best)


def gaussian_rounds_epsilon(noise_multipliers: Iterable[float], delta: float) -> float:
    """Epsilon after one Gaussian mechanism per round with these noise multipliers (composed);
    0 before any round, infinite once a round went out without noise."""
    total = [0.0] * len(RDP_ORDERS)
    any_round = False
    for sigma in noise_multipliers:
        any_round = True
        total = [t + r for t, r in zip(total, gaussian_rdp(sigma), strict=True)]
    if not any_round:
        return 0.0
    return epsilon_from_rdp(total, delta)
