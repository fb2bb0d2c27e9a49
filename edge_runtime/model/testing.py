"""A tiny random llama-family model directory (config, safetensors, byte-level BPE tokenizer) for tests.

Built in-process in well under a second, with no download; owns nothing used at run time.
"""

from __future__ import annotations

from pathlib import Path

# The same special tokens as SmolLM2, in the same id order (0, 1, 2), so code that special-cases
# them is exercised the same way on the tiny model and on the default one.
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# ChatML, the shape SmolLM2 uses (without its default system prompt, to keep test prompts short).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A few merges learned from this text make common English words multi-byte tokens, so tests see
# tokens that span several bytes (and UTF-8 that still splits into single bytes).
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. The user asks and the assistant answers. "
    "Hello, how are you today? I am fine, thank you. What is the capital of France? "
    "Paris is the capital of France. Please write a short poem about the sea and the sky. "
    "Fine-tuning the model on the device keeps the data of the user on the device. "
)
_NUM_MERGES = 48


def _build_tokenizer(vocab_extra: int, chat_template: str = CHAT_TEMPLATE, added_tokens: tuple[str, ...] = ()):
    """Byte-level BPE: 3 special tokens, the 256 byte tokens, a few learned merges, extras, then
    `added_tokens` as plain (not special) added tokens, as Qwen3 adds `<think>` and `</think>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=len(SPECIAL_TOKENS) + len(alphabet) + _NUM_MERGES,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte is in the vocabulary, whatever the corpus holds: any UTF-8 round-trips.
        initial_alphabet=alphabet,
        min_frequency=1,
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS], trainer=trainer)
    # Reserved specials beyond the learned vocabulary let a test pick an odd vocabulary size.
    tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab_extra)])
    if added_tokens:
        tokenizer.add_tokens(list(added_tokens))

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=IM_START,
        eos_token=IM_END,
        pad_token=IM_END,
        unk_token=ENDOFTEXT,
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
    )


def make_tiny_model_dir(
    path: Path,
    *,
    vocab_extra: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = True,
    attention_bias: bool = False,
    rope_scaling: dict | None = None,
    seed: int = 0,
    model_type: str = "llama",
    config: dict | None = None,
    random_norms: bool = False,
    chat_template: str = CHAT_TEMPLATE,
    added_tokens: tuple[str, ...] = (),
) -> Path:
    """Write a random model of `model_type` (transformers' own config and model classes) with a
    real ChatML tokenizer into `path`; return `path`.

    `vocab_extra` appends that many reserved special tokens (vocab = 307 + vocab_extra);
    `rope_scaling` is merged into the config's `rope_parameters` (e.g. {"rope_type": "linear",
    "factor": 2.0}); `config` adds or overrides config settings (e.g. {"sliding_window": 8});
    `random_norms` draws every RMSNorm weight around 1 (transformers initialises them to exactly
    1, which would hide a norm applied in the wrong place).
    `chat_template` replaces the ChatML template (a family's real one, from a test fixture);
    `added_tokens` become added, non-special tokens after the others (a thinking model's tags).
    The same arguments always give the same weights.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(vocab_extra, chat_template, added_tokens)
    ids = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, **(rope_scaling or {})}
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=rope_parameters,
        bos_token_id=ids[1],
        eos_token_id=ids[2],
        pad_token_id=ids[2],
    )
    if attention_bias:  # a Llama setting; other families have no such key
        settings["attention_bias"] = True
    hf_config = AutoConfig.for_model(model_type, **{**settings, **(config or {})})
    # Fork the RNG so that building a test model does not shift the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        # HF initialises biases to zero (Qwen2's q/k/v ones included); random ones make a bias
        # bug visible in a test.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("_proj.bias"):
                    param.normal_(0.0, 0.02)
                elif random_norms and name.endswith("norm.weight"):
                    param.normal_(1.0, 0.2)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _permute_for_gguf(weight, n_head: int):
    """Interleave the rotary halves of each head the way llama.cpp stores Q and K.

    HF rotates (first half, second half) of a head; llama.cpp rotates adjacent pairs, so its
    converter reorders the rows and transformers' GGUF loader undoes it. A hand-written file
    must do the same or the reloaded model would differ.
    """
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


# GGUF architecture by model type, as llama.cpp's converter writes each (Mistral as llama).
_GGUF_ARCH = {"mistral": "llama", "gemma3_text": "gemma3"}


def make_tiny_gguf(
    model_dir: Path, gguf_path: Path, *, quantize: bool = True, extra_tensors: dict | None = None,
    extra_metadata: dict[str, str | int | float] | None = None, block_types: dict[str, str] | None = None,
) -> Path:
    """Write the model in `model_dir` (from `make_tiny_model_dir`) as a GGUF file of its family,
    with the metadata llama.cpp's converter writes for it: llama (and Mistral, written as llama
    with "mistral" in its name) with Q/K rows interleaved; qwen2, qwen3 (attention.key_length);
    phi3 (fused tensors, rotary dims, LongRoPE's original context, attention factor and factor
    tensors, sliding window, 0 for none); gemma2 and gemma3 with the keys of their converter
    classes (`_gemma_metadata`) and every RMSNorm weight stored as 1 + w. Other families get the
    same generic keys, enough for a loader to read the architecture and refuse it.

    2-D weights are stored Q8_0 when `quantize` (so loading it de-quantises, as with the real
    default model), the rest F32. The tokenizer goes in as GGUF "gpt2" (byte-level BPE) metadata,
    Gemma's too (what the converter writes for a Gemma 3 folder without a tokenizer.model, as the
    tiny one is; real Gemma files carry a sentencepiece vocabulary).
    `extra_tensors` (GGUF name -> array) and `extra_metadata` (key -> string, uint32 or float32): more to
    write, for tests of what a loader refuses. `block_types`: GGUF tensor name, or its part after
    `blk.N.`, -> llama.cpp type for that matrix instead of Q8_0; K-quants (gguf-py cannot quantise
    them) get random well-formed blocks of a small scale (`random_k_blocks`), not the model's weights.
    """
    import json
    import math

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    model_dir, gguf_path = Path(model_dir), Path(gguf_path)
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    n_layers = config["num_hidden_layers"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head

    vocab = dict(tokenizer_json["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tokenizer_json["added_tokens"]}
    vocab.update(special)
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "token ids must be dense"
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    token_types = [
        gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens
    ]
    chat_template = (model_dir / "chat_template.jinja").read_text()

    model_type = config["model_type"]
    arch = _GGUF_ARCH.get(model_type, model_type)
    rope = config["rope_parameters"]
    writer = gguf.GGUFWriter(gguf_path, arch)
    writer.add_name(f"tiny-{model_type}")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if arch in ("gemma2", "gemma3"):
        _gemma_metadata(writer, config, head_dim)
    else:
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        writer.add_rope_freq_base(rope["rope_theta"])
    if model_type == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    extra: dict[str, np.ndarray] = {}
    if model_type == "phi3":
        original = config["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_sliding_window(config.get("sliding_window") or 0)
        if rope.get("rope_type") == "longrope":
            scale = config["max_position_embeddings"] / original
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
            extra = {"rope_factors_long.weight": np.array(rope["long_factor"], np.float32),
                     "rope_factors_short.weight": np.array(rope["short_factor"], np.float32)}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_unk_token_id(special[ENDOFTEXT])
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template)

    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_id, n_layers)
    for key, value in (extra_metadata or {}).items():
        add = writer.add_string if isinstance(value, str) else writer.add_uint32 if isinstance(value, int) else writer.add_float32
        add(key, value)
    for name, array in {**extra, **(extra_tensors or {})}.items():
        writer.add_tensor(name, np.asarray(array, np.float32))
    for hf_name, array in load_file(model_dir / "model.safetensors").items():
        array = array.astype(np.float32)
        if arch == "llama" and hf_name.endswith("self_attn.q_proj.weight"):
            array = _permute_for_gguf(array, n_head)
        elif arch == "llama" and hf_name.endswith("self_attn.k_proj.weight"):
            array = _permute_for_gguf(array, n_kv)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for tensor {hf_name}")
        if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            array = array + 1  # Gemma's RMSNorm scales by (1 + w); llama.cpp's by the stored weight
        kind = (block_types or {}).get(name, (block_types or {}).get(name.split(".", 2)[-1], "Q8_0"))
        if kind.endswith("_K") and array.ndim == 2:
            rows, k = array.shape
            writer.add_tensor(name, random_k_blocks(kind, rows, k, np.random.default_rng(len(name) + rows)),
                              raw_dtype=gguf.GGMLQuantizationType[kind])
        elif quantize and array.ndim == 2 and array.shape[1] % 32 == 0:
            data = gguf.quants.quantize(array, gguf.GGMLQuantizationType[kind])
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_path


def random_k_blocks(kind: str, rows: int, k: int, rng):
    """Raw blocks [rows, bytes] of K-quant type `kind` (Q4_K, Q5_K, Q6_K): random levels, 6-bit
    scales and minimums, float16 super-block scales drawn so weights stay near 0.02."""
    import numpy as np

    from edge_runtime.model.gguf_blocks import BLOCK_TYPES

    elems, size, _ = BLOCK_TYPES[kind]
    raw = rng.integers(0, 256, (rows, k // elems, size), dtype=np.uint8)

    def f16(offset: int, scale: float) -> None:
        values = (rng.uniform(0.5, 1.0, raw.shape[:2]) * scale).astype(np.float16)
        raw[..., offset:offset + 2] = values[..., None].view(np.uint8)

    if kind == "Q6_K":
        raw[..., 192:208] = rng.integers(-40, 40, raw.shape[:2] + (16,)).astype(np.int8).view(np.uint8)
        f16(208, 2e-5)
    else:  # d, then dmin: a sub-block spans about d*sc*15 from -dmin*m
        f16(0, 4e-5 if kind == "Q4_K" else 2e-5)
        f16(2, 2e-5 if kind == "Q4_K" else 1e-5)
    return raw.reshape(rows, -1)


def _gemma_metadata(writer, config: dict, head_dim: int) -> None:
    """The keys llama.cpp's converter writes for Gemma 2 (`Gemma2Model`: both soft-caps and the
    window, no RoPE base) and Gemma 3 (`Gemma3Model`: the full layers' RoPE base and linear
    scaling, the sliding layers' base, a final soft-cap where set, the window). What the file
    cannot say (query_pre_attn_scalar, the layer pattern) llama.cpp derives; a model it would
    derive differently is refused here rather than written as another model."""
    model_type, n_layers = config["model_type"], config["num_hidden_layers"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    # llama.cpp: 1 / sqrt(hidden / heads) for the 27B sizes (46 and 62 layers), 1 / sqrt(head_dim) otherwise
    size_27b = n_layers == (46 if model_type == "gemma2" else 62)
    scalar = config["hidden_size"] // config["num_attention_heads"] if size_27b else head_dim
    if config["query_pre_attn_scalar"] != scalar:
        raise ValueError(f"query_pre_attn_scalar={config['query_pre_attn_scalar']}: a GGUF of this model means {scalar}")
    every = 2 if model_type == "gemma2" else 6  # every 2nd / 6th layer full, the rest sliding
    pattern = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
    if config["layer_types"] != pattern:
        raise ValueError(f"layer_types {config['layer_types']}: a GGUF of {model_type} means {pattern}")
    if model_type == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_sliding_window(config["sliding_window"])
        return
    rope = config["rope_parameters"]
    full, sliding = rope["full_attention"], rope["sliding_attention"]
    if sliding.get("rope_type", "default") != "default" or full.get("rope_type", "default") not in ("default", "linear"):
        raise ValueError(f"rope_parameters {rope}: llama.cpp's converter writes linear scaling of the full layers only")
    writer.add_rope_freq_base(full["rope_theta"])
    writer.add_rope_freq_base_swa(sliding["rope_theta"])
    if full.get("rope_type") == "linear":
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if config["sliding_window"] is not None:
        writer.add_sliding_window(config["sliding_window"])
