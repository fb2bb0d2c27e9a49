"""`engine.gguf_activations` on a GGUF read in place (`gguf_weight.GgufWeight`): int8 x (the
kernel's q8_K) in the serving steps (inference mode) under "auto", float x in training and under
no_grad; the environment overrides the setting; a row's int8 product is the same alone and among
other rows; the row-invariant path (`engine.deterministic`) never quantises x."""

from __future__ import annotations

import pytest
import torch

from edge_runtime.config import EngineConfig
from edge_runtime.loading import load_model
from edge_runtime.model import gguf_kernel, gguf_weight, qweights
from edge_runtime.model.gguf_load import load_llama_gguf
from edge_runtime.model.gguf_weight import (
    ACTIVATIONS,
    GgufWeight,
    activations_mode,
    set_activations,
)
from edge_runtime.model.llama import tiled_linear
from tests.model.quant_helpers import Q4_K_M_LIKE, tiny_quant_gguf

ENV = "MACE_GGUF_ACTIVATIONS"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    if not gguf_kernel.available():
        pytest.skip("gguf_kernel's compiled library is not built here")
    _, path = tiny_quant_gguf(tmp_path_factory.mktemp("q4km"), Q4_K_M_LIKE)
    return load_llama_gguf(path, in_place=True)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


def _products(weight: GgufWeight, x: torch.Tensor, int8: bool) -> torch.Tensor:
    """The weight's product straight from the kernel, with x as int8 or float32."""
    outs = []
    for part in weight.raw_parts:
        y = gguf_kernel.matmul(x, part.data, gguf_weight._qtype(part.qtype), part.k, int8_x=int8)
        outs.append(y if part.order is None else y.index_select(-1, part.order))
    return torch.cat(outs, dim=-1)


def _x(weight: GgufWeight, m: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(m, weight.shape[1], generator=torch.Generator().manual_seed(seed))


def test_auto_quantises_x_in_the_serving_steps_only(model):
    weight = model.layers[0].qkv_weight
    assert weight.activations == "auto"
    x = _x(weight, 3)
    int8, f32 = _products(weight, x, True), _products(weight, x, False)
    assert not torch.equal(int8, f32)
    with torch.inference_mode():  # the serving backends' steps
        assert torch.equal(qweights.quant_linear(x, weight), int8)
    with torch.no_grad():  # reference log-probs, evaluation
        assert torch.equal(qweights.quant_linear(x, weight), f32)
    xg = x.clone().requires_grad_(True)  # training's forward
    assert torch.equal(qweights.quant_linear(xg, weight).detach(), f32)


@pytest.mark.parametrize("setting, env, int8", [
    ("int8", None, True), ("float", None, False), ("auto", "f32", False), ("float", "int8", True), ("int8", "float", False),
])
def test_the_setting_and_its_environment_override(model, monkeypatch, setting, env, int8):
    if env is not None:
        monkeypatch.setenv(ENV, env)
    try:
        assert set_activations(model, setting) == sum(isinstance(m, GgufWeight) for m in model.modules())
        weight = model.layers[0].down_weight
        x = _x(weight, 2, 1)
        with torch.inference_mode():
            assert torch.equal(qweights.quant_linear(x, weight), _products(weight, x, int8))
        with torch.no_grad():  # outside the serving steps: int8 only where asked for outright
            assert torch.equal(qweights.quant_linear(x, weight), _products(weight, x, int8 and (env or setting) == "int8"))
    finally:
        set_activations(model, "auto")


def test_unknown_settings_are_refused(monkeypatch):
    assert ACTIVATIONS == ("auto", "int8", "float")
    with pytest.raises(ValueError, match="gguf_activations"):
        activations_mode("q8")
    with pytest.raises(ValueError, match="gguf_activations"):
        load_model(EngineConfig(gguf_activations="bf16"))  # refused before any model is looked for
    monkeypatch.setenv(ENV, "int8")
    assert activations_mode("float") == "int8"


@pytest.mark.parametrize("m", [2, 5, 8, 9, 16, 17, 40])
def test_a_rows_int8_product_is_the_same_alone_and_among_other_rows(model, m):
    """Row invariance with int8 x: each row is quantised on its own and its block sums are exact
    integers, so a row's product does not follow how many rows share the call (past 16 rows, a
    prefill chunk's, the kernel takes them 16 at a time)."""
    for weight in (model.layers[0].qkv_weight, model.layers[-1].down_weight):
        x = _x(weight, m, m)
        with torch.inference_mode():
            together = qweights.quant_linear(x, weight)
            for i in range(m):
                assert torch.equal(qweights.quant_linear(x[i:i + 1], weight)[0], together[i])


def test_the_row_invariant_path_keeps_float_x(model, monkeypatch):
    """`engine.deterministic`'s tiled op gets float row chunks whatever the setting: its rows'
    bits are those of the row-invariant tiles, int8 x never enters."""
    monkeypatch.setenv(ENV, "int8")
    weight = model.layers[0].qkv_weight
    x = _x(weight, 3, 4)
    with torch.inference_mode():
        got = qweights.quant_linear(x, weight, op=tiled_linear)
    monkeypatch.setenv(ENV, "f32")
    with torch.inference_mode():
        assert torch.equal(qweights.quant_linear(x, weight, op=tiled_linear), got)
