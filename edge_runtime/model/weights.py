"""Loads Hugging Face safetensors checkpoints into our fused llama layout.

Knows the Hugging Face parameter names and nothing about serving; conversions from GGUF happen
earlier (`edge_runtime.model.source`), so this reads only safetensors (a block cache's through
`block_cache`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from edge_runtime.errors import ModelNotAvailable
from edge_runtime.model import family
from edge_runtime.model.config import ModelConfig
from edge_runtime.model.llama import DecoderLayer, LlamaModel, rotary_tables

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotAvailable(f"no *.safetensors weights in {path}")
    return files


def load_llama(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
) -> LlamaModel:
    """Build our model from a Hugging Face directory and fill every parameter, or fail clearly.
    A block cache (a GGUF kept quantised: `block_cache`) loads as its blocks, a cache that reads
    its GGUF in place as views of that file's map."""
    path = Path(path)
    from edge_runtime.model import block_cache

    if block_cache.is_block_cache(path):
        return block_cache.load_block_cache(path, dtype, device, max_positions)
    in_place = block_cache.load_in_place(path, dtype, device, max_positions)
    if in_place is not None:
        return in_place
    cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions=None)
    model = model.to_empty(device=device).to(dtype)
    model.ropes = rotary_tables(cfg, max_positions).to(device)
    filled: set[str] = set()
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    slices = {
        "self_attn.q_proj": ("qkv", 0, q),
        "self_attn.k_proj": ("qkv", q, q + kv),
        "self_attn.v_proj": ("qkv", q + kv, q + 2 * kv),
        "self_attn.o_proj": ("o", None, None),
        "mlp.gate_proj": ("gate_up", 0, inter),
        "mlp.up_proj": ("gate_up", inter, 2 * inter),
        "mlp.down_proj": ("down", None, None),
    }
    if cfg.fused_projections:  # Phi-3 stores q/k/v and gate/up fused, in our row order
        slices = {name: slices[name] for name in ("self_attn.o_proj", "mlp.down_proj")}
        slices |= {"self_attn.qkv_proj": ("qkv", None, None), "mlp.gate_up_proj": ("gate_up", None, None)}

    def put(target: torch.Tensor, value: torch.Tensor, name: str, lo: int | None = None, hi: int | None = None) -> None:
        dst = target if lo is None else target[lo:hi]
        if tuple(dst.shape) != tuple(value.shape):
            raise ModelNotAvailable(f"weight {name} has shape {tuple(value.shape)}, expected {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(value.to(dtype))

    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if family.is_unused_tensor(name):
                    continue  # a known leftover (e.g. rotary inv_freq buffers in old checkpoints)
                if name == "lm_head.weight" and model.lm_head is None:
                    continue  # tied: the embedding serves as the head, as in transformers
                target, lo, hi = _target(model, name, slices)
                put(target, f.get_tensor(name), name, lo, hi)
                filled.add(name)
    _check_complete(model, filled)
    model.eval()
    return model


def _target(
    model: LlamaModel, name: str, slices: dict[str, tuple[str, int | None, int | None]]
) -> tuple[torch.Tensor, int | None, int | None]:
    """Where checkpoint tensor `name` goes (a parameter and its row range), or ModelNotAvailable:
    a tensor our forward would not use means the model computes something we do not."""
    top = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.norm, "lm_head.weight": model.lm_head}
    if name in top:
        return top[name], None, None
    m = _LAYER.match(name)
    if m:
        idx, rest = int(m.group(1)), m.group(2)
        if idx >= model.cfg.num_layers:
            raise ModelNotAvailable(f"weight {name} names layer {idx} of a {model.cfg.num_layers}-layer model")
        layer = model.layers[idx]
        norms = _norm_tensors(layer)
        if rest in norms:
            return norms[rest], None, None
        module, _, kind = rest.rpartition(".")
        if module in slices and kind in ("weight", "bias"):
            group, lo, hi = slices[module]
            target = getattr(layer, f"{group}_{kind}")
            if target is None:
                raise ModelNotAvailable(f"checkpoint has {name} but the config says no bias")
            return target, lo, hi
    raise ModelNotAvailable(
        f"checkpoint tensor {name} is not used by this engine's {model.cfg.model_type} forward "
        "(a layer or feature it does not implement); refusing rather than computing a different model"
    )


def _norm_tensors(layer: DecoderLayer) -> dict[str, torch.Tensor]:
    """A layer's norm weights by checkpoint name (after `model.layers.{i}.`), as its config has them:
    `post_attention_layernorm` is the MLP's input norm in Llama, the attention output's in OLMo 2
    and Gemma (whose MLP input norm is `pre_feedforward_layernorm`)."""
    norms: dict[str, torch.Tensor | None] = {}
    if layer.cfg.norm_after_sublayer:
        norms |= {"post_attention_layernorm.weight": layer.attn_out_norm,
                  "post_feedforward_layernorm.weight": layer.mlp_out_norm}
    if layer.cfg.norm_before_sublayer:
        mlp_in = "pre_feedforward_layernorm" if layer.cfg.norm_after_sublayer else "post_attention_layernorm"
        norms |= {"input_layernorm.weight": layer.input_norm, f"{mlp_in}.weight": layer.post_norm}
    norms |= {"self_attn.q_norm.weight": layer.q_norm, "self_attn.k_norm.weight": layer.k_norm}
    return {name: weight for name, weight in norms.items() if weight is not None}


def _check_complete(model: LlamaModel, filled: set[str]) -> None:
    cfg = model.cfg
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    if model.lm_head is not None:
        required.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        required += [p + name for name in _norm_tensors(model.layers[i])]
        if cfg.fused_projections:
            required += [p + name for name in ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
                                               "mlp.gate_up_proj.weight", "mlp.down_proj.weight")]
        else:
            required += [p + f"self_attn.{t}.weight" for t in ("q_proj", "k_proj", "v_proj", "o_proj")]
            required += [p + f"mlp.{t}.weight" for t in ("gate_proj", "up_proj", "down_proj")]
        if cfg.attention_bias:
            required += [p + f"self_attn.{t}.bias" for t in ("q_proj", "k_proj", "v_proj")]
        if cfg.attention_out_bias:
            required.append(p + "self_attn.o_proj.bias")
        if cfg.mlp_bias:
            required += [p + f"mlp.{t}.bias" for t in ("gate_proj", "up_proj", "down_proj")]
    missing = [n for n in required if n not in filled]
    if missing:
        raise ModelNotAvailable(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")
