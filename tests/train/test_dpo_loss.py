"""DPO loss equals TRL's DPOTrainer sigmoid loss on the same log-probs; win rate and CLPD follow
the MACE paper's definitions."""

from __future__ import annotations

import math
import types
from collections import defaultdict

import pytest
import torch

from edge_runtime.train.dpo import DPOScore, alignment_metrics, clpd, dpo_loss, win_rate


class _Accelerator:
    device = torch.device("cpu")

    def gather_for_metrics(self, t):
        return t

    def gather(self, t):
        return t


def _trl_sigmoid_loss(per_token_logps, completion_mask, ref_chosen, ref_rejected, beta):
    """Run TRL 1.x's own `DPOTrainer._compute_loss` (standard DPO: sigmoid loss, reverse KL,
    precomputed reference log-probs) on a model stand-in that returns these per-token log-probs."""
    from trl import DPOTrainer

    rows, length = completion_mask.shape
    outputs = types.SimpleNamespace(
        log_probs=per_token_logps,  # [2B, L-1], zero outside the completion (TRL masks labels)
        entropy=torch.zeros(rows, length - 1),
        mean_logits=torch.zeros(rows, length - 1),
        is_top1=torch.zeros(rows, length - 1, dtype=torch.bool),
    )
    trainer_state = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=_Accelerator(), aux_loss_enabled=False,
        ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=["sigmoid"],
        loss_weights=[1.0], beta=beta, use_weighting=False, label_smoothing=0.0, ref_model=None,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )
    inputs = {
        "input_ids": torch.ones(rows, length, dtype=torch.long),
        "attention_mask": torch.ones(rows, length, dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }
    return DPOTrainer._compute_loss(trainer_state, lambda **kwargs: outputs, inputs, False)


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_loss_equals_trl_dpotrainer_sigmoid_loss(beta):
    gen = torch.Generator().manual_seed(0)
    pairs, length = 6, 12
    # Prompts of varying length, then completions: the mask marks completion tokens.
    mask = torch.zeros(2 * pairs, length, dtype=torch.long)
    for row in range(2 * pairs):
        start = 2 + row % 4
        stop = start + 3 + (row * 7) % (length - start - 3)
        mask[row, start:stop] = 1
    per_token = -torch.rand(2 * pairs, length - 1, generator=gen, dtype=torch.float64) * 3 * mask[:, 1:]
    ref = -torch.rand(2 * pairs, generator=gen, dtype=torch.float64) * 20

    trl_loss = _trl_sigmoid_loss(per_token, mask, ref[:pairs], ref[pairs:], beta)

    sums = per_token.sum(1)
    ours = dpo_loss(sums[:pairs], sums[pairs:], ref[:pairs], ref[pairs:], beta).mean()
    torch.testing.assert_close(ours, trl_loss, rtol=1e-12, atol=1e-12)


def test_dpo_loss_is_log2_at_the_reference_and_falls_with_the_margin():
    zero = torch.tensor(0.0)
    assert dpo_loss(zero, zero, zero, zero, 0.1).item() == pytest.approx(math.log(2))
    # Delta+ = -5 - (-6) = 1, Delta- = -9 - (-8) = -1: margin 2.
    better = dpo_loss(torch.tensor(-5.0), torch.tensor(-9.0), torch.tensor(-6.0), torch.tensor(-8.0), 0.1)
    assert better.item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.1 * 2))))
    assert DPOScore(-5.0, -9.0, -6.0, -8.0, 0.1).loss == pytest.approx(better.item())


def test_win_rate_and_clpd_follow_the_paper():
    chosen = torch.tensor([-3.0, -10.0, -4.0, -2.0])
    rejected = torch.tensor([-5.0, -6.0, -4.0, -7.0])
    assert win_rate(chosen, rejected) == pytest.approx(0.5)  # ties do not count as wins
    assert clpd(chosen, rejected) == pytest.approx((2 - 4 + 0 + 5) / 4)
    metrics = alignment_metrics(chosen, rejected, chosen, rejected, beta=0.1)
    assert metrics.dpo_loss == pytest.approx(math.log(2))
    assert metrics.reward_accuracy == 0.0 and metrics.pairs == 4
