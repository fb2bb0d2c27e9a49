"""The shape of a llama-family model (Llama, Mistral, Qwen2, SmolLM) as our forward needs it.

Read from a Hugging Face `config.json` through `transformers.AutoConfig`, which normalises the
many spellings of RoPE settings (`rope_theta`/`rope_scaling` vs `rope_parameters`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_runtime.errors import ModelNotAvailable

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "smollm3")


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
    attention_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    hf_config: Any  # the transformers config, kept for RoPE initialisation

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        model_type = getattr(hf_config, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelNotAvailable(
                f"model type {model_type!r} is not a llama-family model this engine runs "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        act = getattr(hf_config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ModelNotAvailable(f"activation {act!r} is not supported (SwiGLU with silu only)")
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        # Qwen2 always has q/k/v biases and no `attention_bias` attribute.
        attention_bias = bool(getattr(hf_config, "attention_bias", model_type == "qwen2"))
        sliding = getattr(hf_config, "sliding_window", None)
        if model_type == "qwen2" and not getattr(hf_config, "use_sliding_window", False):
            sliding = None
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", 4096)),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            sliding_window=sliding,
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
