"""Writes our llama step (prefill chunks or decode rows over the paged KV cache, per-row LoRA)
as one ONNX graph, straight from `LlamaModel`'s fused weights.

Two flavours of the same computation: "ort" uses ONNX Runtime's fused contrib ops
(GroupQueryAttention over the gathered paged context, SkipSimplifiedLayerNormalization,
MatMulNBits): every node costs microseconds of dispatch on a small CPU, and this cuts ~28 nodes
per layer to ~13. "standard" uses only ai.onnx ops (opset 21, block-wise DequantizeLinear for
weight-only quantisation, attention written out over a flat token batch), the form TensorRT
parses and the reference the "ort" graph is checked against. The inputs, outputs and
shapes are documented in docs/onnx.md; `StepInputs` (step_inputs.py) builds the index tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from edge_runtime.backends.gqa_window import window_counts_current_token
from edge_runtime.backends.quantize import (
    BLOCK_SIZE,
    OffsetNBitsWeight,
    bits_of,
    nbits_levels,
    pack_nbits,
    pack_q4_offsets,
    quantize_symmetric,
)
from edge_runtime.model.config import ModelConfig
from edge_runtime.model.llama import LlamaModel
from edge_runtime.model.qweights import QuantWeight

GRAPH_VERSION = 11  # bump when the graph's inputs, outputs or numerics change (part of the cache key)
OPSET = 21  # block-wise DequantizeLinear (INT4 weight-only) needs 21
IR_VERSION = 10  # the newest IR that ONNX Runtime 1.18+ and TensorRT 10 both read
FLAVOURS = ("ort", "standard")
KV_LAYOUTS = ("paged", "dense")
KV_DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}

# LoRA sites of one layer: fused projections and the PEFT targets that feed each, in column order.
LORA_SITES = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
# ... for a model whose checkpoint and adapters have the fused modules (Phi-3).
FUSED_LORA_SITES = {"qkv": ("qkv_proj",), "o": ("o_proj",), "gate_up": ("gate_up_proj",), "down": ("down_proj",)}


def lora_sites(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    return FUSED_LORA_SITES if cfg.fused_projections else LORA_SITES


def local_window(cfg: ModelConfig) -> int | None:
    """The windowed layers' window where windowed and full layers mix (Gemma): the "standard"
    graph then gathers whole contexts and masks those layers with `attn_bias_local`."""
    windows = set(cfg.layer_windows)
    return next((w for w in windows if w is not None), None) if len(windows) > 1 else None


def rope_by_row(cfg: ModelConfig) -> bool:
    """Whether the "ort" graph turns q and k itself (RotaryEmbedding at a `positions` input, the
    row of the rotary table per token) instead of inside GroupQueryAttention, whose table is
    indexed by position alone: LongRoPE rows depend on the sequence's length (a batch mixes
    sequences before and past the switch), and partial rotary is kept off GroupQueryAttention."""
    return cfg.rope_switch is not None or cfg.rotary_dim < cfg.head_dim


# Weight formats by the name `EngineConfig.onnx_quantization` takes: GraphSpec fields.
WEIGHT_FORMATS: dict[str, dict[str, object]] = {
    "none": {"quantization": "none"},
    "int8": {"quantization": "int8"},
    # 4-bit layers with integer zero points, 8-bit tied embedding / LM head: the accurate one.
    "int4": {"quantization": "int4"},
    # 4-bit throughout: the layers as in int4 and a 4-bit LM head with zero points, so a token
    # reads about as many bytes as onnxruntime-genai's int4 CPU format (symmetric 4-bit layers
    # and head), at a perplexity between the two (docs/onnx.md).
    "int4-compact": {"quantization": "int4", "head_bits": 4},
    # llama.cpp's Q4_1 grid (4-bit blocks with a float minimum) for the layers, the 8-bit head of
    # int8: a Q4_1 GGUF's own weights, exactly (the default model's), in 4 bits.
    "q4_1": {"quantization": "int4", "offsets": True},
}


def weight_format(name: str) -> dict[str, object]:
    """GraphSpec fields of a weight format name (ValueError naming the known ones)."""
    try:
        return dict(WEIGHT_FORMATS[name])
    except KeyError:
        raise ValueError(f"unknown ONNX weight quantisation {name!r}; use one of {', '.join(WEIGHT_FORMATS)}") from None


@dataclass(frozen=True)
class GraphSpec:
    """What varies between exports of one model (every field is part of the cache key)."""

    quantization: str = "none"  # "none" | "int8" | "int4" (weight-only)
    flavour: str = "ort"  # "ort" | "standard"
    kv_dtype: str = "float32"  # the KV cache tensor's dtype; attention math is float32
    # MatMulNBits accuracy level: 4 = int8 activations (the fast CPU path, as onnxruntime-genai
    # uses); 0 = dequantise to float32 and multiply.
    accuracy_level: int = 4
    lora: bool = True  # per-row LoRA inputs; False = a base-model-only graph (fewer nodes)
    symmetric: bool = False  # MatMulNBits without zero points (onnxruntime-genai's choice)
    head_bits: int = 8  # the tied embedding / LM head when quantised: 8 (Q8_0 grid) or 4 (zero
    # points unless `symmetric`)
    # 4-bit layers on llama.cpp's Q4_1 grid: symmetric 4-bit blocks plus a float offset per block,
    # added as (x summed over each block) @ offsets (quantize.pack_q4_offsets).
    offsets: bool = False
    # "ort" flavour only. "paged": each layer gathers every row's past from the paged cache
    # slabs (`kv_index`). "dense": each layer's past is a per-row contiguous float32 buffer
    # [rows, kv_heads, capacity, head_dim], bound as both past and present of
    # GroupQueryAttention, which appends the new keys in place (the backend owns the buffer).
    kv_layout: str = "paged"
    # "ort" flavour of a sliding-window model only: whether this onnxruntime's GroupQueryAttention
    # counts the query's own key in `local_window_size` (gqa_window.py probes it; None = not
    # needed, or not yet probed: `with_gqa_window` fills it in before export).
    gqa_window_counts_current: bool | None = None

    def __post_init__(self) -> None:
        if self.quantization not in ("none", "int8", "int4"):
            raise ValueError(f"unknown quantization {self.quantization!r}; use none, int8 or int4")
        if self.flavour not in FLAVOURS:
            raise ValueError(f"unknown graph flavour {self.flavour!r}; use one of {FLAVOURS}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"unsupported KV cache dtype {self.kv_dtype!r}; use one of {tuple(KV_DTYPES)}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"unknown KV layout {self.kv_layout!r}; use one of {KV_LAYOUTS}")
        if self.kv_layout == "dense" and self.flavour != "ort":
            raise ValueError("the dense KV layout needs the 'ort' flavour (GroupQueryAttention)")
        if self.offsets and (self.quantization != "int4" or self.symmetric):
            raise ValueError("block offsets (the q4_1 format) need int4 layers without 'symmetric'")

    @property
    def tag(self) -> str:
        lora = "" if self.lora else "-nolora"
        sym = "-sym" if self.symmetric and self.quantization != "none" else "-off" if self.offsets else ""
        head = f"-head{self.head_bits}" if self.head_bits != 8 and self.quantization != "none" else ""
        dense = "-dense" if self.kv_layout == "dense" else ""
        window = "" if self.gqa_window_counts_current is None else f"-win{int(self.gqa_window_counts_current)}"
        return (f"{self.flavour}{dense}-{self.quantization}{sym}{head}-kv{self.kv_dtype}-acc{self.accuracy_level}"
                f"{lora}{window}")


def with_gqa_window(spec: GraphSpec, model: LlamaModel,
                    providers: tuple[str, ...] = ("CPUExecutionProvider",)) -> GraphSpec:
    """`spec` with GroupQueryAttention's window convention, probed on `providers`, filled in where
    the graph needs it (an "ort" graph of a sliding-window model); otherwise `spec` as it is."""
    if spec.flavour != "ort" or not model.cfg.windowed or spec.gqa_window_counts_current is not None:
        return spec
    return replace(spec, gqa_window_counts_current=window_counts_current_token(providers))


class _Graph:
    """A tiny node/initializer accumulator with unique names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._count = 0
        self._consts: dict[tuple, str] = {}

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs) -> str | list[str]:
        self._count += 1
        outs = [f"{op_type}_{self._count}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, domain=domain or None, **attrs))
        return outs[0] if n_out == 1 else outs

    def init(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def const(self, values: list[int] | list[float] | int | float, dtype: type = np.int64) -> str:
        key = (repr(values), np.dtype(dtype).str)
        if key not in self._consts:
            self._consts[key] = self.init(f"const_{len(self._consts)}", np.array(values, dtype=dtype))
        return self._consts[key]


def _np(t: torch.Tensor | QuantWeight) -> np.ndarray:
    if isinstance(t, QuantWeight):  # a GGUF's blocks (gguf_load): de-quantised a weight at a time
        return t.dequantize().cpu().numpy()
    return t.detach().to(torch.float32).cpu().numpy()


class _StepWriter:
    """Emits the step for one model and spec; methods mirror `DecoderLayer.forward`."""

    def __init__(self, model: LlamaModel, spec: GraphSpec, on_layer: Callable[[], None] | None = None) -> None:
        self.model = model
        self.cfg = model.cfg
        self.spec = spec
        self.on_layer = on_layer  # called after each decoder layer is written (a progress bar)
        self.g = _Graph()
        self.ort = spec.flavour == "ort"
        self.dense = spec.kv_layout == "dense"
        self._block_sum_mats: set[str] = set()  # the 0/1 block-sum initializers written so far
        self._block_sums: dict[str, str] = {}  # a linear's input -> its per-block sums

    # -- primitives ---------------------------------------------------------------------------

    def linear(self, x: str, weight: torch.Tensor, bias: torch.Tensor | None, name: str) -> str:
        g, spec = self.g, self.spec
        w = _np(weight)  # [out, in]
        n, k = w.shape
        if spec.quantization == "none":
            y = g.op("MatMul", [x, g.init(f"{name}.weight", w.T)])
        elif spec.offsets:
            y = self._offset_linear(x, pack_q4_offsets(w), name)
        elif self.ort:
            bits = bits_of(spec.quantization)
            # 8-bit blocks are symmetric (Q8_0's grid); 4-bit ones min/max with zero points.
            q = pack_nbits(w, bits, symmetric=spec.symmetric or bits == 8)
            ins = [x, g.init(f"{name}.qweight", q.packed), g.init(f"{name}.scales", q.scales)]
            if q.zero_points is not None:
                ins.append(g.init(f"{name}.zero_points", q.zero_points))
            y = g.op(
                "MatMulNBits", ins,
                domain="com.microsoft", K=k, N=n, bits=q.bits, block_size=q.block_size,
                accuracy_level=spec.accuracy_level,
            )
        else:
            # Symmetric block-wise (TensorRT's weight-only INT4/INT8 takes no zero point).
            bits = bits_of(spec.quantization)
            q, scale = quantize_symmetric(w, bits)  # [N, K/b, b], [N, K/b]
            y = g.op("MatMul", [x, self._block_dequantized(q.reshape(n, k), scale, bits, name)])
        if bias is not None:
            y = g.op("Add", [y, g.init(f"{name}.bias", _np(bias))])
        return y

    def _offset_linear(self, x: str, w: OffsetNBitsWeight, name: str) -> str:
        """x @ W^T for W = scale * (q - 8) + offset per block: a symmetric MatMulNBits, plus x
        summed over each block of K (one MatMul by a 0/1 matrix, shared by the linears of one
        input) times the offsets [K / block, N]."""
        g, q = self.g, w.nbits
        if self.ort:
            y = g.op("MatMulNBits", [x, g.init(f"{name}.qweight", q.packed), g.init(f"{name}.scales", q.scales)],
                     domain="com.microsoft", K=q.k, N=q.n, bits=4, block_size=q.block_size,
                     accuracy_level=self.spec.accuracy_level)
        else:  # the standard flavour: signed INT4 blocks (q - 8 fits [-8, 7]) for DequantizeLinear
            signed = (nbits_levels(q).astype(np.int8) - 8).reshape(q.n, q.k)
            y = g.op("MatMul", [x, self._block_dequantized(signed, q.scales.reshape(q.n, -1), 4, name)])
        sums = self._block_sums.get(x)
        if sums is None:
            mat = f"block_sum_{q.k}"  # [K, K / block] of 0/1, one per width K
            if mat not in self._block_sum_mats:
                g.init(mat, np.kron(np.eye(q.k // q.block_size, dtype=np.float32), np.ones((q.block_size, 1), np.float32)))
                self._block_sum_mats.add(mat)
            sums = self._block_sums[x] = g.op("MatMul", [x, mat])
        shift = g.op("MatMul", [sums, g.init(f"{name}.offsets", np.ascontiguousarray(w.offsets.T))])
        return g.op("Add", [y, shift])

    def _block_dequantized(self, q: np.ndarray, scale: np.ndarray, bits: int, name: str) -> str:
        """Signed levels q [N, K] and scales [N, K / block] as a block-wise DequantizeLinear whose
        output is the weight in MatMul's layout [K, N] (blocks along K, axis 0)."""
        qt = q.T
        tensor = helper.make_tensor(
            f"{name}.qweight", TensorProto.INT4 if bits == 4 else TensorProto.INT8, list(qt.shape),
            qt.reshape(-1).astype(np.int8).tolist() if bits == 4 else qt.tobytes(), raw=bits == 8,
        )
        self.g.inits.append(tensor)
        return self.g.op("DequantizeLinear", [tensor.name, self.g.init(f"{name}.scales", scale.T)], axis=0,
                         block_size=BLOCK_SIZE)

    def _tied_quantized(self) -> bool:
        return self.ort and self.spec.quantization != "none" and self.model.lm_head is None

    def embedding(self, ids: str) -> str:
        """Token embeddings. Tied and quantised, the table is stored once as 8-bit blocks
        (symmetric, block 32: the grid of llama.cpp's Q8_0, which is what Q4_1 GGUFs keep for
        this tensor) and serves both GatherBlockQuantized here and the LM head's MatMulNBits:
        28 MB instead of 113 MB for the default model."""
        g, model = self.g, self.model
        if not self._tied_quantized():
            return g.op("Gather", [g.init("embed.weight", _np(model.embed)), ids], axis=0)
        # 8-bit: symmetric (Q8_0's grid, exact for a Q4_1 GGUF's table). 4-bit: min/max blocks
        # with zero points unless the format is symmetric throughout.
        symmetric = self.spec.head_bits == 8 or self.spec.symmetric
        q = pack_nbits(_np(model.embed), self.spec.head_bits, symmetric=symmetric)
        packed = g.init("embed.qweight", q.packed.reshape(q.n, q.k * q.bits // 8))
        scales = g.init("embed.scales", q.scales.reshape(q.n, -1))
        zeros = None if q.zero_points is None else g.init("embed.zero_points", q.zero_points.reshape(q.n, -1))
        self.tied_head = (q, packed, scales, zeros)
        return g.op("GatherBlockQuantized", [packed, ids, scales] + ([zeros] if zeros else []),
                    domain="com.microsoft", bits=q.bits, block_size=q.block_size, gather_axis=0, quantize_axis=1)

    def lm_head(self, rows: str) -> str:
        if not self._tied_quantized():
            return self.linear(rows, self.model.lm_head_weight(), None, "lm_head")
        q, packed, scales, zeros = self.tied_head
        blob = self.g.op("Reshape", [packed, self.g.const([q.n, q.k // q.block_size, q.block_size * q.bits // 8])])
        ins = [rows, blob, scales]
        if zeros:
            # MatMulNBits takes the same packed zero points, flat.
            ins.append(self.g.op("Reshape", [zeros, self.g.const([-1])]))
        return self.g.op("MatMulNBits", ins, domain="com.microsoft", K=q.k, N=q.n, bits=q.bits,
                         block_size=q.block_size, accuracy_level=self.spec.accuracy_level)

    def rms_norm(self, x: str, weight: torch.Tensor, name: str, skip: str | None = None) -> tuple[str, str]:
        """RMSNorm of (x + skip); returns (normalised, the sum that is the next residual)."""
        g, eps = self.g, self.cfg.rms_norm_eps
        # Gemma's weights are offsets from 1: added here in float32, as its RMSNorm does.
        w = _np(weight)
        w = g.init(f"{name}.weight", w + np.float32(self.cfg.norm_offset) if self.cfg.norm_offset else w)
        if self.ort:
            if skip is None:
                return g.op("SimplifiedLayerNormalization", [x, w], epsilon=eps, axis=-1, stash_type=1), x
            out, _, _, total = g.op("SkipSimplifiedLayerNormalization", [x, skip, w], n_out=4,
                                    domain="com.microsoft", epsilon=eps)
            return out, total
        total = x if skip is None else g.op("Add", [x, skip])
        ms = g.op("ReduceMean", [g.op("Mul", [total, total]), g.const([-1])], keepdims=1)
        inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [ms, g.const(eps, np.float32)])])])
        return g.op("Mul", [g.op("Mul", [total, inv]), w]), total

    def rotary(self, x: str, heads: int, table: int = 0) -> str:
        """RoPE (rotate-half convention) of x [1, T, heads * d] at `positions` (rows of rotary
        table `table`); with partial rotary only the first rotary_dim of each head turn."""
        g, d, r = self.g, self.cfg.head_dim, self.cfg.rotary_dim
        xh = g.op("Reshape", [x, g.const([1, -1, heads, d])])
        turned = xh
        if r < d:
            turned, kept = g.op("Split", [xh, g.const([r, d - r])], n_out=2, axis=-1)
        lo, hi = g.op("Split", [turned], n_out=2, axis=-1, num_outputs=2)
        rotated = g.op("Concat", [g.op("Neg", [hi]), lo], axis=-1)
        cos, sin = self.cos_full[table], self.sin_full[table]
        out = g.op("Add", [g.op("Mul", [turned, cos]), g.op("Mul", [rotated, sin])])
        if r < d:
            out = g.op("Concat", [out, kept], axis=-1)
        return g.op("Reshape", [out, g.const([1, -1, heads * d])])

    def rotary_embedding(self, x: str, heads: int, table: int = 0) -> str:
        """The "ort" graph's RoPE of x [B, S, heads * d] outside GroupQueryAttention: ONNX
        Runtime's RotaryEmbedding at the `positions` input's table rows (`rope_by_row`)."""
        cfg = self.cfg
        attrs = {"rotary_embedding_dim": cfg.rotary_dim} if cfg.rotary_dim < cfg.head_dim else {}
        caches = [self.cos_half[table], self.sin_half[table]]
        return self.g.op("RotaryEmbedding", [x, "positions", *caches], domain="com.microsoft",
                         interleaved=0, num_heads=heads, **attrs)

    def qk_norm(self, q: str, k: str, layer: torch.nn.Module, name: str) -> tuple[str, str]:
        """q [.., .., H*d] and k [.., .., KVH*d] RMS-normalised as `ModelConfig.qk_norm` says
        (before RoPE): "head" normalises each head (Qwen3), "full" the whole projection (OLMo 2)."""
        cfg, g = self.cfg, self.g
        if cfg.qk_norm is None:
            return q, k
        if cfg.qk_norm == "full":
            return self.rms_norm(q, layer.q_norm, f"{name}.q_norm")[0], self.rms_norm(k, layer.k_norm, f"{name}.k_norm")[0]
        out = []
        for x, weight, heads, tag in ((q, layer.q_norm, cfg.num_heads, "q_norm"),
                                      (k, layer.k_norm, cfg.num_kv_heads, "k_norm")):
            # Reshape's 0 keeps that dimension: [B, S, heads*d] or [1, T, heads*d] alike.
            x = g.op("Reshape", [x, g.const([0, 0, heads, cfg.head_dim])])
            x, _ = self.rms_norm(x, weight, f"{name}.{tag}")
            out.append(g.op("Reshape", [x, g.const([0, 0, heads * cfg.head_dim])]))
        return out[0], out[1]

    def scores(self, q: str, k: str) -> str:
        g, scale = self.g, float(self.cfg.attention_scale)
        kt = g.op("Transpose", [k], perm=[0, 1, 3, 2])
        return self.softcap(g.op("Mul", [g.op("MatMul", [q, kt]), g.const(scale, np.float32)]), self.cfg.attn_softcap)

    def softcap(self, x: str, cap: float | None) -> str:
        """Gemma's tanh(x / cap) * cap; x itself where cap is None."""
        if cap is None:
            return x
        g, c = self.g, self.g.const(cap, np.float32)
        return g.op("Mul", [g.op("Tanh", [g.op("Div", [x, c])]), c])

    def scaled(self, x: str, factor: float) -> str:
        """x * factor (Granite's multipliers); x itself where the factor is 1."""
        return x if factor == 1.0 else self.g.op("Mul", [x, self.g.const(factor, np.float32)])

    def lora(self, base: str, x: str, site: str, layer: int) -> str:
        """base + ((x @ A_l) * row_mask) @ B_l: each row gets only its own adapter's columns."""
        if not self.spec.lora:
            return base
        g = self.g
        u = g.op("MatMul", [x, self.lora_a[site][layer]])
        u = g.op("Mul", [u, self.lora_mask[len(lora_sites(self.cfg)[site])]])
        return g.op("Add", [base, g.op("MatMul", [u, self.lora_b[site][layer]])])

    # -- the step -----------------------------------------------------------------------------

    def inputs(self) -> list[onnx.ValueInfoProto]:
        cfg = self.cfg
        kv_type = KV_DTYPES[self.spec.kv_dtype]
        f, i64 = TensorProto.FLOAT, TensorProto.INT64
        vi = helper.make_tensor_value_info
        if self.ort:
            ins = [
                vi("input_ids", i64, ["rows", "row_tokens"]),
                vi("kv_index", i64, ["rows", cfg.num_kv_heads, "past"]),
                vi("seqlens_k", TensorProto.INT32, ["rows"]),
                vi("total_sequence_length", TensorProto.INT32, []),
                vi("new_kv_index", i64, ["tokens", cfg.num_kv_heads, 3]),
                vi("logit_rows", i64, ["logit_rows"]),
                vi("lora_index", i64, ["rows", "row_tokens"]),
                vi("lora_columns", i64, ["lora_rank"]),
            ]
            if self.dense:
                # No kv_index (each row's past is its own buffer) and no new_kv_index (the
                # backend reads this step's keys/values from that buffer).
                ins = [i for i in ins if i.name not in ("kv_index", "new_kv_index")]
            if rope_by_row(cfg):  # each token's row of the rotary table (LongRoPE, partial rotary)
                ins.insert(1, vi("positions", i64, ["rows", "row_tokens"]))
        else:
            ins = self.flat_inputs()
        if not self.spec.lora:
            ins = ins[:-2]
        for layer in range(cfg.num_layers if self.spec.lora else 0):
            for site, (fan_in, fan_out) in self.site_sizes().items():
                k = len(lora_sites(cfg)[site])
                ins.append(vi(f"lora.{layer}.{site}.a", f, [fan_in, f"lora_{site}_columns_x{k}"]))
                ins.append(vi(f"lora.{layer}.{site}.b", f, [f"lora_{site}_columns_x{k}", fan_out]))
        for layer in range(cfg.num_layers):
            for kind in ("key", "value"):
                if self.dense:
                    ins.append(vi(f"past.{layer}.{kind}", f, self.dense_shape()))
                else:
                    ins.append(vi(f"cache.{layer}.{kind}", kv_type, ["cache_rows", cfg.head_dim]))
        return ins

    def dense_shape(self) -> list:
        return ["rows", self.cfg.num_kv_heads, "kv_capacity", self.cfg.head_dim]

    def flat_inputs(self) -> list[onnx.ValueInfoProto]:
        cfg = self.cfg
        f, i64 = TensorProto.FLOAT, TensorProto.INT64
        vi = helper.make_tensor_value_info
        return [
            vi("input_ids", i64, ["tokens"]),
            vi("positions", i64, ["tokens"]),
            vi("q_index", i64, ["seqs", cfg.num_kv_heads, "group_queries"]),
            vi("kv_index", i64, ["seqs", cfg.num_kv_heads, "keys"]),
            vi("new_kv_index", i64, ["new_kv_rows", 3]),
            vi("attn_bias", f, ["seqs", 1, "group_queries", "keys"]),
        *([vi("attn_bias_local", f, ["seqs", 1, "group_queries", "keys"])] if local_window(cfg) else []),
            vi("out_index", i64, ["tokens", cfg.num_heads]),
            vi("logit_rows", i64, ["logit_rows"]),
            vi("lora_index", i64, ["tokens"]),
            vi("lora_columns", i64, ["lora_rank"]),
        ]

    def site_sizes(self) -> dict[str, tuple[int, int]]:
        cfg = self.cfg
        h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        return {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * inter), "down": (inter, h)}

    def prepare_shared(self) -> None:
        g, cfg, model = self.g, self.cfg, self.model
        L = cfg.num_layers
        # One set of tables per rotary table of the model (Gemma 3's sliding layers have their own).
        self.cos_half, self.sin_half, self.cos_full, self.sin_full = [], [], [], []
        if not self.ort:
            self.position_ids = g.op("Unsqueeze", ["positions", g.const([0])])  # [1, T]
        for t, rope in enumerate(model.ropes):
            tag = "rope" if t == 0 else f"rope{t}"
            cos = rope.cos.float().cpu().numpy()
            sin = rope.sin.float().cpu().numpy()
            if self.ort:
                half = cfg.rotary_dim // 2
                self.cos_half.append(g.init(f"{tag}.cos_half", cos[:, :half]))
                self.sin_half.append(g.init(f"{tag}.sin_half", sin[:, :half]))
                continue
            # [1, T, 1, d]: broadcast over heads, gathered once per step for every layer.
            for name, table in (("cos_full", cos), ("sin_full", sin)):
                rows = g.op("Gather", [g.init(f"{tag}.{name}", table), self.position_ids], axis=0)
                getattr(self, name).append(g.op("Unsqueeze", [rows, g.const([2])]))
        if not self.spec.lora:
            return
        # Row masks: column c of the stacked LoRA weights belongs to adapter lora_columns[c].
        same = g.op("Equal", [g.op("Unsqueeze", ["lora_index", g.const([-1])]), "lora_columns"])
        mask = g.op("Cast", [same], to=TensorProto.FLOAT)  # [T, M] (flat) or [B, S, M] (rows)
        self.lora_mask = {1: mask, 2: g.op("Concat", [mask, mask], axis=-1),
                          3: g.op("Concat", [mask, mask, mask], axis=-1)}
        # Per-layer inputs (bound as views of one stacked array): a Split here would copy them all.
        self.lora_a = {site: [f"lora.{i}.{site}.a" for i in range(L)] for site in lora_sites(cfg)}
        self.lora_b = {site: [f"lora.{i}.{site}.b" for i in range(L)] for site in lora_sites(cfg)}

    def attention(self, layer: int, q: str, k: str, v: str) -> str:
        """q [1, T, H*d], k/v [1, T, KVH*d] (RoPE applied) -> [1, T, H*d] over cache + new keys."""
        g, cfg = self.g, self.cfg
        d = cfg.head_dim
        rows = g.const([-1, d])
        qh = g.op("Gather", [g.op("Reshape", [q, rows]), "q_index"], axis=0)  # [B, KVH, GS, d]

        def context(kind: str, new: str) -> str:
            # Cached keys of every sequence, then this step's keys scattered over their (stale)
            # slots: [B, KVH, W, d]. ScatterND may reuse the gather's buffer, so no extra copy.
            past = g.op("Gather", [f"cache.{layer}.{kind}", "kv_index"], axis=0)
            if self.spec.kv_dtype != "float32":
                past = g.op("Cast", [past], to=TensorProto.FLOAT)
            return g.op("ScatterND", [past, "new_kv_index", g.op("Reshape", [new, rows])])

        keys, values = context("key", k), context("value", v)
        # Windowed layers of a model that mixes them with full ones mask their own window.
        bias = "attn_bias_local" if local_window(cfg) and cfg.layer_windows[layer] is not None else "attn_bias"
        probs = g.op("Softmax", [g.op("Add", [self.scores(qh, keys), bias])], axis=-1)
        ctx = g.op("Reshape", [g.op("MatMul", [probs, values]), rows])  # [B*KVH*GS, d]
        out = g.op("Gather", [ctx, "out_index"], axis=0)  # [T, H, d]
        return g.op("Reshape", [out, g.const([1, -1, cfg.q_size])])

    def gqa_attention(self, layer: int, qkv: str) -> tuple[str, str]:
        """qkv [B, S, (H + 2 KVH) d] -> (attention [B, S, H d], this step's K|V [B*S, 2 KVH, d]).
        GroupQueryAttention applies RoPE at each row's positions (from seqlens_k), appends the
        new keys to the gathered past and attends causally; the new K/V are read back from its
        present outputs so our cache can store them. With q/k norms (applied before RoPE, so
        before the node), or RoPE turned outside it (`rope_by_row`), q, k and v go in as three
        inputs instead of the packed one."""
        g, cfg = self.g, self.cfg
        qkv_inputs = [qkv, "", ""]
        by_row = rope_by_row(cfg)
        if cfg.qk_norm is not None or by_row:
            q, k, v = g.op("Split", [qkv, g.const([cfg.q_size, cfg.kv_size, cfg.kv_size])], n_out=3, axis=-1)
            q, k = self.qk_norm(q, k, self.model.layers[layer], f"layers.{layer}")
            if by_row and cfg.rope_layers[layer]:
                table = cfg.layer_rope_table[layer]
                q, k = self.rotary_embedding(q, cfg.num_heads, table), self.rotary_embedding(k, cfg.num_kv_heads, table)
            qkv_inputs = [q, k, v]

        def past(kind: str) -> str:
            if self.dense:
                return f"past.{layer}.{kind}"  # [B, KVH, capacity, d], this row's own buffer
            rows = g.op("Gather", [f"cache.{layer}.{kind}", "kv_index"], axis=0)  # [B, KVH, P, d]
            return rows if self.spec.kv_dtype == "float32" else g.op("Cast", [rows], to=TensorProto.FLOAT)

        window = -1
        if cfg.layer_windows[layer] is not None:  # this layer's window (Gemma mixes windowed and full layers)
            # transformers' window counts the query's own key; this build's attribute may not.
            counts_current = self.spec.gqa_window_counts_current
            if counts_current is None:
                raise ValueError("a sliding-window 'ort' graph needs GraphSpec.gqa_window_counts_current "
                                 "(with_gqa_window probes it)")
            window = cfg.layer_windows[layer] if counts_current else cfg.layer_windows[layer] - 1
        rope = cfg.rope_layers[layer] and not by_row
        inputs = [*qkv_inputs, past("key"), past("value"), "seqlens_k", "total_sequence_length"]
        if rope:
            table = cfg.layer_rope_table[layer]
            inputs += [self.cos_half[table], self.sin_half[table]]
        attrs = dict(domain="com.microsoft", num_heads=cfg.num_heads, kv_num_heads=cfg.num_kv_heads,
                     scale=float(cfg.attention_scale), do_rotary=int(rope), rotary_interleaved=0,
                     local_window_size=window)
        if cfg.attn_softcap is not None:  # Gemma 2: tanh(s / cap) * cap on the scaled scores
            attrs["softcap"] = float(cfg.attn_softcap)
        if self.dense:
            # present.* are graph outputs bound to the same memory as past.*: ONNX Runtime then
            # shares the buffer and writes only this step's keys/values, at each row's position.
            present_k, present_v = f"present.{layer}.key", f"present.{layer}.value"
            self.g._count += 1
            attn = f"GroupQueryAttention_{self.g._count}_0"
            g.nodes.append(helper.make_node("GroupQueryAttention", inputs, [attn, present_k, present_v], **attrs))
            return attn, None
        attn, present_k, present_v = g.op("GroupQueryAttention", inputs, n_out=3, **attrs)
        new_k = g.op("GatherND", [present_k, "new_kv_index"])  # [B*S, KVH, d]
        new_v = g.op("GatherND", [present_v, "new_kv_index"])
        return attn, g.op("Concat", [new_k, new_v], axis=1)

    def build(self) -> onnx.ModelProto:
        g, cfg, model = self.g, self.cfg, self.model
        self.prepare_shared()
        # Activations are [1, T, h] (flat) or [B, S, h] (rows, "ort").
        ids = "input_ids" if self.ort else g.op("Unsqueeze", ["input_ids", g.const([0])])
        x = self.scaled(self.embedding(ids), cfg.embedding_multiplier)
        residual, delta = x, None
        kv_out = []
        # Norms on the sublayers' inputs (all but OLMo 2), on their outputs (OLMo 2, Gemma).
        pre, post = cfg.norm_before_sublayer, cfg.norm_after_sublayer
        for i, layer in enumerate(model.layers):
            p = f"layers.{i}"
            if not pre:
                residual = residual if delta is None else g.op("Add", [residual, delta])
                hn = residual
            else:
                hn, residual = self.rms_norm(residual, layer.input_norm, f"{p}.input_norm", delta)
            qkv = self.lora(self.linear(hn, layer.qkv_weight, layer.qkv_bias, f"{p}.qkv"), hn, "qkv", i)
            if self.ort:
                attn, kv_new = self.gqa_attention(i, qkv)
                kv_out.append(kv_new)
            else:
                q, k, v = g.op("Split", [qkv, g.const([cfg.q_size, cfg.kv_size, cfg.kv_size])], n_out=3, axis=-1)
                q, k = self.qk_norm(q, k, layer, p)
                if cfg.rope_layers[i]:  # SmolLM3's NoPE layers attend without positions
                    table = cfg.layer_rope_table[i]
                    q, k = self.rotary(q, cfg.num_heads, table), self.rotary(k, cfg.num_kv_heads, table)
                kv_out.append(g.op("Concat", [k, v], axis=-1))
                attn = self.attention(i, q, k, v)
            o = self.lora(self.linear(attn, layer.o_weight, layer.o_bias, f"{p}.o"), attn, "o", i)
            if post:
                o, _ = self.rms_norm(o, layer.attn_out_norm, f"{p}.attn_out_norm")
            o = self.scaled(o, cfg.residual_multiplier)
            if not pre:
                residual = hn = g.op("Add", [residual, o])
            else:
                hn, residual = self.rms_norm(residual, layer.post_norm, f"{p}.post_norm", o)
            gu = self.lora(self.linear(hn, layer.gate_up_weight, layer.gate_up_bias, f"{p}.gate_up"), hn, "gate_up", i)
            gate, up = g.op("Split", [gu], n_out=2, axis=-1, num_outputs=2)
            if cfg.activation == "silu":
                act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
            else:  # Gemma's GELU-tanh (ai.onnx Gelu, opset 20+)
                act = g.op("Mul", [g.op("Gelu", [gate], approximate="tanh"), up])
            delta = self.lora(self.linear(act, layer.down_weight, layer.down_bias, f"{p}.down"), act, "down", i)
            if post:
                delta, _ = self.rms_norm(delta, layer.mlp_out_norm, f"{p}.mlp_out_norm")
            delta = self.scaled(delta, cfg.residual_multiplier)
            if self.on_layer is not None:
                self.on_layer()
        normed, _ = self.rms_norm(residual, model.norm, "norm", delta)
        flat = g.op("Reshape", [normed, g.const([-1, cfg.hidden_size])])
        rows = g.op("Gather", [flat, "logit_rows"], axis=0)  # [R, h]
        logits = self.lm_head(rows)
        if cfg.logits_scaling != 1.0:  # Granite divides its logits
            logits = g.op("Div", [logits, g.const(cfg.logits_scaling, np.float32)])
        logits = self.softcap(logits, cfg.final_softcap)  # Gemma's final soft-cap
        g.nodes.append(helper.make_node("Reshape", [logits, g.const([-1, cfg.vocab_size])], ["logits"]))
        outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["logit_rows", cfg.vocab_size])]
        if not self.dense:
            new_kv = g.op("Reshape", [g.op("Concat", kv_out, axis=0), g.const([cfg.num_layers, -1, 2 * cfg.kv_size])])
            if self.spec.kv_dtype != "float32":
                new_kv = g.op("Cast", [new_kv], to=KV_DTYPES[self.spec.kv_dtype])
            g.nodes.append(helper.make_node("Identity", [new_kv], ["new_kv"]))
            outputs.append(helper.make_tensor_value_info("new_kv", KV_DTYPES[self.spec.kv_dtype],
                                                         [cfg.num_layers, "tokens", 2 * cfg.kv_size]))
        else:
            outputs += [helper.make_tensor_value_info(f"present.{layer}.{kind}", TensorProto.FLOAT, self.dense_shape())
                        for layer in range(cfg.num_layers) for kind in ("key", "value")]
        graph = helper.make_graph(g.nodes, "mace_edge_step", self.inputs(), outputs, g.inits)
        opsets = [helper.make_opsetid("", OPSET)]
        if self.ort:
            opsets.append(helper.make_opsetid("com.microsoft", 1))
        proto = helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION,
                                  producer_name="mace-edge", producer_version=str(GRAPH_VERSION))
        helper.set_model_props(proto, {
            "graph_version": str(GRAPH_VERSION), "flavour": self.spec.flavour,
            "quantization": self.spec.quantization, "lora": str(int(self.spec.lora)),
            "kv_layout": self.spec.kv_layout,
            "layers": str(cfg.num_layers), "heads": str(cfg.num_heads), "kv_heads": str(cfg.num_kv_heads),
            "group": str(cfg.num_heads // cfg.num_kv_heads), "head_dim": str(cfg.head_dim),
            "vocab": str(cfg.vocab_size),
        })
        return proto


def build_step_graph(model: LlamaModel, spec: GraphSpec,
                     on_layer: Callable[[], None] | None = None) -> onnx.ModelProto:
    """The whole step (embedding to logits and new K/V) as an ONNX model, weights inline;
    `on_layer` is called after each decoder layer (quantising the layers is most of the time)."""
    return _StepWriter(model, spec, on_layer).build()
