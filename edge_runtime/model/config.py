"""The shape of a llama-family model (Llama, Mistral, Qwen2/3, SmolLM, Granite, OLMo 2, Phi-3, Gemma 2/3)
as our forward needs it.

Read from a Hugging Face `config.json` through `transformers.AutoConfig`, which normalises the
many spellings of RoPE settings (`rope_theta`/`rope_scaling` vs `rope_parameters`). What each
family's settings mean, and which are refused, lives in `edge_runtime.model.family`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_runtime.errors import ModelNotAvailable
from edge_runtime.model import family


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases
    attention_out_bias: bool  # o_proj bias
    mlp_bias: bool
    layer_windows: tuple[int | None, ...]  # keys a query of layer i attends to, itself included (None: all)
    rope_layers: tuple[bool, ...]  # whether layer i rotates q and k (SmolLM3's NoPE layers do not)
    rope_tables: tuple[str | None, ...]  # rotary tables by their key in rope_parameters (None: the one set)
    layer_rope_table: tuple[int, ...]  # layer i's rotary table (Gemma 3's sliding layers have their own)
    rotary_dim: int  # leading dims of each head that RoPE turns (head_dim; less with Phi's partial rotary)
    rope_switch: int | None  # LongRoPE: sequences longer than this use the long factors (None: one set)
    fused_projections: bool  # q/k/v and gate/up are single checkpoint tensors and LoRA targets (Phi-3)
    qk_norm: str | None  # RMSNorm of q and k before RoPE: None, "head" (per head, Qwen3), "full" (OLMo 2)
    norm_before_sublayer: bool  # RMSNorm on each sublayer's input (all but OLMo 2)
    norm_after_sublayer: bool  # RMSNorm on each sublayer's output before the residual add (OLMo 2, Gemma)
    norm_offset: float  # RMSNorm scales by (norm_offset + w) in float32 (Gemma: 1), else by w (0)
    activation: str  # the gated MLP's: "silu" (SwiGLU) or "gelu_tanh" (Gemma)
    embedding_multiplier: float  # token embeddings are scaled by it (Granite; Gemma: sqrt(hidden); else 1)
    embedding_multiplier_in_dtype: bool  # the multiplier is rounded to the weights' dtype first (Gemma)
    attention_scale: float  # on q.k: head_dim ** -0.5, Granite's attention_multiplier, Gemma's
    # query_pre_attn_scalar ** -0.5
    attn_softcap: float | None  # attention scores s -> tanh(s / cap) * cap after the scale (Gemma 2)
    final_softcap: float | None  # the same on the logits (Gemma 2, Gemma 3 where set)
    residual_multiplier: float  # each sublayer's output is scaled by it before the residual add
    logits_scaling: float  # logits are divided by it (Granite; else 1)
    hf_config: Any  # the transformers config, kept for RoPE initialisation

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def sliding_window(self) -> int | None:
        """The window every layer shares (None: full attention everywhere). ValueError where the
        layers differ: code that serves such a model reads `layer_windows`."""
        windows = set(self.layer_windows)
        if len(windows) > 1:
            raise ValueError("layers have different attention windows; read ModelConfig.layer_windows")
        return windows.pop()

    @property
    def windowed(self) -> bool:
        """Whether any layer has a sliding window."""
        return any(w is not None for w in self.layer_windows)

    @property
    def query_scale(self) -> float:
        """The factor on q that turns the attention contexts' 1/sqrt(head_dim) into
        `attention_scale` (1.0 for every family but Granite and Gemma)."""
        if self.attention_scale == self.head_dim**-0.5:
            return 1.0
        return self.attention_scale * self.head_dim**0.5

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        family.check_supported(hf_config)
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        layers = hf_config.num_hidden_layers
        before, after = family.norms(hf_config)
        tables, layer_table = family.rope_tables(hf_config, layers)
        gemma = family.is_gemma(hf_config)
        return cls(
            model_type=hf_config.model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", 4096)),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=family.attention_qkv_bias(hf_config),
            attention_out_bias=family.attention_out_bias(hf_config),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            layer_windows=family.layer_windows(hf_config, layers),
            rope_layers=family.rope_layers(hf_config, layers),
            rope_tables=tables,
            layer_rope_table=layer_table,
            rotary_dim=family.rotary_dim(hf_config, head_dim),
            rope_switch=family.rope_switch(hf_config),
            fused_projections=family.fused_projections(hf_config),
            qk_norm=family.qk_norm(hf_config),
            norm_before_sublayer=before,
            norm_after_sublayer=after,
            norm_offset=1.0 if gemma else 0.0,
            activation=family.activation(hf_config),
            embedding_multiplier=hf_config.hidden_size**0.5 if gemma else family.read_setting(
                hf_config, "embedding_multiplier", 1.0),
            embedding_multiplier_in_dtype=gemma,
            attention_scale=family.attention_scale(hf_config, head_dim),
            attn_softcap=family.softcap(hf_config, "attn_logit_softcapping"),
            final_softcap=family.softcap(hf_config, "final_logit_softcapping"),
            residual_multiplier=family.read_setting(hf_config, "residual_multiplier", 1.0),
            logits_scaling=family.read_setting(hf_config, "logits_scaling", 1.0),
            hf_config=hf_config,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        from transformers import AutoConfig

        try:
            hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelNotAvailable(f"cannot read a model config in {path}: {exc}") from exc
        return cls.from_hf(hf_config)
