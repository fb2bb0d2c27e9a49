"""The fused serving layer (#28): a llama-like `DecoderLayer` over a GGUF read in place, in four
grouped kernel calls (`gguf_kernel.group_matmul`: norm + q8_K + q|k|v; o_proj onto the residual;
norm + q8_K + gate|up; silu * up + q8_K + down_proj onto the residual) around rope and attention,
where the layer and the step allow it (`plans`), with the LoRA terms of adapter rows (gguf_lora). Says
whether a whole model's serving rows are row-invariant on this path (`row_invariance_gap`)."""

from __future__ import annotations

import os

import torch
from torch import Tensor

from edge_runtime.model import gguf_lora
from edge_runtime.model.gguf_weight import ACTIVATIONS_ENV, GgufWeight, activations_mode, kernel

# The part types whose int8 row products (grouped, and the head's `RawRows.matmul`) were measured and
# are tested to give a row the same bits alone as among 1-512 rows (tests/model/test_gguf_row_invariance.py).
INVARIANT_TYPES = ("Q4_K", "Q5_K", "Q6_K")

ENV = "MACE_GGUF_FUSED_LAYER"  # "off": every layer takes llama.py's per-op path
_KERNEL_ENV = "MACE_GGUF_KERNEL"  # gguf_kernel.ENV (that module needs gguf-py: imported only where built)
# The environment switches `plans` and `row_invariance_gap` read (a caller keeps their answer while these stay).
SWITCHES = (ENV, ACTIVATIONS_ENV, _KERNEL_ENV)


def _static(layer) -> bool:
    """Whether the layer's config has only what the fused path computes (cached on the layer)."""
    ok = layer.__dict__.get("_fused_static")
    if ok is None:
        cfg = layer.cfg
        ok = (cfg.norm_before_sublayer and not cfg.norm_after_sublayer and cfg.qk_norm is None
              and not cfg.attention_bias and not cfg.attention_out_bias and not cfg.mlp_bias
              and cfg.activation == "silu" and cfg.residual_multiplier == 1.0
              and all(isinstance(getattr(layer, name), GgufWeight) for name in _NAMES))
        layer.__dict__["_fused_static"] = ok
    return ok


_NAMES = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


def _weights(layer) -> tuple:
    """The four GgufWeights (submodules, where `_static` holds: skips nn.Module's attribute lookup)."""
    modules = layer._modules
    return tuple(modules[name] for name in _NAMES)


def plans(layer, x: Tensor, ctx) -> tuple | None:
    """(gguf_kernel, the four weights' `GroupPlan`s) where this step of `layer` takes the fused path,
    else None: the config (llama/Qwen2-without-bias-like: pre-norms only, no biases, no q/k norms,
    silu, no residual multiplier), every matrix a GgufWeight of K-quant parts, float32 rows on the
    CPU, no gradient, x as int8 for every weight (`engine.gguf_activations`: int8, or auto in the
    serving steps' inference mode), no row-invariant context (`engine.deterministic`), the compiled
    kernels built and not turned off. A decode step asks once per layer: the answer is kept on the
    layer while what it was made from (the environment, the settings, the very buffers) stays."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu" or torch.is_grad_enabled():
        return None
    if not _static(layer) or getattr(ctx, "row_invariant", False):
        return None
    env, weights, params = os.environ, _weights(layer), layer._parameters
    refs = (*(b for w in weights for b in w._buffers.values()), params["input_norm"], params["post_norm"])
    key = (env.get(ENV), env.get(ACTIVATIONS_ENV), env.get(_KERNEL_ENV), torch.is_inference_mode_enabled(),
           *(w.activations for w in weights), *map(id, refs))
    cached = layer.__dict__.get("_fused_plans")
    if cached is not None and cached[0] == key:
        return cached[2]
    group = _plans(layer, weights, key[3]) if (key[0] or "on").lower() != "off" else None
    layer.__dict__["_fused_plans"] = (key, refs, group)  # refs: the ids in key stay theirs
    return group


def row_invariance_gap(model) -> str | None:
    """Why a serving step's rows of `model` (a `LlamaModel`) would not be row-invariant through the
    fused path, or None where they are: every layer takes it (`plans`, in inference mode) and the
    head is an int8 row product of K-quant parts. The attention (the compiled per-row kernel) and
    the LoRA deltas are the caller's to check."""
    if model.dtype != torch.float32:
        return f"the model runs in {model.dtype} (the fused layer takes float32 rows)"
    probe = torch.zeros(1, model.cfg.hidden_size)
    with torch.inference_mode():
        for layer in model.layers:
            if plans(layer, probe, None) is None:
                return f"layer {layer.index} does not take the fused int8 serving layer (gguf_layer.plans)"
    head = model.lm_head_weight()
    if not isinstance(head, GgufWeight) or any(p.qtype not in INVARIANT_TYPES for p in head.raw_parts):
        return "the LM head is not a K-quant GGUF matrix (its product's rows may round by the row count)"
    if activations_mode(head.activations) not in ("int8", "auto"):
        return "the LM head's products take float activations (engine.gguf_activations)"
    return None


def _plans(layer, weights: tuple, inference: bool) -> tuple | None:
    for setting in {w.activations for w in weights}:
        mode = activations_mode(setting)
        if not (mode == "int8" or (mode == "auto" and inference)):
            return None
    gk = kernel()
    if gk is None:
        return None
    group = tuple(w.group_plan() for w in weights)
    if None in group:
        return None
    if any(n.dtype != torch.float32 or n.device.type != "cpu" for n in (layer.input_norm, layer.post_norm)):
        return None
    return (gk, *group)


def forward(layer, x: Tensor, cos: Tensor, sin: Tensor, ctx, group: tuple, rope) -> Tensor:
    """`DecoderLayer.forward` on the fused path (`plans` gave `group`; `rope`: llama.py's
    `apply_rope`, passed in so this module needs nothing of llama.py's): the same values as llama.py's
    but for the C norm and silu (a last-bit difference in a prepared row; `group_matmul`) and the LoRA
    terms, added onto each projection's output in C (gguf_lora: each row alone, in a fixed order) or,
    where those cannot serve the applier, as torch's deltas."""
    gk, qkv_plan, o_plan, gate_up_plan, down_plan = group
    cfg, lora, index = layer.cfg, ctx.lora, layer.index
    eps, offset, keep = cfg.rms_norm_eps, cfg.norm_offset, lora is not None
    plan = gguf_lora.plan_for(lora, cfg, cfg.num_layers) if keep else None

    def add_lora(stage: int, inputs: Tensor, out: Tensor) -> None:
        if plan is not None:
            plan.run(gk._library(), index, stage, inputs, out, torch.get_num_threads(), cfg)
        else:
            gguf_lora.add_torch(lora, index, stage, inputs, out, cfg)

    x = x.contiguous()
    qkv, hn = gk.group_matmul(x, qkv_plan, gk.PREP_NORM, layer.input_norm.detach(), offset, eps, keep=keep)
    if keep:
        add_lora(0, hn, qkv)
    # From here to the attention: llama.py's DecoderLayer.forward for this config.
    t = x.shape[0]
    v = qkv[:, cfg.q_size + cfg.kv_size:].reshape(t, cfg.num_kv_heads, cfg.head_dim)
    qk = qkv[:, : cfg.q_size + cfg.kv_size].unflatten(-1, (cfg.num_heads + cfg.num_kv_heads, cfg.head_dim))
    if cfg.rope_layers[index]:
        qk = rope(qk, cos, sin)
    q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
    if cfg.query_scale != 1.0:
        q = q * cfg.query_scale
    attn = ctx.attention(index, q, k, v).contiguous()
    x, _ = gk.group_matmul(attn, o_plan, base=x)
    if keep:
        add_lora(1, attn, x)
    gate_up, hn = gk.group_matmul(x, gate_up_plan, gk.PREP_NORM, layer.post_norm.detach(), offset, eps, keep=keep)
    if keep:
        add_lora(2, hn, gate_up)
    x, act = gk.group_matmul(gate_up, down_plan, gk.PREP_SILU_MUL, base=x, keep=keep)
    if keep:
        add_lora(3, act, x)
    return x
