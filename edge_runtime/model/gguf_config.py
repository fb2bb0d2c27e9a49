"""What a GGUF file says about its model that transformers' GGUF loader does not read, for this
engine's families: given back to the config where it can be, refused by name where it cannot.

transformers rebuilds a config from llama.cpp's metadata keys through a per-architecture table
(`integrations/ggml.py`) and maps tensors by name, skipping any it has no parameter for. For Phi-3
that table lacks the rotary dimensions (Phi-4-mini turns 96 of 128), LongRoPE (its factors are
tensors, `rope_factors_long`/`_short`) and the sliding window; for Qwen3 the head width
(`attention.key_length`); for Gemma 2 and 3 the soft-caps, query_pre_attn_scalar, the layer
pattern and Gemma 3's per-layer RoPE, several of which llama.cpp derives rather than reads.
Loading those as transformers does would give a different model at every position, silently.
Owns the reading of metadata only; `source.convert_gguf` converts.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_runtime.errors import ModelNotAvailable

# GGUF architectures (general.architecture) this engine takes, with the model type each becomes
# in transformers. llama.cpp writes Mistral as "llama"; transformers renames it by general.name.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma2": "gemma2",
                 "gemma3": "gemma3_text"}
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


# The last header read, keyed by the file's path, size and modification time: a first start of a
# large GGUF asks for it several times (whether to read it in place, then the loader itself),
# and an 8B file's 128k-token vocabulary takes ~8 s to parse each time (issue #28).
_LAST_HEADER: tuple[tuple[str, int, int], GgufHeader] | None = None


def read_header(path: str | Path) -> GgufHeader:
    global _LAST_HEADER
    from gguf import GGUFReader

    try:
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
        if _LAST_HEADER is not None and _LAST_HEADER[0] == key:
            return _LAST_HEADER[1]
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise ModelNotAvailable(f"{path} is not a readable GGUF file: {exc}") from exc
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors}
    header = GgufHeader(str(metadata.get("general.architecture", "")), metadata, tensors)
    _LAST_HEADER = (key, header)
    return header


def config_overrides(header: GgufHeader) -> dict[str, Any]:
    """Config settings to set over transformers' own reading of this file's metadata; raises
    ModelNotAvailable for an architecture this engine does not take from a GGUF, or metadata it
    cannot put back into the config."""
    arch = header.architecture
    if arch not in ARCHITECTURES:
        raise ModelNotAvailable(
            f"GGUF architecture {arch!r} is not one this engine loads from a GGUF (it takes "
            f"{', '.join(sorted(ARCHITECTURES))}; Mistral comes as llama): transformers' GGUF loader does not read "
            "it, or reads it without settings the forward needs. Load the model's Hugging Face folder instead"
        )
    _refuse_rope_scaling(header)
    if arch == "phi3":
        return _phi3(header)
    if arch in ("gemma2", "gemma3"):
        return _gemma(header)
    if arch == "qwen3":
        key_length, value_length = header.get("attention.key_length"), header.get("attention.value_length")
        if key_length is not None and value_length not in (None, key_length):
            raise ModelNotAvailable(f"GGUF qwen3 keys of {key_length} and values of {value_length} dims per head: "
                                    "the forward needs one head width")
        return {} if key_length is None else {"head_dim": int(key_length)}
    return {}


def _refuse_rope_scaling(header: GgufHeader) -> None:
    """RoPE scaling transformers' table does not read for these architectures (Phi-3's LongRoPE
    and Gemma's linear scaling, read below, aside): Llama 3.1+'s per-dimension `rope_freqs`, and
    linear/YaRN scaling keys."""
    if "rope_freqs.weight" in header.tensors:
        raise ModelNotAvailable(
            "this GGUF carries per-dimension RoPE frequency factors (rope_freqs: Llama 3.1+ 'llama3' scaling), "
            "which transformers' GGUF loader drops; load the model's Hugging Face folder instead")
    kind = header.get("rope.scaling.type")
    if kind not in (None, "none") and header.architecture not in ("phi3", "gemma2", "gemma3"):
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


# What llama.cpp assumes where a Gemma file is silent (src/llama-model.cpp, load_hparams for
# LLM_ARCH_GEMMA2 / GEMMA3; llama-hparams.h, .cpp): the attention scale is 1 / sqrt(hidden / heads)
# for the 27B sizes, known by their layer count, and 1 / sqrt(head_dim) for the rest; Gemma 2's
# soft-caps default to 50 and 30 and its window to 4096; every 2nd (Gemma 2) or 6th (Gemma 3)
# layer is full and the rest slide (set_swa_pattern(n): layer i slides where i % n < n - 1, all
# with n = 0, none with n = 1); Gemma 3's sliding layers turn with base 10000, never scaled.
# Newer llama.cpp also reads attention.sliding_window_pattern (that n) and rope.freq_base_swa,
# which no converter wrote for Gemma before the latter, and takes a Gemma 3 without a window as
# sliding nowhere (older releases refuse it): honoured the same way here.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
GEMMA2_DEFAULTS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "attention.sliding_window": 4096}
GEMMA_FULL_EVERY = {"gemma2": 2, "gemma3": 6}
ROPE_BASE = 10000.0  # llama.cpp's rope.freq_base where a file has none


def _gemma(header: GgufHeader) -> dict[str, Any]:
    """Gemma 2 / 3 as llama.cpp reads them. Its converter writes Gemma 2's soft-caps and window
    and Gemma 3's window, final soft-cap (where set), RoPE base and linear scaling of the full
    layers and (newer converters) the sliding layers' base; query_pre_attn_scalar and the layer
    pattern it never writes: llama.cpp derives them, and so does this. RMSNorm weights are stored
    as 1 + w; transformers' loader takes the 1 back off (its Gemma2TensorProcessor)."""
    arch = header.architecture
    layers, hidden, heads = (int(header.get(k)) for k in ("block_count", "embedding_length", "attention.head_count"))
    head_dim = int(header.get("attention.key_length", hidden // heads))  # llama.cpp: hidden / heads if absent
    for key in ("attention.value_length", "attention.key_length_swa", "attention.value_length_swa",
                "rope.dimension_count", "rope.dimension_count_swa"):
        if header.get(key, head_dim) != head_dim:
            raise ModelNotAvailable(f"GGUF {arch}.{key} = {header.get(key)} where heads are {head_dim} wide: "
                                    "the forward turns and attends over one head width")
    # Keys llama.cpp's Gemma loaders do not read (Gemma 3 has no attention soft-cap, in llama.cpp
    # or transformers): what a file that holds one means is not established, so it is not guessed.
    unread = ["attention.scale", "rope.scaling.original_context_length", "rope.scaling.attn_factor"]
    for key in unread + (["attn_logit_softcapping"] if arch == "gemma3" else []):
        if header.get(key) is not None:
            raise ModelNotAvailable(f"GGUF {arch}.{key} = {header.get(key)!r} is not a setting this engine can take "
                                    f"from a {arch} GGUF (llama.cpp does not read it); load the Hugging Face folder")
    every = header.get("attention.sliding_window_pattern", GEMMA_FULL_EVERY[arch])
    if not isinstance(every, int):
        raise ModelNotAvailable(f"GGUF {arch}.attention.sliding_window_pattern = {every!r}: only a period "
                                "(every n-th layer full) is read")
    scalar = hidden // heads if layers == GEMMA_27B_LAYERS[arch] else head_dim
    out = {"head_dim": head_dim, "query_pre_attn_scalar": scalar, **(_gemma2 if arch == "gemma2" else _gemma3)(header)}
    window = out["sliding_window"]
    sliding = [window is not None and (every == 0 or i % every < every - 1) for i in range(layers)]
    out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    return out


def _gemma2(header: GgufHeader) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, default in GEMMA2_DEFAULTS.items():
        value = header.get(key, default)
        if not value > 0:  # llama.cpp divides by the caps and windows every other layer
            raise ModelNotAvailable(f"GGUF gemma2.{key} = {value}: Gemma 2 needs a positive one")
        out[key.removeprefix("attention.")] = int(value) if key == "attention.sliding_window" else float(value)
    base = float(header.get("rope.freq_base", ROPE_BASE))
    if header.get("rope.freq_base_swa", base) != base:
        raise ModelNotAvailable(f"GGUF gemma2.rope.freq_base_swa = {header.get('rope.freq_base_swa')} where the "
                                f"full layers turn with {base}: transformers' Gemma 2 has one RoPE base for all layers")
    factor = _linear_rope_factor(header)
    if factor is not None:
        raise ModelNotAvailable(f"GGUF gemma2 with RoPE scaling (rope.scaling.factor = {factor}): llama.cpp's "
                                "converter never writes one for Gemma 2; load the Hugging Face folder")
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": base}
    return out


def _gemma3(header: GgufHeader) -> dict[str, Any]:
    final = header.get("final_logit_softcapping")
    full = {"rope_type": "default", "rope_theta": float(header.get("rope.freq_base", ROPE_BASE))}
    factor = _linear_rope_factor(header)
    if factor is not None:
        full.update(rope_type="linear", factor=factor)
    sliding = {"rope_type": "default", "rope_theta": float(header.get("rope.freq_base_swa", ROPE_BASE))}
    return {
        "final_logit_softcapping": float(final) if final else None,  # absent or 0: none
        "sliding_window": int(header.get("attention.sliding_window") or 0) or None,
        "rope_parameters": {"full_attention": full, "sliding_attention": sliding},
    }


def _linear_rope_factor(header: GgufHeader) -> float | None:
    """The linear RoPE scaling factor a file asks for, None for none. llama.cpp takes a factor
    (`rope.scaling.factor`, formerly `rope.scale_linear`) as linear where no type is written."""
    factor = header.get("rope.scaling.factor", header.get("rope.scale_linear"))
    kind = header.get("rope.scaling.type")
    if factor in (None, 0, 1.0):
        if kind not in (None, "none", "linear"):
            raise ModelNotAvailable(f"GGUF {header.architecture}.rope.scaling.type = {kind!r} is not read for "
                                    f"{header.architecture}; load the Hugging Face folder instead")
        return None
    if kind not in (None, "linear"):
        raise ModelNotAvailable(f"GGUF {header.architecture}.rope.scaling.type = {kind!r} with factor {factor}: "
                                "only linear scaling is read for Gemma")
    return float(factor)


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
