"""Every family the engine claims, as a tiny random model built with transformers' own config
class (every distinctive setting switched on, norm weights drawn around 1) and loaded with
`Engine.load(folder)`, against transformers in float32 on the torch backend and on ONNX Runtime
(both graph flavours, dense and paged KV):

* the logits of 16 greedy steps within 1e-4 and the tokens equal on 5 prompts, each alone;
* the same 5 prompts admitted together (decode rows beside prefill chunks) give the same tokens;
* a LoRA adapter saved by PEFT on the transformers model gives PEFT's logits, through our
  batched applier beside a base-model row and served by the engine on every backend;
* the dense training forward, the windowed DPO log-probs, and the staged DPO task's gradients
  against one full autograd pass.

Contexts run past any sliding window, and prompts are prefilled in chunks, so windowed keys are
dropped at both prefill and decode. A family plugs in by adding an entry to FAMILIES with its
distinctive settings switched on; the transformers reference is built once per family."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from edge_runtime import Engine
from edge_runtime.lora import BatchedLoraApplier, LoraWeights
from edge_runtime.lora.adapter import load_adapter
from edge_runtime.model.dense import dense_logits
from edge_runtime.model.testing import make_tiny_model_dir
from edge_runtime.model.tokenizer import Tokenizer
from edge_runtime.model.weights import load_llama
from edge_runtime.train.logprobs import pair_logps
from edge_runtime.train.pairs import PairTokens
from tests.engine.helpers import engine_greedy_batch, engine_logits_for, reference_logits
from tests.train.helpers import (
    full_autograd_grads,
    make_trainer,
    max_rel_error,
    preference_records,
    staged_grads,
)

FAMILIES = {
    "llama": {},
    "qwen2": {"model_type": "qwen2"},  # q/k/v biases (random), no o_proj bias
    # A window far shorter than the contexts (up to 40 tokens).
    "mistral": {"model_type": "mistral", "config": {"sliding_window": 8}},
    # NoPE layers (no_rope_layers[i] == 0) between RoPE ones.
    "smollm3": {"model_type": "smollm3", "num_layers": 4, "config": {"no_rope_layers": [1, 0, 1, 0]}},
    # Per-head q/k norms; head_dim 32 where hidden/heads is 16; every layer windowed.
    "qwen3": {"model_type": "qwen3", "config": {"head_dim": 32, "use_sliding_window": True, "sliding_window": 8,
                                                "max_window_layers": 0}},
    # Every multiplier away from 1 (attention_multiplier replaces 1/sqrt(head_dim) = 0.25).
    "granite": {"model_type": "granite", "config": {"embedding_multiplier": 12.0, "attention_multiplier": 0.1,
                                                    "residual_multiplier": 0.22, "logits_scaling": 8.0}},
    # Norms after each sublayer (random weights, as every family's), q/k norms over the whole projection.
    "olmo2": {"model_type": "olmo2"},
    # Fused qkv_proj / gate_up_proj (checkpoint and PEFT targets), RoPE over 12 of 16 dims per head
    # (Phi-4-mini's 0.75), LongRoPE switching to its long factors past 16 tokens (prompts of 5-13
    # tokens cross it while decoding: the engine recomputes them), a window of 8, untied head.
    "phi3": {"model_type": "phi3", "tie_word_embeddings": False,
             "rope_scaling": {"rope_type": "longrope", "partial_rotary_factor": 0.75,
                              "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0],
                              "long_factor": [1.5, 2.5, 4.0, 6.0, 9.0, 12.0]},
             "config": {"original_max_position_embeddings": 16, "sliding_window": 8}},
    # (1 + w) norms, four per layer; GELU-tanh; embeddings times sqrt(64); head_dim 32 where
    # hidden/heads is 16; attention scale 24 ** -0.5 (not 32 ** -0.5); soft-caps that bite on
    # these weights (the attention cap moves the logits by ~0.03, the final one by ~0.07);
    # sliding (window 8) and full layers alternating; tied head.
    "gemma2": {"model_type": "gemma2", "num_layers": 4,
               "config": {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 8,
                          "attn_logit_softcapping": 0.5, "final_logit_softcapping": 3.0}},
    # Gemma 3: per-head (1 + w) q/k norms; a mix of sliding and full layers, the sliding ones
    # turning with their own RoPE base (10, where the full ones use 1e6 with linear scaling);
    # a final soft-cap (off by default in Gemma 3, honoured where set).
    "gemma3_text": {"model_type": "gemma3_text", "num_layers": 4,
                    "config": {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 8,
                               "final_logit_softcapping": 3.0,
                               "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                                               "sliding_attention"],
                               "rope_parameters": {
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                   "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}}},
}
PROMPT_LENGTHS = (24, 13, 9, 20, 5)
STEPS = 16
LORA_PROMPTS = 2  # the first two prompts, decoded under the PEFT adapter
LORA_STEPS = 8
TOLERANCE = 1e-4
# Blocks of 4 and 8-token prefill chunks: prompts span several chunks, each a continuation
# chunk attending to a cached past that a sliding window partly drops.
CONFIG = dict(dtype="float32", kv_cache_bytes=4 << 20, block_size=4, max_batched_tokens=8)
BACKENDS = [("torch", None, None), ("onnxruntime", "ort", "dense"), ("onnxruntime", "ort", "paged"),
            ("onnxruntime", "standard", "paged")]
BACKEND_IDS = ["torch", "ort-dense", "ort-paged", "standard"]


@dataclass
class Family:
    folder: Path
    reference: torch.nn.Module  # transformers' model, float32
    prompts: list[list[int]]
    expected: list[tuple[list[int], torch.Tensor]]  # per prompt: greedy tokens, their logits
    onnx_cache: Path  # exported graphs, shared by the family's engines


@dataclass
class PeftCase:
    adapter: LoraWeights  # PEFT's saved adapter, loaded by our adapter loader
    model: torch.nn.Module  # PEFT's model around a fresh transformers model
    expected: list[tuple[list[int], torch.Tensor]]  # per LoRA prompt: greedy tokens, their logits


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    root = tmp_path_factory.mktemp(request.param)
    folder = make_tiny_model_dir(root / "model", random_norms=True, **FAMILIES[request.param])
    ref = _reference(folder)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, ref.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    return Family(folder, ref, prompts, [_greedy(ref, p, STEPS) for p in prompts], root / "onnx")


@pytest.fixture(scope="module")
def peft_case(family: Family, tmp_path_factory: pytest.TempPathFactory) -> PeftCase:
    """An adapter on every linear target made by PEFT itself (random non-zero B, saved with
    save_pretrained), and PEFT's greedy tokens and logits under it."""
    from peft import LoraConfig, get_peft_model

    # "all-linear": every projection, as the family's transformers modules name them (Phi-3's fused ones).
    model = get_peft_model(_reference(family.folder), LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    path = tmp_path_factory.mktemp("peft")
    model.save_pretrained(path)
    model.eval()
    adapter = load_adapter(path, load_llama(family.folder).cfg)
    return PeftCase(adapter, model, [_greedy(model, p, LORA_STEPS) for p in family.prompts[:LORA_PROMPTS]])


def _reference(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32).eval()


def _greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    ids, logits = list(prompt), []
    for _ in range(steps):  # greedy without a cache: every step is a full causal forward, whose
        # length picks LongRoPE's factors (as transformers' generate() recomputes at the switch)
        logits.append(reference_logits(model, ids)[-1])
        ids.append(int(logits[-1].argmax()))
    return ids[len(prompt):], torch.stack(logits)


def _engine(family: Family, backend: str, flavour: str | None, kv_layout: str | None) -> Engine:
    if backend != "onnxruntime":
        return Engine.load(str(family.folder), **CONFIG)
    pytest.importorskip("onnxruntime")
    from edge_runtime.backends.onnxruntime_backend import OnnxRuntimeBackend
    from tests.backends.helpers import ort_device

    engine = Engine.load(str(family.folder), **CONFIG, device=ort_device())
    engine.backend = OnnxRuntimeBackend(engine.model, engine.cache, engine.adapters, flavour=flavour,
                                        cache_dir=family.onnx_cache, kv_layout=kv_layout)
    return engine


def _assert_decodes_like(engine: Engine, prompts, expected, steps: int, adapter: str | None = None) -> None:
    for prompt, (tokens, logits) in zip(prompts, expected, strict=True):
        ours, generated = engine_logits_for(engine, prompt, steps=steps, adapter=adapter)
        first = (ours[0] - logits[0]).abs().max().item()
        assert first <= TOLERANCE, f"first-step logits differ by {first:.2e} (prompt of {len(prompt)})"
        assert generated == tokens, f"greedy tokens differ (prompt of {len(prompt)})"
        worst = (ours - logits).abs().max().item()
        assert worst <= TOLERANCE, f"logits differ by {worst:.2e} over {steps} steps (prompt of {len(prompt)})"


@pytest.mark.parametrize("backend,flavour,kv_layout", BACKENDS, ids=BACKEND_IDS)
def test_greedy_decoding_matches_transformers(family, backend, flavour, kv_layout):
    engine = _engine(family, backend, flavour, kv_layout)
    _assert_decodes_like(engine, family.prompts, family.expected, STEPS)


@pytest.mark.parametrize("backend,flavour,kv_layout", BACKENDS, ids=BACKEND_IDS)
def test_batched_greedy_tokens_equal_each_prompt_alone(family, backend, flavour, kv_layout):
    """Alone, each prompt's tokens are transformers' (the test above); together they must be too."""
    engine = _engine(family, backend, flavour, kv_layout)
    batched = engine_greedy_batch(engine, family.prompts, STEPS)
    assert batched == [tokens for tokens, _ in family.expected]


def test_peft_adapter_through_batched_applier_matches_peft(family, peft_case):
    """One batch: a row under PEFT's adapter beside a base-model row of the same tokens."""
    ours = load_llama(family.folder)
    ids = torch.tensor([family.prompts[0]] * 2)
    applier = BatchedLoraApplier.from_rows([(peft_case.adapter, ids.shape[1]), (None, ids.shape[1])])
    with torch.no_grad():
        logits = dense_logits(ours, ids, lora=applier)
        want_lora = peft_case.model(input_ids=ids[:1]).logits[0]
    want_base = reference_logits(family.reference, family.prompts[0])
    assert (logits[0] - want_lora).abs().max().item() <= TOLERANCE
    assert (logits[1] - want_base).abs().max().item() <= TOLERANCE
    # The adapter changes the output well past the tolerance (Granite divides its logits by 8).
    assert (want_lora - want_base).abs().max().item() > 10 * TOLERANCE


@pytest.mark.parametrize("backend,flavour,kv_layout", BACKENDS, ids=BACKEND_IDS)
def test_peft_adapter_served_matches_peft(family, peft_case, backend, flavour, kv_layout):
    engine = _engine(family, backend, flavour, kv_layout)
    engine.publish_adapter("alice", peft_case.adapter)
    _assert_decodes_like(engine, family.prompts[:LORA_PROMPTS], peft_case.expected, LORA_STEPS, adapter="alice")


def test_dense_training_forward_matches_transformers(family):
    ours = load_llama(family.folder)
    ids = torch.randint(3, ours.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        diff = (dense_logits(ours, ids) - family.reference(ids).logits).abs().max().item()
    assert diff <= TOLERANCE


def test_windowed_dpo_log_probs_match_transformers(family):
    """The staged fine-tune's forward (prompt and completion windows over a pair) scores each
    completion as transformers does, past the sliding window."""
    ours = load_llama(family.folder)
    gen = torch.Generator().manual_seed(5)
    prompt, chosen, rejected = (torch.randint(3, ours.cfg.vocab_size, (n,), generator=gen).tolist() for n in (14, 12, 7))
    expected = []
    for completion in (chosen, rejected):
        logits = reference_logits(family.reference, prompt + completion)[len(prompt) - 1 : -1]
        expected.append((logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])).sum().item())
    tokens = PairTokens(tuple(prompt), tuple(chosen), tuple(rejected))
    for window_tokens in (None, 6):
        assert pair_logps(ours, tokens, None, window_tokens) == pytest.approx(expected, abs=1e-4)


def test_staged_dpo_gradients_equal_full_autograd(family):
    """Two pairs accumulated, cut into 5-token windows and 2-layer groups (tests/train's check)."""
    trainer = make_trainer(load_llama(family.folder), Tokenizer(family.folder), window=5, group=2, accumulation=2)
    records = preference_records()[:2]
    want = full_autograd_grads(trainer, records, accumulation=2)
    got = staged_grads(trainer, records)
    assert all(w.abs().max() > 0 for w in want)
    assert max_rel_error(got, want) <= 1e-4
