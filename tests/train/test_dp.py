"""Differential privacy of a fleet round's update (edge_runtime/train/dp.py): clipping to the L2
bound, Gaussian noise of std sigma * C, and epsilon of Gaussian rounds composed under RDP, equal
to Google's dp-accounting (RdpAccountant) for the same (sigma, rounds, delta)."""

from __future__ import annotations

import math

import pytest
import torch

from edge_runtime.train.dp import clip_and_noise, gaussian_rounds_epsilon, l2_norm

# dp_accounting 0.6.0: RdpAccountant(); compose(GaussianDpEvent(sigma), rounds); get_epsilon(delta).
# Recorded from the library (its attrs<24 pin conflicts with the project's, so it is not installed).
DP_ACCOUNTING_0_6_0 = [
    (1.0, 1, 1e-5, 4.728507067217623),
    (1.0, 10, 1e-5, 19.05359753163139),
    (0.5, 3, 1e-5, 21.44485232771325),
    (2.0, 100, 1e-6, 37.429216196844386),
    (5.0, 1, 1e-5, 0.794522032537103),
    (0.8, 20, 1e-5, 40.970493283868805),
    (1.1, 5, 1e-5, 10.941319823567266),
    (0.7, 4, 1e-5, 16.72512084464173),
    (3.0, 50, 1e-7, 15.294424270036243),
]


@pytest.mark.parametrize("sigma, rounds, delta, published", DP_ACCOUNTING_0_6_0)
def test_epsilon_of_gaussian_rounds_equals_dp_accountings(sigma, rounds, delta, published) -> None:
    assert gaussian_rounds_epsilon([sigma] * rounds, delta) == pytest.approx(published, rel=1e-12)


def test_epsilon_is_zero_before_any_round_grows_with_rounds_and_is_unbounded_without_noise() -> None:
    assert gaussian_rounds_epsilon([], 1e-5) == 0.0
    eps = [gaussian_rounds_epsilon([1.0] * n, 1e-5) for n in (1, 2, 5, 20)]
    assert all(math.isfinite(e) for e in eps) and eps == sorted(eps) and len(set(eps)) == 4
    assert math.isinf(gaussian_rounds_epsilon([1.0, 0.0, 1.0], 1e-5))
    # Rounds with different noise compose: between the all-low and the all-high noise figures.
    mixed = gaussian_rounds_epsilon([0.8, 2.0], 1e-5)
    assert gaussian_rounds_epsilon([2.0, 2.0], 1e-5) < mixed < gaussian_rounds_epsilon([0.8, 0.8], 1e-5)


def _update(scale: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {"a": torch.randn(40, 30, generator=gen) * scale, "b": torch.randn(30, 40, generator=gen) * scale}


def test_the_update_is_clipped_as_one_vector_and_left_alone_below_the_bound() -> None:
    update = _update(1.0)
    norm = l2_norm(update.values())
    clipped, before = clip_and_noise(update, norm / 3, 0.0)
    assert before == pytest.approx(norm) and l2_norm(clipped.values()) == pytest.approx(norm / 3, rel=1e-6)
    torch.testing.assert_close(clipped["a"], update["a"] / 3)  # one scale for every tensor
    same, _ = clip_and_noise(update, norm * 2, 0.0)
    torch.testing.assert_close(same["b"], update["b"])
    with pytest.raises(ValueError):
        clip_and_noise(update, 0.0, 1.0)


def test_noise_has_std_sigma_times_the_bound_and_comes_from_the_os_unless_seeded() -> None:
    update = _update(0.0)  # all zeros: what comes back is the noise alone
    noised, _ = clip_and_noise(update, 0.5, 2.0, torch.Generator().manual_seed(1))
    values = torch.cat([t.flatten() for t in noised.values()]).double()
    assert values.std().item() == pytest.approx(1.0, rel=0.05) and abs(values.mean().item()) < 0.07
    again, _ = clip_and_noise(update, 0.5, 2.0, torch.Generator().manual_seed(1))
    torch.testing.assert_close(again["a"], noised["a"])
    first, _ = clip_and_noise(update, 0.5, 2.0)
    second, _ = clip_and_noise(update, 0.5, 2.0)
    assert not torch.equal(first["a"], second["a"])
