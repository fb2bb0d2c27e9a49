"""Builds our `LlamaModel` straight from a llama-architecture GGUF: each projection, the embedding
table and the head stay the file's quantised blocks (`QuantWeight`), read a tensor at a time
through the memory map; no float copy of the model exists at any point.

The config is transformers' reading of the file's metadata (as the converting path has it), with
`gguf_config`'s overrides and the file's own special-token ids. Other architectures keep the
converting path (`edge_runtime.model.source`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from edge_runtime.errors import ModelNotAvailable
from edge_runtime.model import gguf_config
from edge_runtime.model.config import ModelConfig
from edge_runtime.model.gguf_blocks import GgufBlockReader
from edge_runtime.model.gguf_weight import FileMap, GgufWeight
from edge_runtime.model.llama import LlamaModel, rotary_tables
from edge_runtime.model.qweights import QuantWeight

# Architectures whose tensors this module maps (their GGUF names and llama.cpp's q/k row order).
ARCHITECTURES = ("llama",)
# Special-token ids: llama.cpp's `tokenizer.ggml.<key>` -> the HF config's `<name>`.
_SPECIAL_IDS = (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                ("padding_token_id", "pad_token_id"))


def reads(header: gguf_config.GgufHeader) -> bool:
    """Whether this module builds the model of a file with this header."""
    return header.architecture in ARCHITECTURES


def hf_config(path: str | Path, header: gguf_config.GgufHeader | None = None) -> Any:
    """The transformers config of a GGUF, as the converting path builds it (metadata only)."""
    from transformers import AutoConfig

    path = Path(path)
    header = header or gguf_config.read_header(path)
    overrides = gguf_config.config_overrides(header)
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelNotAvailable(f"transformers cannot read the config of {path}: {exc}") from exc
    if overrides:
        config = AutoConfig.for_model(**{**config.to_dict(), **overrides})
    for key, name in _SPECIAL_IDS:
        value = header.metadata.get(f"tokenizer.ggml.{key}")
        if value is not None:
            setattr(config, name, int(value))
    return config


def _layer_tensors(i: int) -> dict[str, str]:
    p = f"blk.{i}."
    return {k: p + v for k, v in (("input_norm", "attn_norm.weight"), ("post_norm", "ffn_norm.weight"),
                                  ("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output"),
                                  ("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down"))}


def load_llama_gguf(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
    config: Any = None,
    header: gguf_config.GgufHeader | None = None,
    in_place: bool = False,
) -> LlamaModel:
    """The model of a llama-architecture GGUF with its quantised tensors kept as blocks (float
    tensors, norms and any F16/F32 matrix, become parameters in `dtype`). `header`: the file's,
    when already read. `in_place`: every matrix (F16/F32 ones too) stays the file's own bytes in
    its memory map (`gguf_weight.GgufWeight`): nothing is re-encoded or read at load."""
    path = Path(path)
    header = header or gguf_config.read_header(path)
    if not reads(header):
        raise ModelNotAvailable(f"{path.name} is a {header.architecture!r} GGUF; blocks are read from "
                                f"{', '.join(ARCHITECTURES)} files only")
    cfg = ModelConfig.from_hf(config if config is not None else hf_config(path, header))
    if cfg.fused_projections or cfg.norm_after_sublayer or cfg.qk_norm is not None:
        raise ModelNotAvailable(f"{path.name}: a llama GGUF with settings of another family ({cfg.model_type})")
    reader = GgufBlockReader(path, header.tensors)
    file_map = FileMap(path) if in_place else None
    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions=None)
    used: set[str] = set()

    def take(name: str, heads: int | None = None) -> Tensor | QuantWeight:
        used.add(name)
        if file_map is not None and len(reader.shape(name)) == 2:
            return GgufWeight([file_map.rows(reader.tensors[name], heads)])
        if reader.is_float(name):
            return reader.float(name, heads)
        return QuantWeight([reader.blocks(name, heads)]).to(device)

    def fused(names: list[str], heads: list[int | None]) -> Tensor | QuantWeight:
        parts = [take(n, h) for n, h in zip(names, heads, strict=True)]
        if all(isinstance(p, QuantWeight) for p in parts):
            return type(parts[0]).cat(parts)
        # A float part cannot join blocks: the group is kept in float (exact either way).
        floats = [p.dequantize() if isinstance(p, QuantWeight) else p for p in parts]
        return torch.cat(floats)

    def shaped(value: Tensor | QuantWeight, shape: tuple[int, ...], what: str) -> Tensor | QuantWeight:
        if tuple(value.shape) != shape:
            raise ModelNotAvailable(f"{path.name}: {what} has shape {tuple(value.shape)}, expected {shape}")
        return value

    _put(model, "embed", shaped(take("token_embd.weight"), (cfg.vocab_size, cfg.hidden_size), "token_embd"),
         dtype, device)
    _put(model, "norm", take("output_norm.weight"), dtype, device)
    if model.lm_head is not None:
        if "output.weight" not in reader:
            raise ModelNotAvailable(f"{path.name} has no output.weight but its config unties the head")
        _put(model, "lm_head", shaped(take("output.weight"), (cfg.vocab_size, cfg.hidden_size), "output"), dtype, device)
    for i, layer in enumerate(model.layers):
        t = _layer_tensors(i)
        _put(layer, "input_norm", take(t["input_norm"]), dtype, device)
        _put(layer, "post_norm", take(t["post_norm"]), dtype, device)
        qkv = [t["q"] + ".weight", t["k"] + ".weight", t["v"] + ".weight"]
        heads = [cfg.num_heads, cfg.num_kv_heads, None]
        _put(layer, "qkv_weight", shaped(fused(qkv, heads), (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size),
                                         f"layer {i} q|k|v"), dtype, device)
        _put(layer, "o_weight", shaped(take(t["o"] + ".weight"), (cfg.hidden_size, cfg.q_size), f"layer {i} o"),
             dtype, device)
        gate_up = fused([t["gate"] + ".weight", t["up"] + ".weight"], [None, None])
        _put(layer, "gate_up_weight", shaped(gate_up, (2 * cfg.intermediate_size, cfg.hidden_size),
                                             f"layer {i} gate|up"), dtype, device)
        _put(layer, "down_weight", shaped(take(t["down"] + ".weight"), (cfg.hidden_size, cfg.intermediate_size),
                                          f"layer {i} down"), dtype, device)
        if cfg.attention_bias:
            bias = torch.cat([take(t["q"] + ".bias", cfg.num_heads), take(t["k"] + ".bias", cfg.num_kv_heads),
                              take(t["v"] + ".bias")])
            _put(layer, "qkv_bias", bias, dtype, device)
        if cfg.attention_out_bias:
            _put(layer, "o_bias", take(t["o"] + ".bias"), dtype, device)
        if cfg.mlp_bias:
            _put(layer, "gate_up_bias", torch.cat([take(t["gate"] + ".bias"), take(t["up"] + ".bias")]), dtype, device)
            _put(layer, "down_bias", take(t["down"] + ".bias"), dtype, device)
    unused = sorted(set(reader.tensors) - used)
    if unused:
        raise ModelNotAvailable(f"{path.name} does not map onto the {cfg.model_type} forward: "
                                f"tensors it would skip: {', '.join(unused[:4])}")
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise ModelNotAvailable(f"{path.name} lacks weights the model needs, e.g. {left[:3]}")
    model.ropes = rotary_tables(cfg, max_positions).to(device)
    model.eval()
    return model


def _put(module: nn.Module, name: str, value: Tensor | QuantWeight, dtype: torch.dtype,
         device: str | torch.device) -> None:
    """Set `module.name` (a meta parameter until now) to a float parameter or quantised blocks."""
    if isinstance(value, QuantWeight):
        delattr(module, name)  # torch refuses a module in a parameter's place
        setattr(module, name, value)
        return
    current = getattr(module, name)
    if current is not None and tuple(current.shape) != tuple(value.shape):
        raise ModelNotAvailable(f"weight {name} has shape {tuple(value.shape)}, expected {tuple(current.shape)}")
    setattr(module, name, nn.Parameter(value.to(device=device, dtype=dtype), requires_grad=False))


def dequantized_copy(model: LlamaModel) -> LlamaModel:
    """The same model with every quantised weight replaced by its float de-quantisation, in the
    model's dtype (tests and cost comparisons: a float copy of the whole model, which serving
    never makes)."""
    import copy

    out = copy.deepcopy(model)
    for module in list(out.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, QuantWeight):
                delattr(module, child_name)
                setattr(module, child_name, nn.Parameter(child.dequantize(out.dtype), requires_grad=False))
    return out
