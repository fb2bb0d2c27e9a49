"""KTO loss equals TRL's `KTOTrainer` loss (its own `_compute_loss`, run on a model stand-in) on the
same log-probs, reference point included; the held-out unpaired margin follows its definition."""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from edge_runtime.train.kto import KTOScore, kto_loss, kto_reference_point, unpaired_metrics


class _Accelerator:
    device = torch.device("cpu")

    def gather_for_metrics(self, t):
        return t


def _trl_kto_loss(per_token_logps, completion_mask, labels, ref_logps, kl_logps, ref_kl_logps, beta,
                  desirable_weight, undesirable_weight):
    """TRL 1.x's own `KTOTrainer._compute_loss` (loss_type "kto", precomputed reference log-probs,
    KL term on) with a model stand-in returning these per-token log-probs; the policy's KL
    log-probs are what its `_compute_kl_logps` would return for the mismatched completions."""
    from trl import KTOTrainer

    rows, length = completion_mask.shape
    outputs = types.SimpleNamespace(
        log_probs=per_token_logps, entropy=torch.zeros(rows, length - 1),
        mean_logits=torch.zeros(rows, length - 1),
    )
    trainer_state = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=_Accelerator(), aux_loss_enabled=False,
        precompute_ref_logps=True, calculate_KL=True, loss_type="kto", beta=beta,
        desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
        _compute_kl_logps=lambda model, batch: kl_logps,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )
    inputs = {
        "input_ids": torch.ones(rows, length, dtype=torch.long),
        "attention_mask": torch.ones(rows, length, dtype=torch.long),
        "completion_mask": completion_mask,
        "label": labels,
        "ref_logps": ref_logps,
        "ref_KL_logps": ref_kl_logps,
    }
    return KTOTrainer._compute_loss(trainer_state, lambda **kwargs: outputs, inputs, False)


@pytest.mark.parametrize(("beta", "lambda_d", "lambda_u", "kl_shift"), [
    (0.1, 1.0, 1.0, 0.0),     # z0 clamped at 0 (mismatched log-ratios below the reference)
    (0.5, 1.33, 1.0, 4.0),    # z0 > 0
    (0.1, 1.0, 1.5, 4.0),
])
def test_kto_loss_equals_trl_ktotrainer_loss(beta, lambda_d, lambda_u, kl_shift):
    gen = torch.Generator().manual_seed(1)
    rows, length = 8, 12
    mask = torch.zeros(rows, length, dtype=torch.long)
    for row in range(rows):
        start = 2 + row % 4
        mask[row, start:start + 3 + (row * 5) % (length - start - 3)] = 1
    per_token = -torch.rand(rows, length - 1, generator=gen, dtype=torch.float64) * 3 * mask[:, 1:]
    ref = -torch.rand(rows, generator=gen, dtype=torch.float64) * 20
    labels = torch.tensor([True, False, True, True, False, False, True, False])
    ref_kl = -torch.rand(rows, generator=gen, dtype=torch.float64) * 20
    kl = ref_kl + torch.randn(rows, generator=gen, dtype=torch.float64) + kl_shift - 2.0

    trl = _trl_kto_loss(per_token, mask, labels, ref, kl, ref_kl, beta, lambda_d, lambda_u)

    z0 = kto_reference_point(kl, ref_kl)
    assert (z0.item() == 0.0) == (kl_shift == 0.0)
    ours = kto_loss(per_token.sum(1), ref, labels, z0, beta, lambda_d, lambda_u)
    torch.testing.assert_close(ours.mean(), trl, rtol=0, atol=1e-6)
    one = KTOScore(float(per_token[1].sum()), float(ref[1]), 0.0, 0.0, False, float(z0), beta, lambda_d, lambda_u)
    assert one.loss == pytest.approx(float(ours[1]), abs=1e-12)


def test_kto_reference_point_carries_no_gradient():
    kl = torch.tensor([1.0, 3.0], requires_grad=True)
    z0 = kto_reference_point(kl, torch.zeros(2))
    assert z0.item() == 2.0 and not z0.requires_grad
    assert kto_reference_point(torch.zeros(0), torch.zeros(0)).item() == 0.0


def test_unpaired_margin_is_zero_for_the_base_and_grows_with_separation():
    ref = torch.tensor([-5.0, -6.0, -7.0, -8.0])
    desirable = torch.tensor([True, True, False, False])
    base = unpaired_metrics(ref, ref, desirable)
    assert base.margin == 0.0 and base.accuracy == 0.0
    moved = unpaired_metrics(ref + torch.tensor([1.0, 3.0, -2.0, 0.5]), ref, desirable)
    assert moved.margin == pytest.approx(2.0 - (-0.75))
    assert moved.accuracy == pytest.approx(0.75) and (moved.desirable, moved.undesirable) == (2, 2)
