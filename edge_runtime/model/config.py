"""The shape of a llama-family model (Llama, Mistral, Qwen2, SmolLM) as our forward needs it.

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
    sliding_window: int | None  # keys a query attends to, itself included; the same in every layer
    rope_layers: tuple[bool, ...]  # whether layer i rotates q and k (SmolLM3's NoPE layers do not)
    hf_config: Any  # the transformers config, kept for RoPE initialisation

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        family.check_supported(hf_config)
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        layers = hf_config.num_hidden_layers
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
            sliding_window=family.sliding_window(hf_config, layers),
            rope_layers=family.rope_layers(hf_config, layers),
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
