"""The model built straight from a GGUF's blocks (`gguf_load.load_llama_gguf`): its weights are
the converting path's bit for bit (every type, q/k rows put back in HF order), its logits are
those of the float model de-quantised from the same blocks, the staged DPO task's gradients over
it equal one full autograd pass, and autograd holds no float copy of a quantised weight."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from edge_runtime.errors import ModelNotAvailable
from edge_runtime.model import qweights
from edge_runtime.model.dense import dense_logits
from edge_runtime.model.gguf_load import dequantized_copy, load_llama_gguf
from edge_runtime.model.qweights import QuantWeight
from edge_runtime.model.testing import make_tiny_gguf, make_tiny_model_dir
from edge_runtime.model.tokenizer import Tokenizer
from edge_runtime.model.weights import load_llama
from tests.model.quant_helpers import Q4_K_M_LIKE, tiny_quant_gguf
from tests.train.helpers import (
    full_autograd_grads,
    make_trainer,
    max_rel_error,
    preference_records,
    staged_grads,
)


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    return tiny_quant_gguf(tmp_path_factory.mktemp("q4km"), Q4_K_M_LIKE)


def _converted(gguf_path, out):
    from edge_runtime.model.source import convert_gguf

    out.mkdir()
    convert_gguf(gguf_path, out, progress=False)
    return load_llama(out)


def _assert_same_weights(quant, reference):
    assert dataclasses.replace(quant.cfg, hf_config=None) == dataclasses.replace(reference.cfg, hf_config=None)
    floats = dict(dequantized_copy(quant).named_parameters())
    want = dict(reference.named_parameters())
    assert floats.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(floats[name], value), name


def test_k_quant_mix_weights_equal_the_converting_path_bit_for_bit(q4km, tmp_path):
    folder, path = q4km
    quant = load_llama_gguf(path)
    layer = quant.layers[0]
    assert isinstance(layer.qkv_weight, QuantWeight) and len(layer.qkv_weight.parts) == 2  # Q4_K q|k, Q6_K v
    assert isinstance(quant.embed, QuantWeight) and isinstance(quant.lm_head, QuantWeight)
    assert [p.bits for p in layer.gate_up_weight.parts] == [4, 8]  # Q4_K gate, Q8_0 up
    _assert_same_weights(quant, _converted(path, tmp_path / "converted"))


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_q8_gguf_weights_equal_the_converting_path(tmp_path, tie):
    folder = make_tiny_model_dir(tmp_path / "hf", tie_word_embeddings=tie, random_norms=True, num_kv_heads=2)
    (tmp_path / "g").mkdir()
    path = make_tiny_gguf(folder, tmp_path / "g" / "tiny.Q8_0.gguf")
    quant = load_llama_gguf(path)
    assert (quant.lm_head is None) == tie
    _assert_same_weights(quant, _converted(path, tmp_path / "converted"))


def test_logits_equal_the_float_model_of_the_same_blocks(q4km, monkeypatch):
    _, path = q4km
    quant = load_llama_gguf(path)
    floats = dequantized_copy(quant)
    assert not floats.quantized and quant.quantized
    ids = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    want = dense_logits(floats, ids)
    assert torch.equal(dense_logits(quant, ids), want)
    # Read in row chunks (as a large head is), the same numbers up to the matmul's rounding.
    monkeypatch.setattr(qweights, "CHUNK_ELEMENTS", 3000)
    assert len(list(quant.lm_head.row_chunks())) > 10
    torch.testing.assert_close(dense_logits(quant, ids), want, rtol=1e-5, atol=1e-6)


def test_bfloat16_model_de_quantises_into_its_dtype(q4km):
    _, path = q4km
    quant = load_llama_gguf(path, dtype=torch.bfloat16)
    assert quant.dtype == torch.bfloat16
    ids = torch.randint(3, 300, (1, 7), generator=torch.Generator().manual_seed(1))
    logits = dense_logits(quant, ids)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


@pytest.mark.parametrize("window, group", [(None, 2), (4, 1)])
def test_staged_dpo_gradients_equal_full_autograd_on_the_blocks(q4km, window, group, monkeypatch):
    """Over the blocks, as over the float model de-quantised from them: staged equals full
    autograd (to the float model's own rounding: windows sum attention in another order, and
    this random model amplifies it to 5e-4 at window 4, the float model's figure too), and each
    equals the float model's."""
    folder, path = q4km
    monkeypatch.setattr(qweights, "CHUNK_ELEMENTS", 40_000)  # the backward reads chunks too
    tokenizer = Tokenizer(folder)
    pairs = preference_records()[:2]
    quant = load_llama_gguf(path)
    trainer = make_trainer(quant, tokenizer, window=window, group=group, accumulation=2)
    floats = make_trainer(dequantized_copy(quant), tokenizer, window=window, group=group, accumulation=2)
    want, want_float = (full_autograd_grads(t, pairs, accumulation=2) for t in (trainer, floats))
    got, got_float = (staged_grads(t, pairs) for t in (trainer, floats))
    assert all(w.abs().max() > 0 for w in want)
    assert max_rel_error(want, want_float) <= 1e-5 and max_rel_error(got, got_float) <= 1e-5
    assert max_rel_error(got, want) <= max(1e-4, 1.01 * max_rel_error(got_float, want_float))


def test_autograd_saves_no_float_copy_of_a_quantised_weight(q4km):
    folder, path = q4km
    quant = load_llama_gguf(path)
    shapes = {tuple(m.shape) for m in quant.modules() if isinstance(m, QuantWeight)}
    trainer = make_trainer(quant, Tokenizer(folder))
    tokens = trainer.tokenize(preference_records()[0])

    def saved_shapes(model) -> set[tuple[int, ...]]:
        from edge_runtime.train.logprobs import pair_logps_dense

        seen: set[tuple[int, ...]] = set()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.add(tuple(t.shape)) or t, lambda t: t):
            pair_logps_dense(model, tokens, trainer.weights).sum()
        return seen

    assert not shapes & saved_shapes(quant)
    assert shapes & saved_shapes(dequantized_copy(quant))  # the check sees a float weight where one is kept


def test_other_architectures_are_not_read_from_blocks(tmp_path):
    folder = make_tiny_model_dir(tmp_path / "hf", model_type="qwen2")
    (tmp_path / "g").mkdir()
    path = make_tiny_gguf(folder, tmp_path / "g" / "q.gguf")
    with pytest.raises(ModelNotAvailable, match="qwen2"):
        load_llama_gguf(path)
