"""A GGUF of each family transformers' GGUF loader reads (llama; Mistral, which llama.cpp writes as
llama; qwen2; qwen3; phi3; gemma2; gemma3), written as llama.cpp's converter writes it from a tiny
random model with the family's distinctive settings on, loads through `Engine.load(file.gguf)` and
computes what transformers' own load of that file computes, and what the model it was written from
computes. Where transformers' config table leaves a setting out (Phi-3's rotary dims, LongRoPE
and window; Qwen3's head width; Gemma's soft-caps, query_pre_attn_scalar, layer pattern and
Gemma 3's per-layer RoPE), the engine reads it back from the metadata or derives it as llama.cpp
does. GGUFs of the families transformers cannot load (granite, olmo2, smollm3), and metadata or
tensors it would drop, are refused by name before any conversion."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from edge_runtime import Engine
from edge_runtime.errors import ModelNotAvailable
from edge_runtime.model import gguf_config
from edge_runtime.model.testing import make_tiny_gguf, make_tiny_model_dir
from tests.engine.helpers import engine_logits_for, reference_logits
from tests.families.test_families import FAMILIES

PHI3_LONGROPE = FAMILIES["phi3"]["rope_scaling"]
GGUF_FAMILIES = {
    "llama": {"tie_word_embeddings": False},  # an output.weight tensor
    "mistral": {"model_type": "mistral"},  # general.name says mistral; the window stays transformers' default
    "qwen2": {"model_type": "qwen2"},  # q/k/v biases
    "qwen3": {"model_type": "qwen3", "config": {"head_dim": 32}},  # attention.key_length read back
    # Phi-3.5-like: untied, partial rotary, LongRoPE past 16 tokens, window of 8
    "phi3": FAMILIES["phi3"],
    # Phi-4-mini-like: tied, partial rotary, LongRoPE, no window (written as 0)
    "phi3-tied": {"model_type": "phi3", "rope_scaling": PHI3_LONGROPE,
                  "config": {"original_max_position_embeddings": 16}},
    # Gemma 2: heads of 32 where hidden / heads is 16 (attention.key_length read back), the
    # attention scale llama.cpp derives from it (transformers' default is 256 ** -0.5), soft-caps
    # that bite on these weights and a window of 8 (its defaults: 50, 30, 4096), sliding and full
    # layers alternating; (1 + w) norms stored as 1 + w.
    "gemma2": {"model_type": "gemma2", "num_layers": 4,
               "config": {"head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 8,
                          "attn_logit_softcapping": 0.5, "final_logit_softcapping": 3.0}},
    # Gemma 3: 7 layers so that the sixth is full and the seventh slides again; sliding layers
    # turning with base 10 (rope.freq_base_swa; transformers' default 10000), full ones with 1e6
    # scaled linearly by 2 (dropped by transformers), a final soft-cap (off by default).
    "gemma3": {"model_type": "gemma3_text", "num_layers": 7,
               "config": {"head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 8,
                          "final_logit_softcapping": 3.0,
                          "rope_parameters": {
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                              "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}}},
}
PROMPTS = (10, 20)  # phi3: one prompt crosses the LongRoPE switch while decoding, one starts past it;
# gemma: both outgrow the window of 8
STEPS = 8
TOLERANCE = 1e-4


@dataclass
class GgufCase:
    name: str
    folder: Path  # the model the files were written from
    exact: Path  # F32 GGUF
    quantized: Path  # Q8_0 GGUF
    prompts: list[list[int]]


@pytest.fixture(scope="module", params=sorted(GGUF_FAMILIES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> GgufCase:
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    folder = make_tiny_model_dir(root / "hf", random_norms=True, **GGUF_FAMILIES[request.param])
    (root / "exact").mkdir()
    (root / "q8").mkdir()
    exact = make_tiny_gguf(folder, root / "exact" / "tiny.F32.gguf", quantize=False)
    quantized = make_tiny_gguf(folder, root / "q8" / "tiny.Q8_0.gguf")
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in PROMPTS]
    return GgufCase(request.param, folder, exact, quantized, prompts)


@pytest.fixture(autouse=True)
def private_state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine.load(file.gguf) converts into the shared model cache: a private one (and a private
    state directory), so tests leave nothing in the user's ~/.cache."""
    monkeypatch.setenv("MACE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("MACE_CACHE_DIR", str(tmp_path / "cache"))


def _per_step_reference(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    ids, logits = list(prompt), []
    for _ in range(STEPS):
        logits.append(reference_logits(model, ids)[-1])
        ids.append(int(logits[-1].argmax()))
    return ids[len(prompt):], torch.stack(logits)


def _transformers_gguf(path: Path) -> torch.nn.Module:
    """transformers' own load of the file, with the settings its config table leaves out put back
    (none for llama, Mistral and qwen2)."""
    where = {"gguf_file": path.name, "local_files_only": True}
    config = AutoConfig.from_pretrained(path.parent, **where)
    overrides = gguf_config.config_overrides(gguf_config.read_header(path))
    if overrides:
        config = AutoConfig.for_model(**{**config.to_dict(), **overrides})
    return AutoModelForCausalLM.from_pretrained(path.parent, config=config, dtype=torch.float32, **where).eval()


def _assert_engine_decodes_like(engine: Engine, reference: torch.nn.Module, prompts: list[list[int]]) -> None:
    for prompt in prompts:
        tokens, logits = _per_step_reference(reference, prompt)
        ours, generated = engine_logits_for(engine, prompt, steps=STEPS)
        assert generated == tokens, f"prompt of {len(prompt)}"
        diff = (ours - logits).abs().max().item()
        assert diff <= TOLERANCE, f"logits differ by {diff:.2e} (prompt of {len(prompt)})"


def test_gguf_loads_through_the_engine_as_the_model_it_was_written_from(case):
    engine = Engine.load(str(case.exact), dtype="float32", kv_cache_bytes=4 << 20, block_size=4, max_batched_tokens=8)
    original = AutoModelForCausalLM.from_pretrained(str(case.folder), local_files_only=True, dtype=torch.float32).eval()
    _assert_engine_decodes_like(engine, original, case.prompts)
    _assert_engine_decodes_like(engine, _transformers_gguf(case.exact), case.prompts)


@pytest.mark.slow  # the exact files above check the same load path; this adds Q8_0 de-quantisation
def test_quantized_gguf_matches_transformers_own_load_of_it(case):
    engine = Engine.load(str(case.quantized), dtype="float32", kv_cache_bytes=4 << 20, block_size=4,
                         max_batched_tokens=8)
    _assert_engine_decodes_like(engine, _transformers_gguf(case.quantized), case.prompts)


@pytest.mark.parametrize("name", ["phi3", "qwen3", "gemma2", "gemma3"])
def test_transformers_config_table_alone_would_lose_the_settings_read_back(name, tmp_path):
    """Why the engine reads the metadata itself: transformers' plain GGUF load of Phi-3 runs full
    rotary without LongRoPE or window, of Gemma with its default soft-caps, attention scale and
    (Gemma 3) RoPE (a different model each), and of this Qwen3 fails outright (it assumes heads of
    128)."""
    folder = make_tiny_model_dir(tmp_path / "hf", random_norms=True, **GGUF_FAMILIES[name])
    path = make_tiny_gguf(folder, tmp_path / "tiny.gguf", quantize=False)
    where = {"gguf_file": path.name, "local_files_only": True}
    if name == "qwen3":
        with pytest.raises((RuntimeError, ValueError), match="mismatched_sizes|size mismatch"):
            AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **where)
        return
    plain = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **where).eval()
    if name == "phi3":
        assert plain.config.rope_parameters["rope_type"] == "default"
        assert plain.config.sliding_window is None
    else:
        assert plain.config.query_pre_attn_scalar == 256
        assert plain.config.final_logit_softcapping in (30.0, None)  # 3.0 in the file
    original = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32).eval()
    ids = list(range(3, 23))
    assert (reference_logits(plain, ids) - reference_logits(original, ids)).abs().max().item() > 100 * TOLERANCE


@pytest.mark.parametrize("model_type,arch", [("granite", "granite"), ("olmo2", "olmo2"), ("smollm3", "smollm3")])
def test_gguf_of_a_family_transformers_cannot_load_is_refused_by_name(model_type, arch, tmp_path):
    folder = make_tiny_model_dir(tmp_path / "hf", model_type=model_type)
    path = make_tiny_gguf(folder, tmp_path / "tiny.gguf", quantize=False)
    with pytest.raises(ModelNotAvailable, match=f"GGUF architecture '{arch}' is not one this engine loads"):
        Engine.load(str(path), dtype="float32")
    assert not any((tmp_path / "state" / "models").glob("gguf-*"))  # refused before converting


@pytest.mark.parametrize("model_type,extra,named", [
    ("llama", {"rope_freqs.weight": np.ones(8)}, "rope_freqs: Llama 3.1\\+ 'llama3' scaling"),  # dropped by transformers
    ("llama", {"blk.0.attn_q.bias": np.ones(64)}, "tensors it would skip: blk.0.attn_q.bias"),  # Llama without biases
    ("llama", {"llama.rope.scaling.type": "yarn"}, "RoPE scaling \\('yarn'\\) is not read"),
    # Gemma 3 has no attention soft-cap in llama.cpp or transformers: what a file that sets one means is unknown
    ("gemma3_text", {"gemma3.attn_logit_softcapping": 50.0}, "gemma3.attn_logit_softcapping = 50.0 is not a setting"),
    ("gemma3_text", {"gemma3.rope.scaling.type": "yarn", "gemma3.rope.scaling.factor": 8.0},
     "gemma3.rope.scaling.type = 'yarn' with factor 8.0"),
    # transformers' Gemma 2 turns every layer with one RoPE base
    ("gemma2", {"gemma2.rope.freq_base_swa": 500.0}, "gemma2.rope.freq_base_swa = 500.0"),
], ids=["rope_freqs", "bias", "rope-scaling-key", "gemma3-attn-softcap", "gemma3-yarn", "gemma2-swa-base"])
def test_gguf_contents_transformers_would_drop_are_refused(tmp_path, model_type, extra, named):
    folder = make_tiny_model_dir(tmp_path / "hf", model_type=model_type)
    tensors = {k: v for k, v in extra.items() if isinstance(v, np.ndarray)}
    metadata = {k: v for k, v in extra.items() if not isinstance(v, np.ndarray)}
    path = make_tiny_gguf(folder, tmp_path / "tiny.gguf", quantize=False, extra_tensors=tensors,
                          extra_metadata=metadata)
    with pytest.raises(ModelNotAvailable, match=named):
        Engine.load(str(path), dtype="float32")
    assert not any((tmp_path / "state" / "models").glob("gguf-*"))  # refused before converting


def _gemma_header(arch: str, layers: int, hidden: int, heads: int, head_dim: int, **keys) -> gguf_config.GgufHeader:
    metadata = {"block_count": layers, "embedding_length": hidden, "attention.head_count": heads,
                "attention.key_length": head_dim, "attention.value_length": head_dim, **keys}
    return gguf_config.GgufHeader(arch, {f"{arch}.{k}": v for k, v in metadata.items()}, {})


@pytest.mark.parametrize("arch,layers,hidden,heads,head_dim,scalar", [
    ("gemma2", 42, 3584, 16, 256, 256),  # Gemma 2 9B
    ("gemma2", 46, 4608, 32, 128, 144),  # Gemma 2 27B: hidden / heads
    ("gemma3", 34, 2560, 8, 256, 256),  # Gemma 3 4B
    ("gemma3", 62, 5376, 32, 128, 168),  # Gemma 3 27B: hidden / heads
])
def test_gemma_attention_scale_is_derived_as_llama_cpp_derives_it(arch, layers, hidden, heads, head_dim, scalar):
    """A GGUF has no query_pre_attn_scalar; llama.cpp scales by 1 / sqrt(hidden / heads) for the
    27B sizes (known by their layer count) and 1 / sqrt(head_dim) otherwise: the published
    checkpoints' values."""
    overrides = gguf_config.config_overrides(_gemma_header(arch, layers, hidden, heads, head_dim))
    assert overrides["query_pre_attn_scalar"] == scalar


def test_gemma2_settings_a_file_leaves_out_take_llama_cpps_defaults():
    overrides = gguf_config.config_overrides(_gemma_header("gemma2", 4, 64, 4, 32))
    assert (overrides["attn_logit_softcapping"], overrides["final_logit_softcapping"]) == (50.0, 30.0)
    assert overrides["sliding_window"] == 4096
    assert overrides["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert overrides["layer_types"] == ["sliding_attention", "full_attention"] * 2
    every_third = _gemma_header("gemma2", 6, 64, 4, 32, **{"attention.sliding_window_pattern": 3})
    assert gguf_config.config_overrides(every_third)["layer_types"] == ["sliding_attention"] * 2 + ["full_attention"] + \
        ["sliding_attention"] * 2 + ["full_attention"]


def test_gemma3_layer_pattern_and_sliding_rope_follow_the_file_or_llama_cpp():
    """Every 6th layer full unless attention.sliding_window_pattern says otherwise; the sliding
    layers turn with base 10000 where rope.freq_base_swa is absent, never scaled; no window, no
    sliding layer."""
    header = _gemma_header("gemma3", 7, 64, 4, 32, **{"attention.sliding_window": 512, "rope.freq_base": 1e6,
                                                       "rope.scaling.type": "linear", "rope.scaling.factor": 8.0})
    overrides = gguf_config.config_overrides(header)
    assert overrides["layer_types"] == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert overrides["rope_parameters"] == {
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    assert overrides["final_logit_softcapping"] is None
    every_third = _gemma_header("gemma3", 6, 64, 4, 32, **{"attention.sliding_window": 512,
                                                            "attention.sliding_window_pattern": 3})
    assert gguf_config.config_overrides(every_third)["layer_types"] == ["sliding_attention"] * 2 + ["full_attention"] + \
        ["sliding_attention"] * 2 + ["full_attention"]
    no_window = gguf_config.config_overrides(_gemma_header("gemma3", 3, 64, 4, 32))
    assert no_window["sliding_window"] is None and no_window["layer_types"] == ["full_attention"] * 3
