"""Which Hugging Face model families, config settings and checkpoint tensors our forward implements.

The one place that knows how families differ: `ModelConfig.from_hf` asks it what each layer does
(RoPE or not, the attention window) and the loader which tensors may be left unused. Anything
the forward would silently compute wrong is refused here with `ModelNotAvailable`, naming it.
"""

from __future__ import annotations

import re
from typing import Any

from edge_runtime.errors import ModelNotAvailable

SUPPORTED_MODEL_TYPES = ("gemma2", "gemma3_text", "granite", "llama", "mistral", "olmo2", "phi3", "qwen2", "qwen3",
                         "smollm3")

# What a family's forward does beyond Llama's that its config does not spell out (transformers
# hard-codes it in the family's modeling file), and the settings of UNIMPLEMENTED_SETTINGS that
# the family reads (`reads`: for any other family they stay refused).
#   qk_norm   "head": RMSNorm over each head of q and k (weights of head_dim), before RoPE (Qwen3);
#             "full": over the whole q and k projections (weights of heads * head_dim, OLMo 2)
#   norm_after_sublayer   True: RMSNorm on each sublayer's output before the residual add, none
#             on its input (OLMo 2's post_attention_ and post_feedforward_layernorm)
#   fused_projections   True: q/k/v and gate/up are one checkpoint tensor each (`qkv_proj`,
#             `gate_up_proj`), and so one LoRA target each, as transformers' modules name them
#   rope_types   RoPE types beyond ROPE_TYPES that the family's transformers model implements
#   partial_rotary   True: RoPE turns the first `partial_rotary_factor` of each head only
#   gemma   True: Gemma's RMSNorm (x * (1 + w), in float32), norms on both the input and the
#             output of each sublayer (four per layer), embeddings times sqrt(hidden_size) rounded
#             to the weights' dtype, the gate activation named `hidden_activation`, attention
#             scale query_pre_attn_scalar ** -0.5
#   rope_per_layer_type   True: `rope_parameters` may hold one set per layer type (Gemma 3's
#             sliding layers turn with their own base)
FAMILY_TRAITS: dict[str, dict[str, Any]] = {
    "qwen3": {"qk_norm": "head"},
    "olmo2": {"qk_norm": "full", "norm_after_sublayer": True},
    # Granite 3.x: embeddings times embedding_multiplier, attention scale attention_multiplier
    # (not 1/sqrt(head_dim)), each sublayer's output times residual_multiplier before the
    # residual add, logits divided by logits_scaling.
    "granite": {"reads": ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")},
    # Phi-3 / 3.5 / 4-mini: fused projections, partial rotary (Phi-4-mini: 0.75), LongRoPE (short
    # factors up to original_max_position_embeddings, long ones past it: see RotaryTable).
    "phi3": {"fused_projections": True, "rope_types": ("longrope",), "partial_rotary": True},
    # Gemma 2: attention and final logit soft-capping, sliding and full layers alternating.
    "gemma2": {"gemma": True, "reads": ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar")},
    # Gemma 3 (text): per-head q/k norms, per-layer-type RoPE; transformers' Gemma3Attention does
    # not apply attn_logit_softcapping, so a config that sets it stays refused.
    "gemma3_text": {"gemma": True, "qk_norm": "head", "rope_per_layer_type": True,
                    "reads": ("final_logit_softcapping", "query_pre_attn_scalar")},
}

# The gated MLP's activation, under the name each family's transformers model reads (Gemma:
# `hidden_activation`, every other family `hidden_act`), by its name in transformers' ACT2FN.
ACTIVATION_SETTINGS = ("hidden_act", "hidden_activation")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}

# RoPE types whose inverse frequencies are fixed, so a table built once serves every position.
# "dynamic" changes them with the running length (a paged cache would hold keys rotated under
# other frequencies); "longrope" switches once, at original_max_position_embeddings, and runs only
# where a family lists it in FAMILY_TRAITS (the engine recomputes a sequence that crosses the
# switch); anything else is unknown to this forward.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# Settings of other families this forward does not implement, with the values that mean "off".
# A config that holds one with any other value is refused rather than run without it.
UNIMPLEMENTED_SETTINGS: dict[str, tuple[Any, ...]] = {
    "attn_logit_softcapping": (None,),  # Gemma 2/3
    "final_logit_softcapping": (None,),  # Gemma 2/3
    "query_pre_attn_scalar": (None,),  # Gemma: replaces head_dim in the attention scale
    "use_bidirectional_attention": (None, False),  # Gemma
    "embedding_multiplier": (None, 1.0),  # Granite
    "residual_multiplier": (None, 1.0),  # Granite
    "attention_multiplier": (None,),  # Granite: replaces 1/sqrt(head_dim)
    "logits_scaling": (None, 1.0),  # Granite
    "scale_emb": (None, 1.0),  # MiniCPM
    "scale_depth": (None, 1.0),  # MiniCPM
    "logit_scale": (None, 1.0),  # Cohere
    "use_qk_norm": (None, False),  # Llama 4, Cohere
    "qk_layernorm": (None, False),  # Phi, StableLM
    "clip_qkv": (None,),  # OLMo
    "attn_temperature_tuning": (None, False, 0),  # Llama 4
    "attention_chunk_size": (None,),  # Llama 4
    "num_local_experts": (None, 0, 1),  # mixture of experts
    "num_experts": (None, 0, 1),
}

# Checkpoint tensors that are known leftovers, not weights: ignored by name, nothing else is.
UNUSED_TENSORS = (re.compile(r"^model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$"),)


def check_supported(hf_config: Any) -> None:
    """Refuse a config whose model type or settings our forward does not implement."""
    model_type = getattr(hf_config, "model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelNotAvailable(
            f"model type {model_type!r} is not a llama-family model this engine runs "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    read = activation_setting(hf_config)
    for name in ACTIVATION_SETTINGS:
        act = getattr(hf_config, name, None)
        if name == read and act not in ACTIVATIONS:
            raise ModelNotAvailable(f"{name}={act!r} is not supported (gated MLP with {', '.join(ACTIVATIONS)})")
        if name != read and not _is_gemma(hf_config) and act not in (None, "silu", "swish"):
            # Another family's name for it (a Gemma setting in a Llama config): the model
            # transformers builds ignores it, so the checkpoint was not trained with it.
            raise ModelNotAvailable(f"{name}={act!r} is not supported by {model_type} (it reads {read})")
    reads = FAMILY_TRAITS.get(model_type, {}).get("reads", ())
    for name, off in UNIMPLEMENTED_SETTINGS.items():
        if name in reads:
            continue
        value = getattr(hf_config, name, None)
        if not any(value is v or (v is not None and value == v) for v in off):
            raise ModelNotAvailable(f"config setting {name}={value!r} is not implemented by this engine's forward")
    _check_rope(hf_config)


def _check_rope(hf_config: Any) -> None:
    params = getattr(hf_config, "rope_parameters", None) or {}
    traits = FAMILY_TRAITS.get(getattr(hf_config, "model_type", ""), {})
    if any(isinstance(v, dict) for v in params.values()):
        if not traits.get("rope_per_layer_type"):
            raise ModelNotAvailable(f"rope_parameters per layer type ({', '.join(params)}) are not implemented")
        missing = sorted(set(getattr(hf_config, "layer_types", None) or ()) - set(params))
        if missing:
            raise ModelNotAvailable(f"rope_parameters has no set for layer type(s) {', '.join(missing)}")
        for layer_type in params:
            _check_rope_set(hf_config, params[layer_type] or {}, traits)
        return
    _check_rope_set(hf_config, params, traits)


def _check_rope_set(hf_config: Any, params: dict, traits: dict) -> None:
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES + traits.get("rope_types", ()):
        raise ModelNotAvailable(
            f"rope_type {rope_type!r} is not supported for {hf_config.model_type} (supported: "
            f"{', '.join(ROPE_TYPES + traits.get('rope_types', ()))}; dynamic rescales with the running length, "
            "which a paged cache cannot follow; longrope is implemented for phi3 only)"
        )
    for factor in (params.get("partial_rotary_factor"), getattr(hf_config, "partial_rotary_factor", None)):
        if traits.get("partial_rotary"):
            if factor is not None and not 0.0 < factor <= 1.0:
                raise ModelNotAvailable(f"partial_rotary_factor={factor!r} is outside (0, 1]")
        elif factor is not None and factor != 1.0:
            raise ModelNotAvailable(f"partial_rotary_factor={factor!r} is not implemented (RoPE over the whole head)")


def rope_layers(hf_config: Any, num_layers: int) -> tuple[bool, ...]:
    """Whether each layer rotates q and k. SmolLM3's `no_rope_layers[i]` is 1 where layer i uses
    RoPE and 0 where it is a NoPE layer (transformers' SmolLM3Attention.use_rope)."""
    flags = getattr(hf_config, "no_rope_layers", None)
    if flags is None:
        return (True,) * num_layers
    if len(flags) < num_layers:
        raise ModelNotAvailable(f"no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return tuple(bool(f) for f in flags[:num_layers])


def layer_types(hf_config: Any, num_layers: int) -> tuple[str, ...] | None:
    """Each layer's `layer_types` entry ("full_attention" or "sliding_attention"), or None."""
    types = getattr(hf_config, "layer_types", None)
    if types is None:
        return None
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ModelNotAvailable(f"layer_types {unknown} are not implemented (full and sliding attention only)")
    if len(types) < num_layers:
        raise ModelNotAvailable(f"layer_types has {len(types)} entries for {num_layers} layers")
    return tuple(types[:num_layers])


def layer_windows(hf_config: Any, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's attention window (keys a query sees, itself included), None for full attention.

    Mistral windows every layer; Qwen2 and SmolLM3 only with `use_sliding_window`, and then only
    the layers `layer_types` marks "sliding_attention"; Gemma 2/3 mix sliding and full layers."""
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", True) is False:
        window = None
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ModelNotAvailable(f"sliding_window={window!r} is not a positive number of keys")
    types = layer_types(hf_config, num_layers)
    if types is None:
        return (window,) * num_layers
    return tuple(window if t == "sliding_attention" else None for t in types)


def rope_tables(hf_config: Any, num_layers: int) -> tuple[tuple[str | None, ...], tuple[int, ...]]:
    """The rotary tables a model needs, each by its key in `rope_parameters` (None: the one set
    every layer shares), and each layer's table. Gemma 3 keeps a set per layer type."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if not any(isinstance(v, dict) for v in params.values()):
        return (None,), (0,) * num_layers
    types = layer_types(hf_config, num_layers) or ("full_attention",) * num_layers
    keys = tuple(sorted(set(types)))
    return keys, tuple(keys.index(t) for t in types)


def rope_set(hf_config: Any, key: str | None) -> dict:
    """The RoPE settings of table `key` (see `rope_tables`)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return params if key is None else (params.get(key) or {})


def is_gemma(hf_config: Any) -> bool:
    return _is_gemma(hf_config)


def _is_gemma(hf_config: Any) -> bool:
    return bool(FAMILY_TRAITS.get(getattr(hf_config, "model_type", ""), {}).get("gemma", False))


def activation_setting(hf_config: Any) -> str:
    return "hidden_activation" if _is_gemma(hf_config) else "hidden_act"


def activation(hf_config: Any) -> str:
    """The gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)."""
    return ACTIVATIONS[getattr(hf_config, activation_setting(hf_config), None) or "silu"]


def attention_scale(hf_config: Any, head_dim: int) -> float:
    """The factor on q.k: head_dim ** -0.5; Granite's attention_multiplier; Gemma's
    query_pre_attn_scalar ** -0.5."""
    if _is_gemma(hf_config):
        scalar = getattr(hf_config, "query_pre_attn_scalar", None)
        if scalar is None or scalar <= 0:
            raise ModelNotAvailable(f"query_pre_attn_scalar={scalar!r} is not a positive number")
        return float(scalar) ** -0.5
    return read_setting(hf_config, "attention_multiplier", head_dim**-0.5)


def softcap(hf_config: Any, name: str) -> float | None:
    """A soft-cap (`attn_logit_softcapping`, `final_logit_softcapping`: s -> tanh(s / cap) * cap)
    where the family reads it and sets it; None otherwise."""
    value = read_setting(hf_config, name, 0.0)
    if value < 0:
        raise ModelNotAvailable(f"{name}={value!r} is negative")
    return value or None


def attention_out_bias(hf_config: Any) -> bool:
    """Whether o_proj has a bias: Llama's `attention_bias` covers q/k/v/o; Qwen2's q/k/v biases
    (always on, no setting) leave o_proj without one."""
    return bool(getattr(hf_config, "attention_bias", False)) and hf_config.model_type != "qwen2"


def attention_qkv_bias(hf_config: Any) -> bool:
    return bool(getattr(hf_config, "attention_bias", hf_config.model_type == "qwen2"))


def norms(hf_config: Any) -> tuple[bool, bool]:
    """(before, after): whether each sublayer's input is normalised, and its output before the
    residual add. Llama: (True, False); OLMo 2: (False, True); Gemma: (True, True)."""
    if _is_gemma(hf_config):
        return True, True
    after = norm_after_sublayer(hf_config)
    return not after, after


def qk_norm(hf_config: Any) -> str | None:
    """None, or how q and k are RMS-normalised before RoPE: "head" (each head, Qwen3) or "full"
    (the whole projection, OLMo 2)."""
    return FAMILY_TRAITS.get(hf_config.model_type, {}).get("qk_norm")


def norm_after_sublayer(hf_config: Any) -> bool:
    return bool(FAMILY_TRAITS.get(hf_config.model_type, {}).get("norm_after_sublayer", False))


def fused_projections(hf_config: Any) -> bool:
    return bool(FAMILY_TRAITS.get(hf_config.model_type, {}).get("fused_projections", False))


def rotary_dim(hf_config: Any, head_dim: int) -> int:
    """The leading dimensions of each head that RoPE turns: head_dim, or int(head_dim *
    partial_rotary_factor) where the family reads that factor (transformers' own rounding)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if factor is None or not FAMILY_TRAITS.get(hf_config.model_type, {}).get("partial_rotary"):
        return head_dim
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise ModelNotAvailable(f"partial_rotary_factor={factor!r} turns {dim} of {head_dim} dimensions per head; "
                                "RoPE needs an even number of at least 2")
    return dim


def rope_switch(hf_config: Any) -> int | None:
    """LongRoPE's switch: a sequence longer than this many tokens is computed with the long
    factors, every position of it (transformers picks one set per forward, by its length); None
    for every other RoPE type."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("rope_type") != "longrope":
        return None
    switch = params.get("original_max_position_embeddings")
    if not isinstance(switch, int) or switch < 1:
        raise ModelNotAvailable(f"longrope needs original_max_position_embeddings >= 1, got {switch!r}")
    return switch


def read_setting(hf_config: Any, name: str, default: float) -> float:
    """A scalar setting of UNIMPLEMENTED_SETTINGS for a family that reads it (FAMILY_TRAITS), else
    `default` (the value that means "off"; check_supported refused any other for the rest)."""
    if name not in FAMILY_TRAITS.get(hf_config.model_type, {}).get("reads", ()):
        return default
    value = getattr(hf_config, name, None)
    return default if value is None else float(value)


def is_unused_tensor(name: str) -> bool:
    return any(p.match(name) for p in UNUSED_TENSORS)
