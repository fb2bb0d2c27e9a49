"""The fine-tune stage cost model: affine in rows (a fixed part per layer call plus a part per
row), fitted through two profiled window sizes, and priced per stage from the window shapes."""

from __future__ import annotations

import dataclasses

import pytest

from edge_runtime.lora import LoraSettings
from edge_runtime.model.qweights import CHUNK_ELEMENTS
from edge_runtime.train import AdapterTrainer, DPOSettings, StageKind
from edge_runtime.train.costs import StageCostModel, _affine


def test_affine_fit_passes_through_both_timings() -> None:
    fixed, per_row = _affine(0.010, 0.030, 8, 64)
    assert per_row == pytest.approx(0.020 / 56)
    assert fixed + 8 * per_row == pytest.approx(0.010)
    assert fixed + 64 * per_row == pytest.approx(0.030)


def test_affine_fit_never_goes_negative() -> None:
    # The small window timed slower than the large one (noise): all of it priced per row.
    fixed, per_row = _affine(0.040, 0.030, 8, 64)
    assert fixed == 0.0 and per_row == pytest.approx(0.030 / 64)
    # A steep line whose intercept falls below zero: no negative fixed part.
    fixed, per_row = _affine(0.001, 0.064, 8, 64)
    assert fixed == 0.0 and per_row > 0


def test_profile_measures_both_parts(tiny4) -> None:
    costs = StageCostModel.profile(tiny4, LoraSettings(rank=4, alpha=8), rows=32, small_rows=4, layers=2)
    for name in ("nograd", "grad_fwd", "bwd"):
        fixed = getattr(costs, f"{name}_s_per_layer")
        per_row = getattr(costs, f"{name}_s_per_row_layer")
        assert fixed >= 0 and per_row > 0 and fixed + per_row > 0
    assert costs.saved_bytes_per_row_layer > 0
    with pytest.raises(ValueError, match="small_rows"):
        StageCostModel.profile(tiny4, LoraSettings(rank=4, alpha=8), rows=8, small_rows=8)


def test_estimates_add_the_fixed_part_per_layer_call() -> None:
    base = StageCostModel(nograd_s_per_row_layer=1e-4, grad_fwd_s_per_row_layer=2e-4, bwd_s_per_row_layer=3e-4,
                          head_s_per_row=1e-3, head_grad_s_per_row=2e-3, optimizer_s_per_param=1e-9,
                          saved_bytes_per_row_layer=100.0, hidden_size=8, vocab_size=16)
    affine = dataclasses.replace(base, nograd_s_per_layer=1e-2, grad_fwd_s_per_layer=2e-2, bwd_s_per_layer=3e-2,
                                 head_s=5e-3, head_grad_s=7e-3)
    rows, layers = 10, 4
    # Recomputing (the default): the forward runs without grad, the backward runs the grad
    # forward again before its own work, per window and layer.
    assert affine.forward_window(rows, layers, 0, 0).seconds == pytest.approx(
        base.forward_window(rows, layers, 0, 0).seconds + 1e-2 * layers)
    assert affine.backward_group(rows, layers, 0, windows=3).seconds == pytest.approx(
        base.backward_group(rows, layers, 0).seconds + (2e-2 + 3e-2) * layers * 3)
    # Holding the forward's graphs: the grad forward once, in the forward stage.
    assert affine.forward_window(rows, layers, 0, 0, recompute=False).seconds == pytest.approx(
        base.forward_window(rows, layers, 0, 0, recompute=False).seconds + 2e-2 * layers)
    # The head's fixed part only when the window scores rows.
    assert affine.forward_window(rows, layers, 3, 0, recompute=False).seconds == pytest.approx(
        base.forward_window(rows, layers, 3, 0, recompute=False).seconds + 2e-2 * layers + 7e-3)
    # Backward: one call per window and layer.
    assert affine.backward_group(rows, layers, 0, windows=3, recompute=False).seconds == pytest.approx(
        base.backward_group(rows, layers, 0, recompute=False).seconds + 3e-2 * layers * 3)
    assert affine.score(rows, layers, 2, with_reference=True).seconds == pytest.approx(
        base.score(rows, layers, 2, with_reference=True).seconds + 2 * (1e-2 * layers + 5e-3))
    # Memory estimates do not depend on the timing parts.
    assert affine.forward_window(rows, layers, 3, 0).peak_bytes == base.forward_window(rows, layers, 3, 0).peak_bytes


def test_staged_task_prices_backward_by_its_windows(tiny4, tiny4_tokenizer, pairs) -> None:
    costs = dataclasses.replace(StageCostModel.nominal(tiny4), bwd_s_per_layer=0.01, bwd_s_per_row_layer=0.0,
                                grad_fwd_s_per_layer=0.005, grad_fwd_s_per_row_layer=0.0)
    trainer = AdapterTrainer(tiny4, tiny4_tokenizer, lora=LoraSettings(rank=4, alpha=8),
                             dpo=DPOSettings(window_tokens=4, layers_per_group=2), costs=costs)
    task = trainer.task(pairs[1], score=False)
    windows = sum(1 for s in task.stages if s.kind is StageKind.FORWARD)
    assert windows > 1
    # The recompute runs every window through a layer in one call: the fixed part once a layer.
    backward = [s for s in task.stages if s.kind is StageKind.BACKWARD]
    assert backward and all(s.estimate().seconds == pytest.approx((0.01 + 0.005) * 2) for s in backward)
    # Where LoRA dropout draws, each window replays its own masks: one call per window and layer.
    trainer = AdapterTrainer(tiny4, tiny4_tokenizer, lora=LoraSettings(rank=4, alpha=8, dropout=0.1),
                             dpo=DPOSettings(window_tokens=4, layers_per_group=2), costs=costs)
    backward = [s for s in trainer.task(pairs[1], score=False).stages if s.kind is StageKind.BACKWARD]
    assert backward and all(s.estimate().seconds == pytest.approx((0.01 + 0.005) * 2 * windows) for s in backward)


def test_recompute_estimates_count_layer_inputs_and_one_head_piece(tiny4, tiny4_tokenizer, pairs) -> None:
    # What the forward windows hold for the backward is each layer's input and keys/values per
    # window: the estimate matches the tensors the task keeps (within 20%), and the head's transient bytes
    # are one vocabulary piece's, not [rows, vocab].
    costs = StageCostModel.nominal(tiny4)
    # A profile cached before the model's own figures were fields: the task fills them in.
    cached = dataclasses.replace(costs, intermediate_size=0, workspace_bytes=0)
    trainer = AdapterTrainer(tiny4, tiny4_tokenizer, lora=LoraSettings(rank=4, alpha=8),
                             dpo=DPOSettings(window_tokens=4, layers_per_group=2), costs=cached)
    task = trainer.task(pairs[1], score=False)
    assert task.costs.intermediate_size == tiny4.cfg.intermediate_size and task.costs == costs
    while task.next_stage().kind is not StageKind.BACKWARD:
        task.run_next()
    acts = task._acts
    kept = sum(x.nbytes for layer in acts.inputs for x in layer) + sum(g.nbytes for _, g, _ in acts.head_grads)
    kv = acts.kv
    kept += sum(t.nbytes for part in (kv.prompt_k, kv.prompt_v, kv.comp_k, kv.comp_v) for t in part if t is not None)
    assert abs(task.held_bytes - kept) <= 0.2 * kept
    while not task.done:
        task.run_next()
    wide = dataclasses.replace(costs, vocab_size=1 << 20, hidden_size=1024)
    assert wide.logits_bytes(10) == 3 * 4 * 10 * (CHUNK_ELEMENTS // 1024)
    # Without recompute the forward holds every layer's saved activations instead.
    held = costs.forward_window(64, 4, 0, 0, recompute=False).held_bytes
    assert held == int(costs.saved_bytes_per_row_layer * 64 * 4) > costs.forward_window(64, 4, 0, 0).held_bytes
