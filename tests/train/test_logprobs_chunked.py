"""token_logps reads the LM head a piece of the vocabulary at a time (#28): its log-probs and
their gradient equal the whole-logits computation it replaced, on float and quantised heads,
with Granite's scaling and Gemma's soft-cap, whatever the pieces."""

from __future__ import annotations

import copy
import threading
from dataclasses import replace

import pytest
import torch

from edge_runtime.model import qweights
from edge_runtime.model.gguf_load import load_llama_gguf
from edge_runtime.train.logprobs import token_logps
from tests.model.quant_helpers import Q4_K_M_LIKE, tiny_quant_gguf


def whole_logits_logps(model, hidden, targets):
    """The path before: [n, vocab] logits at once."""
    logits = model.logits(hidden).float()
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def logps_and_grad(fn, model, hidden, targets, weights):
    x = hidden.clone().requires_grad_(True)
    out = fn(model, x, targets)
    (out * weights).sum().backward()
    return out.detach(), x.grad


def check(model, monkeypatch, chunk_elements):
    torch.manual_seed(0)
    hidden = torch.randn(7, model.cfg.hidden_size) * 3
    targets = torch.randint(0, model.cfg.vocab_size, (7,))
    targets[0], targets[1] = 0, model.cfg.vocab_size - 1  # the first and last piece's edges
    weights = torch.randn(7)  # a seed that is not all ones: each row's share is checked
    want, want_grad = logps_and_grad(whole_logits_logps, model, hidden, targets, weights)
    monkeypatch.setattr(qweights, "CHUNK_ELEMENTS", chunk_elements)
    got, got_grad = logps_and_grad(token_logps, model, hidden, targets, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # the score and reference stages' way in
        torch.testing.assert_close(token_logps(model, hidden, targets), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pieces_of", [1, 7, 100])
def test_float_head_in_pieces_equals_whole_logits(tiny4, monkeypatch, pieces_of):
    # pieces of `pieces_of` vocabulary rows (1: one row a piece; uneven last piece otherwise)
    check(tiny4, monkeypatch, pieces_of * tiny4.cfg.hidden_size)


@pytest.mark.parametrize("scaling,cap", [(4.0, None), (1.0, 3.0)])
def test_logit_scaling_and_softcap_are_applied_per_piece(tiny4, monkeypatch, scaling, cap):
    model = copy.deepcopy(tiny4)
    model.cfg = replace(model.cfg, logits_scaling=scaling, final_softcap=cap)
    check(model, monkeypatch, 13 * model.cfg.hidden_size)


@pytest.fixture(scope="module")
def tied_quant_model(tmp_path_factory):
    _, gguf = tiny_quant_gguf(tmp_path_factory.mktemp("q4km"), Q4_K_M_LIKE, tie=True)
    model = load_llama_gguf(gguf)
    assert isinstance(model.lm_head_weight(), qweights.QuantWeight)
    return model


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_quantised_tied_head_in_pieces_equals_whole_logits(tied_quant_model, monkeypatch, softcap):
    model = copy.deepcopy(tied_quant_model)
    model.cfg = replace(model.cfg, final_softcap=softcap)
    # The de-quantisation workspace first made in inference mode, as serving makes it: autograd
    # must never save it (the engine's first DPO forward failed so).
    monkeypatch.setattr(qweights, "_WORKSPACES", threading.local())
    monkeypatch.setattr(qweights, "CHUNK_ELEMENTS", 9 * model.cfg.hidden_size)
    with torch.inference_mode():
        model.logits(torch.randn(2, model.cfg.hidden_size))
    check(model, monkeypatch, 9 * model.cfg.hidden_size)
