"""What the stage-cost profile runs (issue #28: minutes at the 8B shape read in place): each call
timed `repeats` times after its warm-up while calls are short, once when the warm-up was long, and
the same fit either way."""

from __future__ import annotations

from edge_runtime.lora import LoraSettings
from edge_runtime.train.costs import StageCostModel


def test_long_calls_are_timed_once_after_their_warm_up(tiny4) -> None:
    settings = LoraSettings(rank=4, alpha=8)
    short: dict[str, int] = {}
    long: dict[str, int] = {}
    every = StageCostModel.profile(tiny4, settings, rows=16, small_rows=4, layers=2, repeats=2,
                                   long_call_s=float("inf"), calls=short)
    once = StageCostModel.profile(tiny4, settings, rows=16, small_rows=4, layers=2, repeats=2,
                                  long_call_s=0.0, calls=long)
    # Per window size: no-grad layers, grad forward + backward, the head, the head with its backward.
    assert short == {"layer_forwards": 2 * (3 + 3) * 2, "layer_backwards": 2 * 3 * 2,
                     "head_forwards": 2 * (3 + 3), "head_backwards": 2 * 3}
    assert long == {"layer_forwards": 2 * (2 + 2) * 2, "layer_backwards": 2 * 2 * 2,
                    "head_forwards": 2 * (2 + 2), "head_backwards": 2 * 2}
    for costs in (every, once):
        assert costs.nograd_s_per_row_layer > 0 and costs.bwd_s_per_row_layer > 0 and costs.head_grad_s_per_row > 0
        assert costs.saved_bytes_per_row_layer > 0
    assert once.saved_bytes_per_row_layer == every.saved_bytes_per_row_layer
