"""The decode stack (#28): every layer of a decode-only step over a GGUF read in place in one C call
(`gg_decode_stack` in gguf_native_stack.c: the fused serving layer's calls in its order, with
kv/attention.c's rope, KV write and attention and the adapter rows' LoRA terms, gguf_lora's), where
the step allows it (`run`); else None."""

from __future__ import annotations

import ctypes
import os

import torch
from torch import Tensor

from edge_runtime.kv import attention_kernel
from edge_runtime.model import gguf_layer, gguf_lora
from edge_runtime.model.gguf_weight import ACTIVATIONS_ENV
from edge_runtime.model.qkernel import switch_on

ENV = "MACE_GGUF_STACK"  # "off": each layer's own calls (gguf_layer.forward)
_ENVS = (gguf_layer.ENV, ACTIVATIONS_ENV, gguf_layer._KERNEL_ENV, attention_kernel.ENV)


class _Weight(ctypes.Structure):
    _fields_ = [("types", ctypes.c_void_p), ("raws", ctypes.c_void_p), ("starts", ctypes.c_void_p),
                ("cols", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("nparts", ctypes.c_int),
                ("threads", ctypes.c_int)]


class _Layer(ctypes.Structure):
    _fields_ = [("w", _Weight * 4), ("norm", ctypes.c_void_p * 2), ("k_cache", ctypes.c_void_p),
                ("v_cache", ctypes.c_void_p), ("table", ctypes.c_int64)]


class _Stack:
    """What one model's stack call needs that does not change between steps: each layer's grouped
    weights, norms, KV planes and rope table, and the attention library's functions."""

    def __init__(self, model, ctx, group_of: list[tuple]) -> None:
        cfg = model.cfg
        self.gk = group_of[0][0]
        self.refs = []  # every array whose address the C structures hold
        self.layers = (_Layer * len(model.layers))()
        threads = self.gk._threads
        for i, (layer, group) in enumerate(zip(model.layers, group_of, strict=True)):
            entry = self.layers[i]
            for j, plan in enumerate(group[1:]):
                w = entry.w[j]
                w.types, w.raws, w.starts = (ctypes.cast(a, ctypes.c_void_p) for a in (plan._types, plan._ptrs,
                                                                                        plan._starts))
                w.cols, w.n, w.k, w.nparts = plan.cols.data_ptr(), plan.n, plan.k, plan.nparts
                w.threads = threads(plan.n, plan.n * plan.k)
                self.refs.append(plan)
            entry.norm[0], entry.norm[1] = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            k_cache, v_cache = ctx.cache.layer(layer.index)
            entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            entry.table = cfg.layer_rope_table[layer.index]
        lib = attention_kernel._library()
        self.fns = tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                         for name in ("decode_attention", "write_kv", "rope_f32"))


def _static(model) -> bool:
    """Whether the model's config has only what the stack computes (cached on the model)."""
    ok = model.__dict__.get("_stack_static")
    if ok is None:
        cfg = model.cfg
        windows = cfg.layer_windows  # a tuple, one a layer
        ok = (cfg.query_scale == 1.0 and all(cfg.rope_layers) and len(model.layers) == cfg.num_layers
              and cfg.head_dim % 8 == 0 and cfg.num_heads % cfg.num_kv_heads == 0
              and cfg.q_size == cfg.num_heads * cfg.head_dim and cfg.kv_size == cfg.num_kv_heads * cfg.head_dim
              and all(w is None for w in windows))
        model.__dict__["_stack_static"] = bool(ok)
    return model.__dict__["_stack_static"]


def _decode_plan(ctx, m: int):
    """The attention plan of a decode-only step of `m` rows on the compiled path, else None."""
    if (not getattr(ctx, "compiled", False) or getattr(ctx, "row_invariant", False)
            or ctx.decode_pruning is not None or ctx.decode_entries is not None or len(ctx.plans) != 1):
        return None
    plan = ctx.plans.get(None)
    if plan is None or plan.has_prefills or plan.decode_rows is None or plan.decode_rows.shape[0] != m:
        return None
    return plan


def _stack(model, x: Tensor, ctx) -> _Stack | None:
    """The model's stack for this step's settings (made again when they change), or None where a
    layer would not take the fused path or the cache is not float32 contiguous."""
    cache = ctx.cache.data
    env = os.environ
    key = (*(env.get(name) for name in _ENVS), torch.is_inference_mode_enabled(), torch.get_num_threads(),
           cache.data_ptr(), cache.dtype, tuple(cache.shape))
    cached = model.__dict__.get("_decode_stack")
    if cached is not None and cached[0] == key:
        return cached[1]
    stack = None
    if cache.dtype == torch.float32 and cache.is_contiguous():
        group_of = [gguf_layer.plans(layer, x, ctx) for layer in model.layers]
        planes = [ctx.cache.layer(layer.index) for layer in model.layers]
        if all(g is not None for g in group_of) and all(t.is_contiguous() for kv in planes for t in kv):
            stack = _Stack(model, ctx, group_of)
    model.__dict__["_decode_stack"] = (key, stack)
    return stack


def run(model, x: Tensor, tables: list[tuple[Tensor, Tensor]], ctx) -> Tensor | None:
    """Every layer of this step on hidden states x [m, hidden] in one call where it is a decode-only
    step the stack computes as the per-layer path does (LlamaModel.run_layers' result, bit for bit),
    else None (the caller runs the layers)."""
    if (x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu" or torch.is_grad_enabled()
            or not _static(model) or not switch_on(ENV)):
        return None
    m = x.shape[0]
    plan = _decode_plan(ctx, m)
    if plan is None or not attention_kernel.usable(ctx.cache.data):
        return None
    stack = _stack(model, x, ctx)
    if stack is None:
        return None
    cfg = model.cfg
    lora = None if ctx.lora is None else gguf_lora.plan_for(ctx.lora, cfg, cfg.num_layers)
    if ctx.lora is not None and (lora is None or lora.rest is not None):
        return None  # torch's deltas serve some rows: the per-layer path
    heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cos = [c for c, _ in tables]
    sin = [s for _, s in tables]
    r = cos[0].shape[-1]
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.shape != (m, r) for t in (*cos, *sin)) or r % 2 or r > d:
        return None
    index, lens, rows = plan.decode_index.contiguous(), plan.decode_lens.contiguous(), plan.decode_rows.contiguous()
    slots = ctx.slot_mapping.contiguous()
    width = index.shape[1]
    out, x2 = x.clone(memory_format=torch.contiguous_format), torch.empty_like(x)
    q_size, kv_size = heads * d, kv_heads * d
    qkv = torch.empty(m, q_size + 2 * kv_size)
    qk = torch.empty(m, heads + kv_heads, d)
    attn = torch.empty(m, q_size)
    gate_up = torch.empty(m, 2 * cfg.intermediate_size)
    scratch = torch.empty(heads * (2 * d + width + 1) + d)
    xf = torch.empty(m, max(x.shape[1], cfg.intermediate_size)) if lora is not None else None
    cos_p = (ctypes.c_void_p * len(cos))(*(t.data_ptr() for t in cos))
    sin_p = (ctypes.c_void_p * len(sin))(*(t.data_ptr() for t in sin))
    rc = stack.gk._library().gg_decode_stack(
        out.data_ptr(), x2.data_ptr(), m, x.shape[1], len(model.layers), ctypes.byref(stack.layers), heads, kv_heads,
        d, r, cfg.norm_offset, cfg.rms_norm_eps, cos_p, sin_p, slots.data_ptr(), index.data_ptr(), lens.data_ptr(),
        rows.data_ptr(), width, d ** -0.5, ctx.softcap or 0.0, qkv.data_ptr(), qk.data_ptr(), attn.data_ptr(),
        gate_up.data_ptr(), scratch.data_ptr(), *stack.fns, None if lora is None else ctypes.byref(lora.terms),
        None if lora is None else lora.spans.data_ptr(), None if xf is None else xf.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"the decode stack's call failed ({rc}) where its plan said it applies")
    return out
