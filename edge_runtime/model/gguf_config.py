"""What a GGUF file says about its model that transformers' GGUF loader does not read, for this
engine's families: given back to the config where it can be, refused by name where it cannot.

transformers rebuilds a config from llama.cpp's metadata keys through a per-architecture table
(`integrations/ggml.py`) and maps tensors by name, skipping any it has no parameter for. For Phi-3
that table lacks the rotary dimensions (Phi-4-mini turns 96 of 128), LongRoPE (its factors are
tensors, `rope_factors_long`/`_short`) and the sliding window; for Qwen3 the head width
(`attention.key_length`). Loading those as transformers does would give a different model at
every position, silently. Owns the reading of metadata only; `source.convert_gguf` converts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_runtime.errors import ModelNotAvailable

# GGUF architectures (general.architecture) this engine takes, with the model type each becomes
# in transformers. llama.cpp writes Mistral as "llama"; transformers renames it by general.name.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3"}
# Architectures transformers' GGUF loader reads but not whole: its table for them leaves out
# query_pre_attn_scalar, the soft-caps, the sliding/full layer pattern and (Gemma 3) the sliding
# layers' RoPE base and the RoPE scaling, falling back to its config defaults, which are not
# every checkpoint's (llama.cpp itself derives several from the model size: Gemma 2 27B scales
# attention by 144 ** -0.5, not the default 256 ** -0.5). Refused rather than guessed.
PARTIAL_ARCHITECTURES = {"gemma2": "Gemma 2", "gemma3": "Gemma 3"}
# Tensors that carry settings rather than weights, read into the config below.
ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


@dataclass
class GgufHeader:
    architecture: str
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf ReaderTensor (data memory-mapped)

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata `<architecture>.<key>`."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


def read_header(path: str | Path) -> GgufHeader:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise ModelNotAvailable(f"{path} is not a readable GGUF file: {exc}") from exc
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors}
    return GgufHeader(str(metadata.get("general.architecture", "")), metadata, tensors)


def config_overrides(header: GgufHeader) -> dict[str, Any]:
    """Config settings to set over transformers' own reading of this file's metadata; raises
    ModelNotAvailable for an architecture this engine does not take from a GGUF, or metadata it
    cannot put back into the config."""
    arch = header.architecture
    if arch in PARTIAL_ARCHITECTURES:
        raise ModelNotAvailable(
            f"GGUF architecture {arch!r} is not one this engine loads from a GGUF: transformers' GGUF loader "
            f"reads {PARTIAL_ARCHITECTURES[arch]} without query_pre_attn_scalar, the soft-caps, the sliding/full "
            "layer pattern or the per-layer RoPE settings, and would fill them with defaults that are not every "
            "checkpoint's. Load the model's Hugging Face folder instead"
        )
    if arch not in ARCHITECTURES:
        raise ModelNotAvailable(
            f"GGUF architecture {arch!r} is not one this engine loads from a GGUF (it takes "
            f"{', '.join(sorted(ARCHITECTURES))}; Mistral comes as llama): transformers' GGUF loader does not read "
            "it, or reads it without settings the forward needs. Load the model's Hugging Face folder instead"
        )
    _refuse_rope_scaling(header)
    if arch == "phi3":
        return _phi3(header)
    if arch == "qwen3":
        key_length, value_length = header.get("attention.key_length"), header.get("attention.value_length")
        if key_length is not None and value_length not in (None, key_length):
            raise ModelNotAvailable(f"GGUF qwen3 keys of {key_length} and values of {value_length} dims per head: "
                                    "the forward needs one head width")
        return {} if key_length is None else {"head_dim": int(key_length)}
    return {}


def _refuse_rope_scaling(header: GgufHeader) -> None:
    """RoPE scaling transformers' table does not read for these architectures (Phi-3's LongRoPE
    aside): Llama 3.1+'s per-dimension `rope_freqs`, and linear/YaRN scaling keys."""
    if "rope_freqs.weight" in header.tensors:
        raise ModelNotAvailable(
            "this GGUF carries per-dimension RoPE frequency factors (rope_freqs: Llama 3.1+ 'llama3' scaling), "
            "which transformers' GGUF loader drops; load the model's Hugging Face folder instead")
    kind = header.get("rope.scaling.type")
    if kind not in (None, "none") and header.architecture != "phi3":
        raise ModelNotAvailable(
            f"this GGUF's RoPE scaling ({kind!r}) is not read by transformers' GGUF loader for "
            f"{header.architecture}; load the model's Hugging Face folder instead")


def _phi3(header: GgufHeader) -> dict[str, Any]:
    """Phi-3 as llama.cpp's converter writes it: rope.dimension_count = the turned dims per head,
    rope.scaling.original_context_length, attn_factor and the two factor tensors for LongRoPE,
    attention.sliding_window (0 = none, Phi-4)."""
    heads = int(header.get("attention.head_count"))
    head_dim = int(header.get("embedding_length")) // heads
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(header.get("rope.freq_base", 10000.0))}
    dims = int(header.get("rope.dimension_count", head_dim))
    if dims != head_dim:
        factor = dims / head_dim
        if int(head_dim * factor) != dims:
            raise ModelNotAvailable(f"GGUF phi3 turns {dims} of {head_dim} dims per head, which no "
                                    "partial_rotary_factor reproduces")
        rope["partial_rotary_factor"] = factor
    out: dict[str, Any] = {}
    present = [name for name in ROPE_FACTOR_TENSORS if name in header.tensors]
    if present:
        if len(present) != 2:
            raise ModelNotAvailable(f"GGUF phi3 has {present[0]} without its pair; LongRoPE needs both factor sets")
        original = header.get("rope.scaling.original_context_length")
        if original is None:
            raise ModelNotAvailable("GGUF phi3 has LongRoPE factors but no rope.scaling.original_context_length")
        long_f, short_f = (header.tensors[name].data.reshape(-1).astype(float).tolist() for name in ROPE_FACTOR_TENSORS)
        if not len(long_f) == len(short_f) == dims // 2:
            raise ModelNotAvailable(f"GGUF phi3 LongRoPE factors have {len(long_f)} and {len(short_f)} entries for "
                                    f"{dims} turned dims (need {dims // 2})")
        rope.update(rope_type="longrope", long_factor=long_f, short_factor=short_f)
        out["original_max_position_embeddings"] = int(original)
        attn = header.get("rope.scaling.attn_factor")
        if attn is not None:
            # llama.cpp writes what transformers would derive (sqrt(1 + ln s / ln original),
            # s = context / original); the file's own value is kept where it says otherwise.
            scale = int(header.get("context_length")) / int(original)
            derived = math.sqrt(1 + math.log(scale) / math.log(int(original))) if scale > 1 else 1.0
            if not math.isclose(float(attn), derived, rel_tol=1e-6):
                rope["attention_factor"] = float(attn)
    out["rope_parameters"] = rope
    window = header.get("attention.sliding_window")
    out["sliding_window"] = int(window) if window else None
    return out


def unused_tensors(header: GgufHeader, model: Any) -> list[str]:
    """The file's tensors that transformers' loader had no parameter of `model` for (it skips
    them without a word), except the ones read into the config above."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(key for key, name in MODEL_ARCH_NAMES.items() if name == header.architecture)
    names = get_tensor_name_map(arch, model.config.num_hidden_layers)
    mapped = set()
    for hf_name in model.state_dict():
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = names.get_name(base)
        if gguf_name is not None:
            mapped.add(f"{gguf_name}.{suffix}")
    return sorted(name for name in header.tensors if name not in mapped and name not in ROPE_FACTOR_TENSORS)
