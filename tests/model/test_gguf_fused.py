"""The fused serving layer's grouped products (`gguf_kernel.group_matmul`): a grouped product equals
the parts' own int8 products put in model order, bit for bit; the C norm and silu * up are torch's
within a few ulps, and the products they feed within the stated bound of today's; a row's output is
the same alone and among 2-40 rows."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from edge_runtime.model import gguf_kernel, qweights
from edge_runtime.model.gguf_load import load_llama_gguf
from edge_runtime.model.gguf_weight import GgufWeight, _qtype
from edge_runtime.model.llama import rms_norm
from tests.model.quant_helpers import Q4_K_M_LIKE, tiny_quant_gguf
from tests.model.test_gguf_kernel import _VARIANTS, _variant_library

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


@pytest.fixture(params=["compiled", "portable", "avx2"])
def build(request, monkeypatch, model):
    """The machine's build, the portable loops (-DGG_GENERIC: what other machines run) and an
    AVX2-only x86's."""
    if request.param in _VARIANTS:
        if request.param == "avx2" and platform.machine() not in ("x86_64", "AMD64"):
            pytest.skip("an x86 build")
        lib = _variant_library(_VARIANTS[request.param])
        if lib is None:
            pytest.skip(f"the {request.param} build is not available here")
        monkeypatch.setattr(gguf_kernel, "_library", lambda: lib)
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


@pytest.mark.parametrize("m", [2, 5, 8, 9, 16, 17, 40])
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
