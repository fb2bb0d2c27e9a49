"""Phi-3 beyond the family matrix (tests/families/test_families.py runs every check there for it).

LongRoPE at the edges of its switch (original_max_position_embeddings = 16): transformers computes
a forward with the short factors while the sequence holds at most 16 tokens and with the long ones,
for every position, past that; its generate() drops the cache when a sequence crosses, and so
does the engine (it prefills the sequence again). Checked against transformers' own generate(),
on every backend; the prefix cache never hands a sequence keys computed with the other factors;
sibling candidates cross together; a DPO pair whose answers fall on both sides of the switch is
scored, and its gradients taken, per sequence as transformers computes each.

Fused LoRA targets: adapters name Phi-3's qkv_proj / gate_up_proj as transformers' modules do,
so one trained here loads into PEFT on transformers' Phi3 with the same logits.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from edge_runtime import Engine, SamplingParams
from edge_runtime.lora import LoraSettings, LoraWeights
from edge_runtime.lora.adapter import load_adapter, save_snapshot
from edge_runtime.lora.config import AdapterError
from edge_runtime.model.dense import dense_logits
from edge_runtime.model.testing import make_tiny_model_dir
from edge_runtime.model.tokenizer import Tokenizer
from edge_runtime.model.weights import load_llama
from edge_runtime.train.dpo import dpo_loss
from edge_runtime.train.logprobs import pair_logps, pair_logps_dense
from edge_runtime.train.pairs import PairTokens
from edge_runtime.train.staged import StageKind
from tests.engine.helpers import engine_logits_for, reference_logits
from tests.families.test_families import BACKEND_IDS, BACKENDS, CONFIG, FAMILIES, TOLERANCE
from tests.lora.helpers import ALL_LINEAR, random_adapter
from tests.train.helpers import make_trainer, max_rel_error

SWITCH = FAMILIES["phi3"]["config"]["original_max_position_embeddings"]
EDGE_PROMPTS = (SWITCH - 1, SWITCH, SWITCH + 1)  # crosses after 2 tokens, after 1, never
EDGE_STEPS = 5


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module, Path]:
    root = tmp_path_factory.mktemp("phi3")
    folder = make_tiny_model_dir(root / "model", random_norms=True, **FAMILIES["phi3"])
    reference = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32).eval()
    return folder, reference, root / "onnx"


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(reference: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' own greedy generate() with its KV cache (which it drops at the switch)."""
    out = reference.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


def _engine(folder: Path, onnx_cache: Path, backend: str, flavour: str | None, kv_layout: str | None,
            **overrides) -> Engine:
    settings = {**CONFIG, **overrides}
    if backend != "onnxruntime":
        return Engine.load(str(folder), **settings)
    pytest.importorskip("onnxruntime")
    from edge_runtime.backends.onnxruntime_backend import OnnxRuntimeBackend
    from tests.backends.helpers import ort_device

    engine = Engine.load(str(folder), **settings, device=ort_device())
    engine.backend = OnnxRuntimeBackend(engine.model, engine.cache, engine.adapters, flavour=flavour,
                                        cache_dir=onnx_cache, kv_layout=kv_layout)
    return engine


@pytest.mark.parametrize("backend,flavour,kv_layout", BACKENDS, ids=BACKEND_IDS)
def test_prompts_at_the_edges_of_the_switch_decode_as_transformers_generate(phi3, backend, flavour, kv_layout):
    folder, reference, onnx_cache = phi3
    engine = _engine(folder, onnx_cache, backend, flavour, kv_layout)
    for n in EDGE_PROMPTS:
        prompt = _prompt(n, seed=n)
        tokens, logits = _generate(reference, prompt, EDGE_STEPS)
        ours, generated = engine_logits_for(engine, prompt, steps=EDGE_STEPS)
        assert generated == tokens, f"prompt of {n}"
        diff = (ours - logits).abs().max().item()
        assert diff <= TOLERANCE, f"logits differ by {diff:.2e} (prompt of {n})"
    # The prompts of 15 and 16 tokens crossed while decoding and were recomputed once each.
    assert engine.stats()["rope_recomputes"] == 2


def test_the_switch_changes_the_logits_of_every_position(phi3):
    """Why the engine recomputes: a token's logits differ whether its sequence is past the switch
    or not, even at positions below it (so re-rotating the cached keys would not be enough)."""
    _, reference, _ = phi3
    ids = _prompt(SWITCH + 4)
    short = reference_logits(reference, ids[:SWITCH])
    long = reference_logits(reference, ids)[:SWITCH]
    assert (short - long).abs().max().item() > 100 * TOLERANCE


def test_prefix_cache_never_mixes_keys_of_the_two_factor_sets(phi3):
    """Cached blocks of a short sequence are not reused by a long one sharing its tokens (nor the
    reverse), while sequences on the same side of the switch share them."""
    folder, reference, _ = phi3
    engine = Engine.load(str(folder), **CONFIG)
    head = _prompt(12, seed=1)
    tail = _prompt(12, seed=2)
    hits = []
    # short; long with the same first 12 tokens; short again; long again (longer still)
    for prompt in (head, head + tail[:8], head, head + tail):
        tokens, logits = _generate(reference, prompt, 2)
        before = engine.stats()["prefix_cache_hit_blocks"]
        ours, generated = engine_logits_for(engine, prompt, steps=2)
        hits.append(engine.stats()["prefix_cache_hit_blocks"] - before)
        assert generated == tokens
        assert (ours - logits).abs().max().item() <= TOLERANCE
    # Blocks of 4: the second prompt finds no short block to reuse, the third reuses the first's
    # (2 of its 3 full blocks: never the one holding its last token), the fourth the second's 5.
    assert hits == [0, 0, 2, 5]


def test_sibling_candidates_cross_the_switch_together(phi3):
    folder, reference, _ = phi3
    engine = Engine.load(str(folder), **CONFIG)
    prompt = _prompt(14, seed=3)
    tokens, _ = _generate(reference, prompt, 6)
    request = engine.add_request("x", SamplingParams(max_tokens=6, n=2, ignore_eos=True))
    for seq in engine.requests[request].seqs:
        seq.token_ids = list(prompt)
    engine.requests[request].prompt_ids = list(prompt)
    out = None
    while engine.has_unfinished():
        for done in engine.step():
            out = done
    assert [c.token_ids for c in out.candidates] == [tokens, tokens]
    assert engine.stats()["rope_recomputes"] == 2


def _straddling_pair() -> PairTokens:
    # prompt + chosen = 18 tokens (long factors), prompt + rejected = 15 (short)
    prompt, chosen, rejected = _prompt(12, seed=4), _prompt(6, seed=5), _prompt(3, seed=6)
    return PairTokens(tuple(prompt), tuple(chosen), tuple(rejected))


def test_dpo_pair_straddling_the_switch_scores_each_answer_as_transformers(phi3):
    folder, reference, _ = phi3
    ours = load_llama(folder)
    pair = _straddling_pair()
    expected = []
    for completion in (pair.chosen, pair.rejected):
        ids = list(pair.prompt) + list(completion)
        logits = reference_logits(reference, ids)[len(pair.prompt) - 1 : -1]
        expected.append(logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None]).sum().item())
    for window_tokens in (None, 4, 6):
        assert pair_logps(ours, pair, None, window_tokens) == pytest.approx(expected, abs=1e-4)
    with torch.no_grad():
        assert pair_logps_dense(ours, pair, None).tolist() == pytest.approx(expected, abs=1e-4)


def test_staged_gradients_of_a_straddling_pair_equal_full_autograd(phi3):
    folder, _, _ = phi3
    trainer = make_trainer(load_llama(folder), Tokenizer(folder), window=5, group=1)
    pair = _straddling_pair()
    ref_c, ref_r = (torch.tensor(v) for v in trainer.reference_logps(pair))
    logps = pair_logps_dense(trainer.model, pair, trainer.weights)
    dpo_loss(logps[0], logps[1], ref_c, ref_r, trainer.dpo.beta).backward()
    want = [p.grad.clone() for p in trainer.weights.parameters()]
    for p in trainer.weights.parameters():
        p.grad = None
    task = trainer.task(pair)
    while task.next_stage().kind is not StageKind.OPTIMIZER:
        task.run_next()
    got = [p.grad.clone() for p in trainer.weights.parameters()]
    assert all(w.abs().max() > 0 for w in want)
    assert max_rel_error(got, want) <= 1e-4


def test_lora_targets_take_the_names_of_phi3_fused_modules(phi3):
    folder, _, _ = phi3
    cfg = load_llama(folder).cfg
    assert LoraSettings().for_model(True).target_modules == ("o_proj", "qkv_proj")
    assert LoraSettings(target_modules=ALL_LINEAR).for_model(True).target_modules == (
        "o_proj", "down_proj", "qkv_proj", "gate_up_proj")
    assert LoraSettings(target_modules=("qkv_proj",)).for_model(False).target_modules == ("q_proj", "k_proj", "v_proj")
    assert set(LoraWeights.init(cfg, LoraSettings()).settings.target_modules) == {"qkv_proj", "o_proj"}
    with pytest.raises(AdapterError, match="fuses q_proj, k_proj, v_proj into qkv_proj"):
        LoraSettings(target_modules=("q_proj", "v_proj")).for_model(True)
    split = LoraWeights(LoraSettings(rank=8, target_modules=("q_proj",)), {(0, "q_proj"): torch.zeros(8, 64)},
                        {(0, "q_proj"): torch.zeros(64, 8)})  # what PEFT could never save on Phi3
    with pytest.raises(AdapterError, match="targets q_proj, which this phi3 model does not have"):
        split.check_shapes(cfg)


def test_an_adapter_trained_here_loads_into_peft_on_transformers_phi3(phi3, tmp_path):
    """The format promise of ARCHITECTURE.md (LoRA is PEFT) on a fused family: our snapshot of an
    all-linear adapter gives PEFT's logits on transformers' own Phi3."""
    from peft import PeftModel

    folder, _, _ = phi3
    ours = load_llama(folder)
    adapter = random_adapter(ours.cfg, LoraSettings(rank=4, alpha=8, target_modules=ALL_LINEAR), seed=3)
    path = save_snapshot(tmp_path / "v1", adapter)
    assert load_adapter(path, ours.cfg).settings.target_modules == ("o_proj", "down_proj", "qkv_proj", "gate_up_proj")
    fresh = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32)
    model = PeftModel.from_pretrained(fresh, str(path)).eval()
    ids = torch.tensor([_prompt(20, seed=7)])
    with torch.no_grad():
        want = model(input_ids=ids).logits[0]
        got = dense_logits(ours, ids, lora=adapter)[0]
        with model.disable_adapter():
            base = model(input_ids=ids).logits[0]
    assert (got - want).abs().max().item() <= TOLERANCE
    assert (want - base).abs().max().item() > 10 * TOLERANCE


@pytest.mark.parametrize("shape", [
    # Phi-3.5-mini: head 96, full rotary, LongRoPE 4k -> 128k, untied
    {"hidden_size": 3072, "num_attention_heads": 32, "partial_rotary_factor": 1.0, "tie_word_embeddings": False},
    # Phi-4-mini: head 128, 96 dims turned, LongRoPE 4k -> 128k, tied
    {"hidden_size": 3072, "num_attention_heads": 24, "partial_rotary_factor": 0.75, "tie_word_embeddings": True},
], ids=["phi3.5-mini", "phi4-mini"])
def test_rotary_table_of_real_phi_shapes_matches_transformers_on_both_sides_of_the_switch(shape):
    """The released models' RoPE settings (their head widths, 4096 -> 131072, attention factor
    sqrt(1 + ln 32 / ln 4096)), built on the meta device: our table rows against transformers'
    Phi3RotaryEmbedding for a forward of 4096 tokens (short factors) and of 4100 (long)."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from edge_runtime.model.config import ModelConfig
    from edge_runtime.model.llama import RotaryTable

    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    half = int(head_dim * shape["partial_rotary_factor"]) // 2
    gen = torch.Generator().manual_seed(0)
    hf = AutoConfig.for_model(
        "phi3", hidden_size=shape["hidden_size"], num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=8, num_hidden_layers=1, intermediate_size=8192, vocab_size=512, pad_token_id=0,
        eos_token_id=0, bos_token_id=0, max_position_embeddings=131072, original_max_position_embeddings=4096,
        tie_word_embeddings=shape["tie_word_embeddings"], sliding_window=262144,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": shape["partial_rotary_factor"],
                         "short_factor": (1 + torch.rand(half, generator=gen) * 0.1).tolist(),
                         "long_factor": (1 + torch.rand(half, generator=gen) * 40).tolist()})
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.rotary_dim, cfg.rope_switch, cfg.fused_projections) == (2 * half, 4096, True)
    table = RotaryTable(cfg, max_positions=4200)
    reference = Phi3RotaryEmbedding(hf)
    x = torch.zeros(1, dtype=torch.float32)
    for length in (4096, 4100):
        positions = torch.arange(length)
        want_cos, want_sin = reference(x, positions[None])
        cos, sin = table.lookup(positions + table.offset(length), torch.float32)
        assert torch.allclose(cos, want_cos[0], atol=1e-6) and torch.allclose(sin, want_sin[0], atol=1e-6), length
    assert reference.attention_scaling == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
