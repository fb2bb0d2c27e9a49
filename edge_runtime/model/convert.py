"""Converting a GGUF into a float32 Hugging Face directory through transformers' GGUF loader,
checked to reload exactly: the path of every GGUF the block reader does not take
(`edge_runtime.model.gguf_load`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

from edge_runtime.errors import ModelNotAvailable
from edge_runtime.model import gguf_config

logger = logging.getLogger(__name__)

_SAMPLE_TEXT = "Hello! Summarise: the quick brown fox jumps over the lazy dog. 😀 你好"


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
    """De-quantise a GGUF into an fp32 HF directory in `out_dir`, and check it reloads exactly.

    transformers refuses `save_pretrained()` on a GGUF-loaded model, so the pieces are written by
    hand: weights via safetensors (without the tied lm_head), the config without its
    quantization_config, the tokenizer (with its chat template) as it came from the file.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        PreTrainedTokenizerFast,
    )

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    where = {"gguf_file": gguf_path.name, "local_files_only": True}
    # What transformers' GGUF reading leaves out of the config (Phi-3's rotary dims, LongRoPE,
    # window; Qwen3's head width), or a refusal naming what cannot be put back.
    header = gguf_config.read_header(gguf_path)
    overrides = gguf_config.config_overrides(header)
    with _transformers_progress(progress):
        logger.info(
            "converting %s (de-quantising; about 20 s for the default model)", gguf_path.name
        )
        try:
            # transformers wraps a Gemma file's byte-level ("gpt2") vocabulary in GemmaTokenizer,
            # which on reload builds its own sentencepiece pipeline around it (and adds a <mask>
            # the vocabulary lacks); the plain fast tokenizer keeps the file's.
            byte_level_gemma = (header.architecture in ("gemma2", "gemma3")
                                and header.metadata.get("tokenizer.ggml.model") == "gpt2")
            tokenizer_class = PreTrainedTokenizerFast if byte_level_gemma else AutoTokenizer
            tokenizer = tokenizer_class.from_pretrained(gguf_path.parent, **where)
            config = AutoConfig.from_pretrained(gguf_path.parent, **where)
            if overrides:
                config = AutoConfig.for_model(**{**config.to_dict(), **overrides})
            model, loading = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, config=config, dtype=torch.float32, output_loading_info=True, **where
            )
        except (ValueError, KeyError, OSError, RuntimeError) as exc:  # RuntimeError: a shape mismatch
            raise ModelNotAvailable(f"transformers cannot load {gguf_path}: {exc}") from exc
        model.eval()
        _check_every_tensor_loaded(header, model, loading, gguf_path)
        _use_gguf_special_tokens(gguf_path, tokenizer, model)

        state = model.state_dict()
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(
            {k: v.contiguous() for k, v in state.items()},
            out_dir / "model.safetensors",
            metadata={"format": "pt"},
        )
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        # Name-or-path keys point at the temporary folder the GGUF was read from.
        config = {k: v for k, v in config.items() if not k.startswith("_")}
        config["architectures"] = [type(model).__name__]
        (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        model.generation_config.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)

        _check_reload_is_exact(model, tokenizer, out_dir)


# GGUF's special-token ids (llama.cpp's `tokenizer.ggml.*` keys) and the tokenizer/config names.
_GGUF_SPECIAL_TOKENS = (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                        ("pad", "padding_token_id"))


def _use_gguf_special_tokens(gguf_path: Path, tokenizer, model) -> None:
    """Set BOS/EOS/UNK/PAD from the GGUF's own metadata. How transformers maps them moved between
    releases: 5.17 read the default model's EOS as `<|im_start|>` (id 1), 5.23 as `<|im_end|>`
    (id 2, what the file says); a converted cache must not depend on which one converted it."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf_path).fields
    for name, key in _GGUF_SPECIAL_TOKENS:
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is None:
            continue
        token_id = int(field.parts[field.data[0]][0])
        if not 0 <= token_id < len(tokenizer):
            raise ModelNotAvailable(f"{gguf_path.name}: tokenizer.ggml.{key} = {token_id} is outside the vocabulary")
        setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(token_id))
        if name != "unk":
            setattr(model.config, f"{name}_token_id", token_id)
            setattr(model.generation_config, f"{name}_token_id", token_id)


def _check_every_tensor_loaded(header, model, loading: dict, gguf_path: Path) -> None:
    """Every tensor of the file went into a parameter and every parameter came from the file:
    transformers skips tensors it has no parameter for, and leaves parameters the file lacks at
    their random initialisation, with no more than a log line."""
    unused = gguf_config.unused_tensors(header, model)
    missing = [k for k in loading.get("missing_keys", ())
               if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if unused or missing:
        raise ModelNotAvailable(
            f"{gguf_path.name} does not map onto transformers' {model.config.model_type} model: "
            + (f"tensors it would skip: {', '.join(unused[:4])}" if unused else "")
            + ("; " if unused and missing else "")
            + (f"weights the file lacks: {', '.join(sorted(missing)[:4])}" if missing else "")
        )


def _check_reload_is_exact(model, tokenizer, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded_tokenizer = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    ids = tokenizer.encode(_SAMPLE_TEXT)
    if reloaded_tokenizer.encode(_SAMPLE_TEXT) != ids:
        raise ModelNotAvailable(
            f"the tokenizer saved in {out_dir} tokenizes differently from the GGUF's"
        )
    reloaded = AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, local_files_only=True
    )
    reloaded.eval()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits
        got = reloaded(torch.tensor([ids])).logits
    if not torch.equal(expected, got):
        diff = (expected - got).abs().max().item()
        raise ModelNotAvailable(
            f"converted model differs from the GGUF it came from (max |logit diff| {diff:g})"
        )


@contextlib.contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    """Silence transformers' own bars when the caller asked for no progress output."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()
