"""A model the forward would compute wrong is refused at load, naming what it does not implement:
an unknown checkpoint tensor, a config setting of another family, an unsupported model type.
Known leftovers are ignored by name, and each family's per-layer settings are read as
transformers reads them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from edge_runtime import Engine
from edge_runtime.errors import ModelNotAvailable
from edge_runtime.model.config import ModelConfig
from edge_runtime.model.testing import make_tiny_model_dir


def _copy(src: Path, dst: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    shutil.copytree(src, dst)
    if config:
        path = dst / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors:
        state = load_file(dst / "model.safetensors")
        save_file({**state, **tensors}, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.q_norm.weight", "model.layers.0.post_feedforward_layernorm.weight",
                                  "model.embed_scale"])
def test_a_checkpoint_tensor_the_forward_does_not_use_is_refused_by_name(tiny_model_dir, tmp_path, name):
    folder = _copy(tiny_model_dir, tmp_path / "m", tensors={name: torch.ones(16)})
    with pytest.raises(ModelNotAvailable, match=f"checkpoint tensor {name} is not used"):
        Engine.load(str(folder), dtype="float32")


def test_known_leftover_tensors_are_ignored(tiny_model_dir, tmp_path):
    leftovers = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8), "model.rotary_emb.inv_freq": torch.ones(8)}
    folder = _copy(tiny_model_dir, tmp_path / "m", tensors=leftovers)
    Engine.load(str(folder), dtype="float32")


@pytest.mark.parametrize("setting,value", [
    ("hidden_activation", "gelu_pytorch_tanh"),  # Gemma's name for the activation
    ("hidden_act", "gelu"),
    ("attn_logit_softcapping", 50.0),
    ("final_logit_softcapping", 30.0),
    ("use_qk_norm", True),
    ("embedding_multiplier", 12.0),
    ("logits_scaling", 8.0),
    ("query_pre_attn_scalar", 256),
])
def test_a_config_setting_the_forward_does_not_implement_is_refused_by_name(tiny_model_dir, tmp_path, setting, value):
    folder = _copy(tiny_model_dir, tmp_path / "m", config={setting: value})
    with pytest.raises(ModelNotAvailable, match=setting):
        Engine.load(str(folder), dtype="float32")


@pytest.mark.parametrize("rope,named", [
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic'"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
      "original_max_position_embeddings": 64}, "rope_type 'longrope'"),
])
def test_rope_variants_the_forward_does_not_implement_are_refused(tiny_model_dir, tmp_path, rope, named):
    params = {"rope_type": "default", "rope_theta": 10000.0, **rope}
    folder = _copy(tiny_model_dir, tmp_path / "m", config={"rope_parameters": params})
    with pytest.raises(ModelNotAvailable, match=named):
        ModelConfig.from_dir(folder)


def test_model_types_outside_the_supported_list_are_refused(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, tmp_path / "m", config={"model_type": "cohere", "architectures": ["CohereForCausalLM"]})
    with pytest.raises(ModelNotAvailable, match="model type 'cohere' is not a llama-family model.*supported: .*llama"):
        Engine.load(str(folder), dtype="float32")


def test_a_mix_of_sliding_and_full_attention_layers_gets_a_window_per_layer():
    from transformers import AutoConfig

    qwen2 = AutoConfig.for_model("qwen2", num_hidden_layers=4, use_sliding_window=True, sliding_window=8,
                                 max_window_layers=1)
    assert ModelConfig.from_hf(qwen2).layer_windows == (None, 8, 8, 8)  # layers from max_window_layers slide
    gemma2 = ModelConfig.from_hf(AutoConfig.for_model("gemma2", num_hidden_layers=4, sliding_window=8))
    assert gemma2.layer_windows == (8, None, 8, None) and gemma2.windowed
    with pytest.raises(ValueError, match="layer_windows"):
        _ = gemma2.sliding_window  # no single window to hand to code that assumes one


def test_gemma_settings_are_read_as_transformers_reads_them():
    from transformers import AutoConfig

    g2 = ModelConfig.from_hf(AutoConfig.for_model("gemma2", num_hidden_layers=2, hidden_size=64, head_dim=32,
                                                  query_pre_attn_scalar=24))
    assert (g2.attention_scale, g2.attn_softcap, g2.final_softcap) == (24**-0.5, 50.0, 30.0)
    assert (g2.norm_before_sublayer, g2.norm_after_sublayer, g2.norm_offset, g2.activation) == (True, True, 1.0, "gelu_tanh")
    assert g2.embedding_multiplier == 8.0 and g2.embedding_multiplier_in_dtype and g2.qk_norm is None
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}
    g3 = ModelConfig.from_hf(AutoConfig.for_model("gemma3_text", num_hidden_layers=3, rope_parameters=rope,
                                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"]))
    assert g3.rope_tables == ("full_attention", "sliding_attention") and g3.layer_rope_table == (1, 0, 1)
    assert (g3.qk_norm, g3.attn_softcap, g3.final_softcap) == ("head", None, None)


def test_an_attention_softcap_in_a_gemma3_config_is_refused_by_name():
    """transformers' Gemma 3 attention never applies it: the checkpoint's output is unknown."""
    from transformers import AutoConfig

    with pytest.raises(ModelNotAvailable, match="attn_logit_softcapping=50.0"):
        ModelConfig.from_hf(AutoConfig.for_model("gemma3_text", num_hidden_layers=2, attn_logit_softcapping=50.0))


@pytest.mark.parametrize("model_type,config,named", [
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),  # exact GELU: not GELU-tanh
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma", {}, "model type 'gemma'"),  # Gemma 1 is not implemented
])
def test_gemma_variants_the_forward_does_not_implement_are_refused(model_type, config, named):
    from transformers import AutoConfig

    with pytest.raises(ModelNotAvailable, match=named):
        ModelConfig.from_hf(AutoConfig.for_model(model_type, num_hidden_layers=2, **config))


def test_per_layer_settings_are_read_as_transformers_reads_them():
    from transformers import AutoConfig

    smol = ModelConfig.from_hf(AutoConfig.for_model("smollm3", num_hidden_layers=8))
    assert smol.rope_layers == (True, True, True, False, True, True, True, False)  # 1 = RoPE
    # A window written in the config but switched off is no window (transformers ignores it too).
    assert ModelConfig.from_hf(AutoConfig.for_model("smollm3", num_hidden_layers=4, sliding_window=8)).sliding_window is None
    assert ModelConfig.from_hf(AutoConfig.for_model("qwen2", num_hidden_layers=4, sliding_window=8)).sliding_window is None
    both = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}
    assert ModelConfig.from_hf(AutoConfig.for_model("qwen2", num_hidden_layers=4, **both)).sliding_window == 8
    mistral = ModelConfig.from_hf(AutoConfig.for_model("mistral", num_hidden_layers=2, sliding_window=8))
    assert mistral.sliding_window == 8 and mistral.rope_layers == (True, True)


def test_a_llama_with_biases_needs_every_bias_in_its_checkpoint(tmp_path):
    folder = make_tiny_model_dir(tmp_path / "m", attention_bias=True)
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.self_attn.o_proj.bias"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelNotAvailable, match="missing 1 weights"):
        Engine.load(str(folder), dtype="float32")


def test_each_familys_own_settings_are_read_and_refused_elsewhere():
    from transformers import AutoConfig

    qwen3 = ModelConfig.from_hf(AutoConfig.for_model("qwen3", num_hidden_layers=2, head_dim=32))
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.attention_bias, qwen3.norm_after_sublayer) == ("head", 32, False, False)
    olmo2 = ModelConfig.from_hf(AutoConfig.for_model("olmo2", num_hidden_layers=2))
    assert (olmo2.qk_norm, olmo2.norm_after_sublayer) == ("full", True)
    multipliers = {"embedding_multiplier": 12.0, "attention_multiplier": 0.015625, "residual_multiplier": 0.22,
                   "logits_scaling": 8.0}
    granite = ModelConfig.from_hf(AutoConfig.for_model("granite", num_hidden_layers=2, **multipliers))
    assert (granite.embedding_multiplier, granite.attention_scale, granite.residual_multiplier,
            granite.logits_scaling) == (12.0, 0.015625, 0.22, 8.0)
    assert qwen3.query_scale == 1.0 and granite.query_scale == pytest.approx(0.015625 * granite.head_dim**0.5)
    # Granite's settings mean nothing to a Llama in transformers: refused there, not applied.
    with pytest.raises(ModelNotAvailable, match="residual_multiplier"):
        ModelConfig.from_hf(AutoConfig.for_model("llama", num_hidden_layers=2, residual_multiplier=0.22))
