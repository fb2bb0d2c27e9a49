"""The torch model on a GGUF read in place (`gguf_load.load_llama_gguf(in_place=True)`): every
matrix is a uint8 view of the file's memory map (`gguf_weight.GgufWeight`), and the model computes
what the block-cache model and transformers' own load of the file compute; the staged DPO task's
LoRA gradients over it equal one full autograd pass; no float copy of a matrix exists, and
autograd saves none."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from edge_runtime.model import gguf_weight, qweights
from edge_runtime.model.block_cache import load_block_cache, write_block_cache
from edge_runtime.model.dense import dense_logits
from edge_runtime.model.gguf_load import dequantized_copy, load_llama_gguf
from edge_runtime.model.gguf_weight import GgufWeight
from edge_runtime.model.mapped_weights import file_mappings
from edge_runtime.model.testing import make_tiny_gguf, make_tiny_model_dir
from edge_runtime.model.tokenizer import Tokenizer
from tests.model.quant_helpers import Q4_K_M_LIKE, tiny_quant_gguf
from tests.train.helpers import (
    full_autograd_grads,
    make_trainer,
    max_rel_error,
    preference_records,
    staged_grads,
)

IDS = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    return tiny_quant_gguf(tmp_path_factory.mktemp("q4km"), Q4_K_M_LIKE)


@pytest.fixture(scope="module")
def q4km_cache(q4km, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache")
    write_block_cache(q4km[1], out)
    return out


def _float_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_every_matrix_is_a_view_of_the_files_map_and_no_float_copy_exists(q4km):
    _, path = q4km
    model = load_llama_gguf(path, in_place=True)
    weights = [m for m in model.modules() if isinstance(m, GgufWeight)]
    assert len(weights) == 2 + 4 * len(model.layers)  # embedding, head; q|k|v, o, gate|up, down
    mapped = [m for m in file_mappings() if m.path == str(path.resolve())]
    for weight in weights:
        for part in weight.raw_parts:
            lo = part.data.data_ptr()
            assert any(m.start <= lo and lo + part.data.numel() <= m.end for m in mapped)
    # Float tensors: the norms alone (hidden-sized vectors), nothing of a matrix's size.
    cfg = model.cfg
    assert _float_bytes(model) == 4 * cfg.hidden_size * (1 + 2 * cfg.num_layers)
    tensor_bytes = sum(int(t.n_bytes) for t in __import__("gguf").GGUFReader(str(path)).tensors if len(t.shape) == 2)
    assert sum(w.nbytes for w in weights) == tensor_bytes


def test_logits_equal_the_block_cache_models(q4km, q4km_cache):
    _, path = q4km
    in_place = load_llama_gguf(path, in_place=True)
    cached = load_block_cache(q4km_cache)
    want = dense_logits(cached, IDS)
    torch.testing.assert_close(dense_logits(in_place, IDS), want, rtol=1e-5, atol=1e-5)
    # The same weights bit for bit: the difference is only where a matmul rounds.
    floats, cached_floats = dict(dequantized_copy(in_place).named_parameters()), dict(
        dequantized_copy(cached).named_parameters())
    assert floats.keys() == cached_floats.keys()
    assert all(torch.equal(floats[name], value) for name, value in cached_floats.items())


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "reference"])
def test_gguf_kernel_path_equals_the_chunked_path(q4km, monkeypatch, compiled):
    """With `gguf_kernel` serving the products (compiled, or its numpy reference path), logits
    and an input gradient equal those of the chunked de-quantisation through `qkernel` (the
    path where `gguf_kernel` is not built) to float32 rounding."""
    from edge_runtime.model import gguf_kernel

    if compiled and not gguf_kernel.available():
        pytest.skip("gguf_kernel's compiled library is not built here")
    _, path = q4km
    model = load_llama_gguf(path, in_place=True)
    x = torch.randn(3, model.cfg.hidden_size, generator=torch.Generator().manual_seed(2), requires_grad=True)
    weight = model.layers[0].qkv_weight
    monkeypatch.setattr(gguf_weight, "kernel", lambda: None)
    chunked = dense_logits(model, IDS)
    y = qweights.quant_linear(x, weight)
    (grad_chunked,) = torch.autograd.grad(y.square().sum(), x)
    if not compiled:
        monkeypatch.setenv(gguf_kernel.ENV, "off")
    monkeypatch.setattr(gguf_weight, "kernel", lambda: gguf_kernel)
    torch.testing.assert_close(dense_logits(model, IDS), chunked, rtol=1e-5, atol=1e-5)
    y_kernel = qweights.quant_linear(x, weight)
    torch.testing.assert_close(y_kernel, y, rtol=1e-5, atol=1e-5)
    (grad_kernel,) = torch.autograd.grad(y_kernel.square().sum(), x)
    torch.testing.assert_close(grad_kernel, grad_chunked, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_logits_equal_transformers_own_load_of_the_file(tmp_path, tie):
    folder = make_tiny_model_dir(tmp_path / "hf", tie_word_embeddings=tie, random_norms=True, num_kv_heads=2)
    (tmp_path / "g").mkdir()
    path = make_tiny_gguf(folder, tmp_path / "g" / "tiny.Q8_0.gguf")
    model = load_llama_gguf(path, in_place=True)
    assert (model.lm_head is None) == tie
    if tie:  # the table is read once: the head is the embedding's own bytes
        assert model.lm_head_weight() is model.embed
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference(IDS).logits
    torch.testing.assert_close(dense_logits(model, IDS), want, rtol=1e-4, atol=1e-4)


def test_f16_matrices_stay_f16_bytes_in_place(tmp_path):
    folder = make_tiny_model_dir(tmp_path / "hf", random_norms=True, num_kv_heads=2)
    (tmp_path / "g").mkdir()
    path = make_tiny_gguf(folder, tmp_path / "g" / "tiny.gguf", block_types={"attn_q.weight": "F16"})
    model = load_llama_gguf(path, in_place=True)
    assert model.layers[0].qkv_weight.qtypes == ["F16", "Q8_0", "Q8_0"]
    blocks = load_llama_gguf(path)  # the re-encoding path keeps such a group in float
    torch.testing.assert_close(dense_logits(model, IDS), dense_logits(blocks, IDS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window, group, compiled", [(None, 2, True), (4, 1, False)])
def test_staged_dpo_lora_gradients_equal_full_autograd_in_place(q4km, window, group, compiled, monkeypatch):
    """Staged equals full autograd over the in-place parts as over the float model de-quantised
    from them. Windows with the products de-quantised a chunk at a time (the float model's own
    rounding, so the float model's error is the bound); without windows through `gguf_kernel`
    (which sums each product in its own order, by row count: at window 4 this random model
    amplifies that to ~9e-4 where the float model shows 5.5e-4, so that case is left out)."""
    folder, path = q4km
    if not compiled:
        monkeypatch.setattr(gguf_weight, "kernel", lambda: None)
    monkeypatch.setattr(qweights, "CHUNK_ELEMENTS", 40_000)  # the backward and the head read chunks too
    tokenizer = Tokenizer(folder)
    pairs = preference_records()[:2]
    model = load_llama_gguf(path, in_place=True)
    trainer = make_trainer(model, tokenizer, window=window, group=group, accumulation=2)
    floats = make_trainer(dequantized_copy(model), tokenizer, window=window, group=group, accumulation=2)
    want, want_float = (full_autograd_grads(t, pairs, accumulation=2) for t in (trainer, floats))
    got, got_float = (staged_grads(t, pairs) for t in (trainer, floats))
    assert all(w.abs().max() > 0 for w in want)
    assert max_rel_error(want, want_float) <= 1e-4 and max_rel_error(got, got_float) <= 1e-4
    assert max_rel_error(got, want) <= max(1e-4, 1.01 * max_rel_error(got_float, want_float))


def test_autograd_saves_no_float_copy_of_a_matrix(q4km):
    folder, path = q4km
    model = load_llama_gguf(path, in_place=True)
    shapes = {tuple(m.shape) for m in model.modules() if isinstance(m, GgufWeight)}
    trainer = make_trainer(model, Tokenizer(folder))
    tokens = trainer.tokenize(preference_records()[0])
    seen: set[tuple[int, ...]] = set()
    from edge_runtime.train.logprobs import pair_logps_dense

    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.add(tuple(t.shape)) or t, lambda t: t):
        pair_logps_dense(model, tokens, trainer.weights).sum()
    assert seen and not shapes & seen


def test_embedding_rows_are_read_from_their_bytes(q4km):
    _, path = q4km
    model = load_llama_gguf(path, in_place=True)
    table = model.embed.dequantize()
    ids = torch.tensor([[0, 5, 306], [5, 5, 1]])
    assert torch.equal(model.embed.embedding(ids), table[ids])
    assert np.array_equal(model.embed.raw_parts[0].model_rows(torch.tensor([5])).data.numpy(),
                          model.embed.raw_0[5:6].numpy())


@pytest.mark.parametrize("activations", ["float", "auto"])
def test_engine_serves_a_gguf_in_place_with_no_weights_cached(tmp_path, monkeypatch, activations):
    """`engine.torch_weights = "gguf"`: the model cache holds the config and the tokenizer only,
    auto picks torch (a graph would re-encode the matrices), and greedy decoding follows
    transformers' own load of the file: to float32 rounding with float x, and within int8 x's
    rounding (`engine.gguf_activations = "auto"`, the serving steps' default) otherwise."""
    from edge_runtime.engine import Engine
    from edge_runtime.model.model_cache import in_place_source
    from tests.engine.helpers import engine_logits_for
    from tests.model.test_gguf_families import STEPS, _per_step_reference

    monkeypatch.setenv("MACE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("MACE_CACHE_DIR", str(tmp_path / "cache"))
    folder = make_tiny_model_dir(tmp_path / "hf", random_norms=True, num_kv_heads=2)
    (tmp_path / "g").mkdir()
    path = make_tiny_gguf(folder, tmp_path / "g" / "tiny.Q8_0.gguf")
    monkeypatch.delenv("MACE_GGUF_ACTIVATIONS", raising=False)
    engine = Engine.load(str(path), backend="auto", torch_weights="gguf", dtype="float32", kv_cache_bytes=4 << 20,
                         block_size=4, max_batched_tokens=8, cost_profile="off", gguf_activations=activations)
    assert engine.backend.name == "torch" and "in place" in engine.backend_choice.reason
    (cache,) = [d for d in (tmp_path / "cache" / "models").iterdir() if d.is_dir() and not d.name.startswith(".")]
    assert cache.name.endswith("-in-place") and in_place_source(cache) == path.resolve()
    assert not [f for f in cache.iterdir() if f.suffix == ".safetensors"]
    assert isinstance(engine.model.embed, GgufWeight)
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    prompt = IDS[0].tolist()
    tokens, logits = _per_step_reference(reference, prompt)
    ours, generated = engine_logits_for(engine, prompt, steps=STEPS)
    assert generated == tokens
    assert (ours - logits).abs().max().item() <= (1e-4 if activations == "float" else 2e-2)


def test_auto_reads_in_place_where_a_re_encoded_copy_would_not_fit_the_budget(q4km, tmp_path):
    from edge_runtime.config import EngineConfig
    from edge_runtime.loading import REENCODED_RATIO, reads_in_place

    _, path = q4km
    tensors = sum(int(t.n_bytes) for t in __import__("gguf").GGUFReader(str(path)).tensors)
    config = EngineConfig(model=str(path), backend="auto", device="cpu", torch_weights="auto",
                          finetune_memory_bytes=1 << 20)
    tight = int(REENCODED_RATIO * tensors) + (1 << 20) - 1
    assert reads_in_place(config.replace(memory_budget_bytes=tight))
    assert not reads_in_place(config.replace(memory_budget_bytes=tight + 2))
    assert not reads_in_place(config.replace(memory_budget_bytes=tight, backend="onnxruntime"))
    assert reads_in_place(config.replace(torch_weights="gguf", memory_budget_bytes=1 << 40))
    assert not reads_in_place(config.replace(torch_weights="cache", memory_budget_bytes=1))
    folder = tmp_path / "hf"
    make_tiny_model_dir(folder)
    assert not reads_in_place(config.replace(model=str(folder), memory_budget_bytes=1))
    with pytest.raises(ValueError, match="torch_weights"):
        reads_in_place(config.replace(torch_weights="blocks"))


def test_auto_serves_a_large_block_file_in_place_where_the_kernels_are(q4km, monkeypatch):
    """Past IN_PLACE_FROM_BYTES of tensors (a 1B Q4_K_M file has 763 MiB) "auto" reads a file of
    block matrices in place even where a re-encoded copy fits (its int8 products decode faster); not
    a small file (the default model's 98 MiB), not without the compiled kernels, not a float file."""
    from edge_runtime import loading
    from edge_runtime.config import EngineConfig
    from edge_runtime.model import gguf_config

    _, path = q4km
    header = gguf_config.read_header(path)
    tensors = sum(int(t.n_bytes) for t in header.tensors.values())
    config = EngineConfig(model=str(path), backend="auto", device="cpu", torch_weights="auto",
                          memory_budget_bytes=1 << 40, finetune_memory_bytes=1 << 20)
    assert loading.in_place_is_faster(header, tensors) is None and not loading.reads_in_place(config)
    monkeypatch.setattr(loading, "IN_PLACE_FROM_BYTES", tensors)
    why = loading.in_place_is_faster(header, tensors)
    assert why is not None and all(q in why for q in ("Q4_K", "Q5_K", "Q6_K", "Q8_0"))
    assert loading.reads_in_place(config)
    assert not loading.reads_in_place(config.replace(backend="onnxruntime"))
    assert not loading.reads_in_place(config.replace(torch_weights="cache"))
    monkeypatch.setenv("MACE_GGUF_KERNEL", "off")
    assert loading.in_place_is_faster(header, tensors) is None and not loading.reads_in_place(config)
    monkeypatch.delenv("MACE_GGUF_KERNEL")
    folder = q4km[0].parent / "float-src"
    make_tiny_model_dir(folder)
    (folder.parent / "float").mkdir()
    floats = gguf_config.read_header(make_tiny_gguf(folder, folder.parent / "float" / "tiny.F32.gguf", quantize=False))
    assert loading.in_place_is_faster(floats, 1 << 40) is None


def test_auto_leaves_a_re_encoded_copy_beyond_the_files_own_footprint():
    """The memory rule at real sizes (the random Q4_K_M files' tensor bytes): a 1B or 3B file's
    re-encoded copy stays within 1.25x + 1 GiB (so it is the speed rule, `in_place_is_faster`, that
    serves them in place); an 8B's is not, whatever the budget, so its file's own bytes serve
    (issue #28's 8B bar)."""
    from edge_runtime.loading import reencoded_too_big

    roomy = 1 << 40
    assert reencoded_too_big(800_000_000, roomy, 1 << 30) is None  # Llama-3.2-1B Q4_K_M
    assert reencoded_too_big(2_010_000_000, roomy, 1 << 30) is None  # Llama-3.2-3B Q4_K_M
    why = reencoded_too_big(4_912_898_048, roomy, 1 << 30)  # Llama-3.1-8B Q4_K_M
    assert why is not None and "footprint" in why
    assert "budget" in (reencoded_too_big(800_000_000, 1_500_000_000, 1 << 28) or "")


def test_the_weights_digest_reads_the_files_bytes_without_re_encoding_them(q4km, monkeypatch):
    # The digest (export key, prefix store, self-check memo) of a model read in place hashes the
    # file's rows; re-encoding each matrix into blocks to hash it held ~2.6 GB at an 8B first start.
    from edge_runtime.backends.onnx_export import _hash_weights

    _, path = q4km
    digest = _hash_weights(load_llama_gguf(path, in_place=True))
    monkeypatch.setattr(GgufWeight, "parts", property(lambda self: pytest.fail("re-encoded to hash")))
    again = load_llama_gguf(path, in_place=True)
    assert _hash_weights(again) == digest
    again.layers[0].o_weight.raw_parts[0].data[0, 0] ^= 1  # one byte of the copy-on-write map
    assert _hash_weights(again) != digest
