"""The serving rows' LoRA terms in C (`gguf_lora`, gguf_native_lora.c): each adapter group's term on
its rows equals `scale * (x A^T) B^T` within float32 rounding of a float64 reference and torch's delta,
a row's term is the same bits alone, among other rows, in any subset and on any thread split, rows
of no group are untouched, and the plan steps aside (None) wherever it cannot serve the applier."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from edge_runtime.lora import BatchedLoraApplier, LoraSettings
from edge_runtime.lora.weights import TrainingLora
from edge_runtime.model import gguf_kernel, gguf_lora
from edge_runtime.model.config import ModelConfig
from tests.lora.helpers import ALL_LINEAR, random_adapter

CFG = ModelConfig.from_hf(AutoConfig.for_model("llama", vocab_size=64, hidden_size=64, intermediate_size=96,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))


@pytest.fixture(scope="module")
def lib():
    if not gguf_kernel.available():
        pytest.skip("gguf_kernel's compiled library is not built here")
    return gguf_kernel._library()


def _adapters():
    alice = random_adapter(CFG, LoraSettings(rank=4, alpha=8, target_modules=ALL_LINEAR), seed=1, std=0.5)
    bob = random_adapter(CFG, LoraSettings(rank=3, alpha=3, target_modules=("q_proj", "v_proj", "down_proj")), 2, 0.5)
    return alice, bob


def _stage_inputs(stage: int, m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, out) for a stage: its input rows and its output (q|k|v, o, gate|up, down) before the terms."""
    k = {0: CFG.hidden_size, 1: CFG.q_size, 2: CFG.hidden_size, 3: CFG.intermediate_size}[stage]
    n = {0: CFG.q_size + 2 * CFG.kv_size, 1: CFG.hidden_size, 2: 2 * CFG.intermediate_size, 3: CFG.hidden_size}[stage]
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen), torch.randn(m, n, generator=gen)


def _reference(lora: BatchedLoraApplier, layer: int, stage: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out + every group's term on its rows, in float64."""
    want = out.double().clone()
    for weights, rows in lora.groups:
        rows = torch.arange(x.shape[0]) if rows is None else rows
        for target in gguf_lora.STAGES[stage]:
            a = weights.a.get((layer, target))
            if a is not None:
                col = gguf_lora.column(CFG, target)
                term = x[rows].double() @ a.double().T @ weights.b[(layer, target)].double().T * weights.settings.scale
                want[rows, col: col + term.shape[1]] += term
    return want


@pytest.mark.parametrize("stage", range(4))
def test_each_groups_term_lands_on_its_rows_within_float32_rounding(lib, stage):
    alice, bob = _adapters()
    m = 7
    lora = BatchedLoraApplier.from_rows([(alice, 3), (None, 2), (bob, 2)])
    plan = gguf_lora.plan_for(lora, CFG, CFG.num_layers)
    assert plan is not None and gguf_lora.plan_for(lora, CFG, CFG.num_layers) is plan  # kept on the applier
    for layer in range(CFG.num_layers):
        x, out = _stage_inputs(stage, m, 10 * layer + stage)
        before = out.clone()
        plan.run(lib, layer, stage, x, out, 1)
        want = _reference(lora, layer, stage, x, before)
        bound = 1e-5 * (want.abs() + 1)
        assert ((out.double() - want).abs() <= bound).all()
        assert torch.equal(out[3:5], before[3:5])  # the base rows: untouched
        torch_out = before.clone()
        gguf_lora.add_torch(lora, layer, stage, x, torch_out, CFG)  # the applier's own deltas
        assert ((torch_out.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("m", [1, 5, 64, 1500])  # 1500 rows (x rank 4 x (64 + 128)): over LORA_PARALLEL_MIN, split over the pool's threads
def test_a_rows_term_is_the_same_alone_among_others_and_on_any_thread_split(lib, m):
    alice, _ = _adapters()
    x, out = _stage_inputs(0, m, m)
    together = out.clone()
    gguf_lora.plan_for(BatchedLoraApplier.from_rows([(alice, m)]), CFG, 2).run(lib, 1, 0, x, together, 2)
    one_thread = out.clone()
    gguf_lora.plan_for(BatchedLoraApplier.from_rows([(alice, m)]), CFG, 2).run(lib, 1, 0, x, one_thread, 1)
    assert torch.equal(together, one_thread)
    for i in sorted({0, m // 2, m - 1}):
        alone = out[i: i + 1].clone()
        gguf_lora.plan_for(BatchedLoraApplier.from_rows([(alice, 1)]), CFG, 2).run(lib, 1, 0, x[i: i + 1], alone, 1)
        assert torch.equal(alone[0], together[i])
    subset = out.clone()  # alice's rows a subset of the batch (a group's row indices)
    lora = BatchedLoraApplier.from_rows([(None, m // 2), (alice, m - m // 2)])
    gguf_lora.plan_for(lora, CFG, 2).run(lib, 1, 0, x, subset, 1)
    assert torch.equal(subset[m // 2:], together[m // 2:]) and torch.equal(subset[: m // 2], out[: m // 2])


def test_groups_c_cannot_serve_take_torchs_deltas_and_the_others_keep_their_bits(lib):
    """A bfloat16 adapter or a rank past MAX_RANK go to the plan's `rest`
    (torch's deltas); the C groups beside them give the same bits as alone; another applier: None."""
    alice, bob = _adapters()
    assert gguf_lora.plan_for(TrainingLora(alice), CFG, 2) is None  # not a batched applier
    wide = random_adapter(CFG, LoraSettings(rank=gguf_lora.MAX_RANK + 1, alpha=1.0), seed=3)
    for other, layers in ((bob.to(dtype=torch.bfloat16), 2), (wide, 2)):
        lora = BatchedLoraApplier.from_rows([(alice, 2), (other, 3)])
        plan = gguf_lora.plan_for(lora, CFG, layers)
        assert plan.rest is not None and [w for w, _ in plan.rest.groups] == [other]
        x, out = _stage_inputs(0, 5, 4)
        mixed, alone = out.clone(), out[:2].clone()
        plan.run(lib, 0, 0, x, mixed, 1, CFG)
        gguf_lora.plan_for(BatchedLoraApplier.from_rows([(alice, 2)]), CFG, layers).run(lib, 0, 0, x[:2], alone, 1)
        assert torch.equal(mixed[:2], alone)
        want = out.clone()
        gguf_lora.add_torch(BatchedLoraApplier.from_rows([(None, 2), (other, 3)]), 0, 0, x, want, CFG)
        assert torch.equal(mixed[2:], want[2:])


def test_one_rows_wide_term_splits_its_outputs_over_threads_with_the_same_bits(lib):
    """A lone decode row's term over 8,192 outputs (rank 16: 131,072 multiply-adds, past
    LORA_PARALLEL_MIN) splits its output blocks over the pool: the same bits as on one thread."""
    cfg = ModelConfig.from_hf(AutoConfig.for_model("llama", vocab_size=64, hidden_size=512, intermediate_size=8192,
                                                   num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8))
    up = random_adapter(cfg, LoraSettings(rank=16, alpha=16, target_modules=("up_proj", "down_proj")), seed=5, std=0.5)
    gen = torch.Generator().manual_seed(6)
    for stage, k, n in ((2, 512, 2 * 8192), (3, 8192, 512)):
        x, out = torch.randn(1, k, generator=gen), torch.randn(1, n, generator=gen)
        got = {}
        for threads in (1, 2):
            got[threads] = out.clone()
            gguf_lora.plan_for(BatchedLoraApplier.from_rows([(up, 1)]), cfg, 1).run(lib, 0, stage, x, got[threads], threads)
        assert torch.equal(got[1], got[2]) and not torch.equal(got[1], out)
