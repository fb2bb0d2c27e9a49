"""The fused serving layer (`gguf_layer`, `gguf_kernel.group_matmul`): a grouped product equals the
parts' own int8 products put in model order, bit for bit; the C norm and silu * up are torch's within
a few ulps, and the products they feed within the stated bound of today's; a row's output is the
same alone and among 2-40 rows; the layer path gives today's logits within that bound, applies LoRA
deltas, and stays off wherever it does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edge_runtime.lora import BatchedLoraApplier, LoraSettings
from edge_runtime.model import gguf_kernel, gguf_layer, qweights
from edge_runtime.model.dense import DenseCausalContext, dense_logits
from edge_runtime.model.gguf_load import load_llama_gguf
from edge_runtime.model.gguf_weight import GgufWeight, _qtype, set_activations
from edge_runtime.model.llama import rms_norm
from tests.lora.helpers import ALL_LINEAR, random_adapter
from tests.model.quant_helpers import Q4_K_M_LIKE, tiny_quant_gguf
from tests.model.test_gguf_kernel import _VARIANTS, use_variant

EPS = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    if not gguf_kernel.available():
        pytest.skip("gguf_kernel's compiled library is not built here")
    _, path = tiny_quant_gguf(tmp_path_factory.mktemp("q4km"), Q4_K_M_LIKE, num_layers=3)
    return load_llama_gguf(path, in_place=True)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("MACE_GGUF_ACTIVATIONS", raising=False)
    monkeypatch.delenv(gguf_layer.ENV, raising=False)


@pytest.fixture(params=["compiled", "portable", "avx2"])
def build(request, monkeypatch, model):
    """The machine's build, the portable loops (-DGG_GENERIC: what other machines run) and an
    AVX2-only x86's."""
    if request.param in _VARIANTS:
        use_variant(request.param, monkeypatch)
    return request.param


def _today(weight: GgufWeight, x: torch.Tensor) -> torch.Tensor:
    """The weight's int8 product as the per-op path computes it (inference mode, auto)."""
    with torch.inference_mode():
        return qweights.quant_linear(x, weight)


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


def _bound(weight: GgufWeight, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """|W q8_K(x) - W q8_K(y)| for two preparations x, y of a row a few ulps apart: each within the
    int8 bound of its exact product (sum |w| * dx_b / 2 over 256-blocks), plus |W| |x - y|, plus the
    float summation bound."""
    w = weight.dequantize().double().abs()
    dx = torch.maximum(x.abs(), y.abs()).reshape(x.shape[0], -1, 256).amax(-1).double() / 127
    rounding = (dx * (1 + 1e-6)).repeat_interleave(256, dim=1)  # twice dx / 2
    k = x.shape[1]
    return rounding @ w.T + (x - y).abs().double() @ w.T + 4 * k * EPS * (x.abs().double() @ w.T)


def test_a_grouped_product_is_its_parts_in_model_order(model, build):
    layer = model.layers[1]
    for weight in (layer.qkv_weight, layer.gate_up_weight, layer.o_weight):
        plan = weight.group_plan()
        assert plan is not None and plan.n == weight.shape[0]
        for m in (1, 3, 9, 17):
            x = _x(m, weight.shape[1], m)
            got, kept = gguf_kernel.group_matmul(x, plan, keep=True)
            assert torch.equal(got, _today(weight, x))
            assert torch.equal(kept, x)
            base = _x(m, weight.shape[0], 100 + m)
            on_base, _ = gguf_kernel.group_matmul(x, plan, base=base)
            assert torch.equal(on_base, base + got)


def test_a_plan_refuses_what_it_does_not_take(model):
    assert model.layers[0].gate_up_weight.group_plan() is None  # its up part is Q8_0
    part = model.layers[0].gate_up_weight.raw_parts[1]
    with pytest.raises(gguf_kernel.GGUFKernelError):
        gguf_kernel.GroupPlan([(part.data, _qtype(part.qtype))], part.k, torch.arange(part.n))
    plan = model.layers[1].qkv_weight.group_plan()
    with pytest.raises(gguf_kernel.GGUFKernelError):
        gguf_kernel.group_matmul(_x(2, plan.k + 256, 0), plan)
    with pytest.raises(gguf_kernel.GGUFKernelError):
        gguf_kernel.group_matmul(_x(2, plan.k, 0), plan, gguf_kernel.PREP_NORM)  # no norm weight


def test_the_c_norm_and_silu_are_torchs_within_their_bound(model, build):
    """The prepared rows differ from torch's by a few ulps at most; the products they feed, from
    today's, by at most twice the q8_K half-step bound plus |W| times that difference."""
    layer, cfg = model.layers[1], model.cfg
    for m in (1, 5, 16):
        x = _x(m, cfg.hidden_size, m) * 3
        plan = layer.qkv_weight.group_plan()
        got, hn = gguf_kernel.group_matmul(x, plan, gguf_kernel.PREP_NORM, layer.input_norm.detach(), cfg.norm_offset,
                                           cfg.rms_norm_eps, keep=True)
        want_hn = rms_norm(x, layer.input_norm.detach(), cfg.rms_norm_eps, cfg.norm_offset)
        assert ((hn - want_hn).abs() <= 4 * EPS * want_hn.abs()).all()
        assert torch.equal(got, gguf_kernel.group_matmul(hn, plan)[0])  # the kept row is the one quantised
        want = _today(layer.qkv_weight, want_hn)
        assert ((got - want).abs().double() <= _bound(layer.qkv_weight, hn, want_hn)).all()
        gu = _x(m, 2 * cfg.intermediate_size, 50 + m) * 4
        got, act = gguf_kernel.group_matmul(gu, layer.down_weight.group_plan(), gguf_kernel.PREP_SILU_MUL, keep=True)
        gate, up = gu.chunk(2, dim=-1)
        want_act = F.silu(gate) * up
        assert ((act - want_act).abs() <= 4 * EPS * want_act.abs() + 1e-30).all()
        want = _today(layer.down_weight, want_act)
        assert ((got - want).abs().double() <= _bound(layer.down_weight, act, want_act)).all()


@pytest.mark.parametrize("m", [2, 5, 8, 9, 16, 17, 40, 70])  # 70: the preparation on the pool (GG_PREP_ROWS)
def test_a_rows_grouped_output_is_the_same_alone_and_among_other_rows(model, m, build):
    layer, cfg = model.layers[2], model.cfg
    x, gu = _x(m, cfg.hidden_size, m), _x(m, 2 * cfg.intermediate_size, m + 1)
    base = _x(m, cfg.hidden_size, m + 2)
    calls = [lambda r: gguf_kernel.group_matmul(x[r], layer.qkv_weight.group_plan(), gguf_kernel.PREP_NORM,
                                                layer.input_norm.detach(), 0.0, cfg.rms_norm_eps, keep=True),
             lambda r: gguf_kernel.group_matmul(gu[r], layer.down_weight.group_plan(), gguf_kernel.PREP_SILU_MUL,
                                                keep=True, base=base[r])]
    for call in calls:
        together = call(slice(None))
        for i in range(m):
            alone = call(slice(i, i + 1))
            assert torch.equal(alone[0][0], together[0][i]) and torch.equal(alone[1][0], together[1][i])


def _logits(model, ids: torch.Tensor, lora=None) -> torch.Tensor:
    ctx = DenseCausalContext(1, ids.shape[0], lora=lora)
    with torch.inference_mode():
        return model(ids, torch.arange(ids.shape[0]), ctx)


def _spy(monkeypatch) -> list:
    used = []
    forward = gguf_layer.forward

    def spy(layer, *a, **kw):
        used.append(layer.index)
        return forward(layer, *a, **kw)

    monkeypatch.setattr(gguf_layer, "forward", spy)
    return used


def test_the_layer_path_gives_todays_logits_within_the_bound(model, monkeypatch, build):
    """Layers 1 and 2 (K-quants only) take the fused path, layer 0 (a Q8_0 part) today's; the logits
    are today's int8 path's within the C norm's and silu's rounding, and the float path's within
    int8 x's."""
    ids = torch.tensor([3, 17, 5, 99, 42, 7, 12])
    used = _spy(monkeypatch)
    fused = _logits(model, ids)
    assert sorted(set(used)) == [1, 2]
    monkeypatch.setenv(gguf_layer.ENV, "off")
    used.clear()
    today = _logits(model, ids)
    assert used == []
    with torch.no_grad():  # float x (outside inference mode, auto)
        floats = model(ids, torch.arange(ids.shape[0]), DenseCausalContext(1, ids.shape[0]))
    scale = today.abs().max()
    assert (fused - today).abs().max() <= 2e-3 * scale
    assert (fused - floats).abs().max() <= 5e-2 * scale
    assert torch.equal(fused.argmax(-1), today.argmax(-1))


def _adapters(cfg):
    alice = random_adapter(cfg, LoraSettings(rank=4, alpha=8, target_modules=ALL_LINEAR), seed=1)
    bob = random_adapter(cfg, LoraSettings(rank=2, alpha=4, target_modules=("q_proj", "v_proj")), seed=2)
    return alice, bob


def test_lora_deltas_apply_on_the_fused_path(model, monkeypatch):
    """A batch mixing two users' adapters and a base row (`BatchedLoraApplier`): each row is today's
    within the bound, an adapter changes its rows, and the base row is bit for bit the same as
    without any adapter in the batch."""
    alice, bob = _adapters(model.cfg)
    ids = torch.tensor([[1, 40, 41, 42, 43], [1, 70, 71, 72, 73], [1, 40, 41, 42, 43]])
    n = ids.shape[1]
    rows = [(alice, n), (None, n), (bob, n)]
    used = _spy(monkeypatch)
    with torch.inference_mode():
        fused = dense_logits(model, ids, lora=BatchedLoraApplier.from_rows(rows))
        plain = dense_logits(model, ids)
    assert sorted(set(used)) == [1, 2]
    assert torch.equal(fused[1], plain[1])  # the base row: untouched by the adapters beside it
    monkeypatch.setenv(gguf_layer.ENV, "off")
    with torch.inference_mode():
        today = dense_logits(model, ids, lora=BatchedLoraApplier.from_rows(rows))
    scale = today.abs().max()
    assert (fused - today).abs().max() <= 2e-3 * scale
    assert (fused[0] - fused[2]).abs().max() > 1e-2 * scale  # same tokens, different adapters
    assert (fused[0] - plain[0]).abs().max() > 1e-2 * scale


def test_the_path_stays_off_where_it_does_not_apply(model, monkeypatch):
    layer, ctx = model.layers[1], DenseCausalContext(1, 2)
    x = _x(2, model.cfg.hidden_size, 0)
    with torch.inference_mode():
        assert gguf_layer.plans(layer, x, ctx) is not None
        assert gguf_layer.plans(model.layers[0], x, ctx) is None  # a Q8_0 part
        assert gguf_layer.plans(layer, x.double(), ctx) is None
        ctx.row_invariant = True  # engine.deterministic
        assert gguf_layer.plans(layer, x, ctx) is None
        ctx.row_invariant = False
        monkeypatch.setenv(gguf_layer.ENV, "off")
        assert gguf_layer.plans(layer, x, ctx) is None
        monkeypatch.delenv(gguf_layer.ENV)
        try:
            set_activations(model, "float")
            assert gguf_layer.plans(layer, x, ctx) is None
        finally:
            set_activations(model, "auto")
    with torch.no_grad():  # auto outside the serving steps: float x
        assert gguf_layer.plans(layer, x, ctx) is None
    monkeypatch.setenv("MACE_GGUF_ACTIVATIONS", "int8")
    with torch.no_grad():
        assert gguf_layer.plans(layer, x, ctx) is not None
    assert gguf_layer.plans(layer, x, ctx) is None  # gradients on: training
