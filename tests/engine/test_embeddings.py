"""Embeddings are transformers' last hidden state (after the final norm), mean-pooled and scaled
to unit length, for text and token-id inputs; bad inputs are bad requests."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from edge_runtime.errors import BadRequest
from tests.engine.helpers import make_engine

TEXTS = ["The quick brown fox", "jumps over the lazy dog.", "a"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


def test_embeddings_are_transformers_pooled_last_hidden_state(engine, tiny_model_dir):
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), local_files_only=True, dtype=torch.float32).eval()
    vectors, tokens = engine.embed(TEXTS)
    assert tokens == sum(len(engine.tokenizer.hf.encode(t)) for t in TEXTS)
    for text, vector in zip(TEXTS, vectors, strict=True):
        ids = torch.tensor([engine.tokenizer.hf.encode(text)])
        with torch.no_grad():
            last = ref(ids, output_hidden_states=True).hidden_states[-1][0]
        expected = torch.nn.functional.normalize(last.mean(0), dim=0)
        got = torch.tensor(vector)
        assert got.shape == (engine.model.cfg.hidden_size,)
        assert torch.allclose(got, expected, atol=1e-5)
        assert abs(got.norm().item() - 1) < 1e-5


def test_token_ids_embed_like_their_text(engine):
    ids = engine.tokenizer.hf.encode(TEXTS[0])
    (by_ids, by_text), _ = engine.embed([ids, TEXTS[0]])
    assert by_ids == by_text


@pytest.mark.parametrize("inputs", [[], [""], ["x"] * 257, [[10**9]]])
def test_bad_inputs_are_bad_requests(engine, inputs):
    with pytest.raises(BadRequest):
        engine.embed(inputs)
