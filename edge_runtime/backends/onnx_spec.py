"""What an export of the step graph is (`GraphSpec`: flavour, weight format, KV layout and dtype,
LoRA inputs; every field part of the cache key) and the facts about a model that shape its graph
(LoRA sites, mixed windows, RoPE by table row). No graph is written here: see onnx_graph.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from onnx import TensorProto

from edge_runtime.backends.gqa_window import window_counts_current_token
from edge_runtime.model.config import ModelConfig
from edge_runtime.model.llama import LlamaModel

GRAPH_VERSION = 13  # bump when the graph's inputs, outputs or numerics change (part of the cache key)
OPSET = 21  # block-wise DequantizeLinear (INT4 weight-only) needs 21
IR_VERSION = 10  # the newest IR that ONNX Runtime 1.18+ and TensorRT 10 both read
FLAVOURS = ("ort", "standard")
KV_LAYOUTS = ("paged", "dense")
KV_DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
# The KV dtype name a graph takes for a cache slab of this torch dtype (the backends bind the slab).
TORCH_KV_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

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
    # "ort" flavour: rows of GroupQueryAttention's cos/sin tables, which it indexes by position
    # alone (`rope_table_rows`); 0 = every position the model has (131,072 rows at Llama 3.1/3.2:
    # 64 MiB at 8B, 32 at 1B, for contexts an engine's KV cache never holds).
    rope_positions: int = 0

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
        if self.rope_positions < 0 or (self.rope_positions and self.flavour != "ort"):
            raise ValueError(f"rope_positions {self.rope_positions}: a positive row count, 'ort' flavour only")

    @property
    def tag(self) -> str:
        lora = "" if self.lora else "-nolora"
        sym = "-sym" if self.symmetric and self.quantization != "none" else "-off" if self.offsets else ""
        head = f"-head{self.head_bits}" if self.head_bits != 8 and self.quantization != "none" else ""
        dense = "-dense" if self.kv_layout == "dense" else ""
        window = "" if self.gqa_window_counts_current is None else f"-win{int(self.gqa_window_counts_current)}"
        rope = f"-rope{self.rope_positions}" if self.rope_positions else ""
        return (f"{self.flavour}{dense}-{self.quantization}{sym}{head}-kv{self.kv_dtype}-acc{self.accuracy_level}"
                f"{lora}{window}{rope}")


# The fewest rows `rope_table_rows` gives (2 MiB of tables at 8B): contexts under it share a graph.
MIN_ROPE_ROWS = 4096


def rope_table_rows(cfg: ModelConfig, flavour: str, max_context: int, cache_tokens: int) -> int:
    """`GraphSpec.rope_positions` for an engine whose sequences hold at most `max_context` tokens
    (0: the model's maximum) in a KV cache of `cache_tokens` positions: the power of two at or
    above that context (ONNX Runtime refuses a step whose total length passes the table; the
    last step's, a row-invariant decode row's pad included (step_inputs.query_pad), is the
    context), at least MIN_ROPE_ROWS, so a KV budget that moves a little between starts (it
    follows the memory free) keeps its graph; 0 (the whole table) where that reaches the
    model's maximum, for the "standard" flavour, and where table rows are not positions
    (`rope_by_row`: LongRoPE's rows run past the positions)."""
    limit = cfg.max_position_embeddings
    context = min(max_context or limit, cache_tokens or limit, limit)
    rows = max(MIN_ROPE_ROWS, 1 << max(0, context - 1).bit_length())
    if flavour != "ort" or rope_by_row(cfg) or rows >= limit:
        return 0
    return rows


def with_gqa_window(spec: GraphSpec, model: LlamaModel,
                    providers: tuple[str, ...] = ("CPUExecutionProvider",)) -> GraphSpec:
    """`spec` with GroupQueryAttention's window convention, probed on `providers`, filled in where
    the graph needs it (an "ort" graph of a sliding-window model); otherwise `spec` as it is."""
    if spec.flavour != "ort" or not model.cfg.windowed or spec.gqa_window_counts_current is not None:
        return spec
    return replace(spec, gqa_window_counts_current=window_counts_current_token(providers))
