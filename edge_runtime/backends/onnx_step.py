"""The decoder step as ONNX nodes, whatever the flavour: the layer loop (mirroring
`DecoderLayer.forward`), linears with their weight formats and LoRA columns, norms' weights, the
inputs, outputs and model properties. What each flavour writes its own way (quantised matmuls,
RMSNorm, RoPE, attention) is left to its writer: onnx_ort.py and onnx_standard.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from edge_runtime.backends.onnx_blocks import BlockPart, block_part, block_parts
from edge_runtime.backends.onnx_external import ExternalData
from edge_runtime.backends.onnx_spec import (
    GRAPH_VERSION,
    IR_VERSION,
    KV_DTYPES,
    OPSET,
    GraphSpec,
    lora_sites,
)
from edge_runtime.backends.quantize import NBitsWeight, OffsetNBitsWeight, pack_q4_offsets
from edge_runtime.model.llama import LlamaModel
from edge_runtime.model.qweights import QuantWeight


class GraphBuilder:
    """A tiny node/initializer accumulator with unique names. With a `sink`, each initializer's
    bytes go to the external data file as it is made (the graph keeps only the reference)."""

    def __init__(self, sink: ExternalData | None = None) -> None:
        self.sink = sink
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._count = 0
        self._consts: dict[tuple, str] = {}

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs) -> str | list[str]:
        self._count += 1
        outs = [f"{op_type}_{self._count}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, domain=domain or None, **attrs))
        return outs[0] if n_out == 1 else outs

    def node(self, op_type: str, inputs: list[str], outputs: list[str], **attrs) -> str:
        """A node whose later outputs carry given names (graph outputs); returns its first output."""
        self._count += 1
        first = f"{op_type}_{self._count}_0"
        self.nodes.append(helper.make_node(op_type, inputs, [first, *outputs], **attrs))
        return first

    def add(self, tensor: onnx.TensorProto) -> str:
        if self.sink is not None:
            self.sink.take(tensor)
        self.inits.append(tensor)
        return tensor.name

    def init(self, name: str, array: np.ndarray) -> str:
        direct = None if self.sink is None else self.sink.array(name, array)
        if direct is not None:
            self.inits.append(direct)
            return name
        return self.add(numpy_helper.from_array(np.ascontiguousarray(array), name))

    def const(self, values: list[int] | list[float] | int | float, dtype: type = np.int64) -> str:
        key = (repr(values), np.dtype(dtype).str)
        if key not in self._consts:
            self._consts[key] = self.init(f"const_{len(self._consts)}", np.array(values, dtype=dtype))
        return self._consts[key]


def as_numpy(t: torch.Tensor | QuantWeight) -> np.ndarray:
    if isinstance(t, QuantWeight):  # a GGUF's blocks (gguf_load): de-quantised a weight at a time
        return t.dequantize().cpu().numpy()
    return t.detach().to(torch.float32).cpu().numpy()


class StepWriter(ABC):
    """Emits the step for one model and spec; a flavour's writer fills in the abstract parts."""

    def __init__(self, model: LlamaModel, spec: GraphSpec, on_layer: Callable[[], None] | None = None,
                 sink: ExternalData | None = None) -> None:
        self.model = model
        self.cfg = model.cfg
        self.spec = spec
        self.on_layer = on_layer  # called after each decoder layer is written (a progress bar)
        self.g = GraphBuilder(sink)
        self._block_sums: dict[tuple[str, int], str] = {}  # (a linear's input, block) -> its block sums

    # -- what each flavour writes its own way ---------------------------------------------------

    @abstractmethod
    def quantized_matmul(self, x: str, w: np.ndarray, name: str) -> str:
        """x @ w.T for float w [N, K] in the spec's weight-only format (not q4_1)."""

    @abstractmethod
    def q4_matmul(self, x: str, q: NBitsWeight, name: str) -> str:
        """x @ W^T for symmetric 4-bit blocks W = scale * (q - 8) (the q4_1 format's product)."""

    @abstractmethod
    def block_matmul(self, x: str, part: BlockPart, name: str) -> tuple[str, np.ndarray | None]:
        """x @ W^T for the part's W = scale * (q - zero) (its levels and scales as they are),
        and the float offsets [N, K / block] (None: none) the caller adds as block sums times them."""

    @abstractmethod
    def normalize(self, x: str, w: str, skip: str | None) -> tuple[str, str]:
        """RMSNorm of (x + skip) with weight initializer w; returns (normalised, the sum)."""

    @abstractmethod
    def step_inputs(self) -> list[onnx.ValueInfoProto]:
        """The step's index inputs, ending with `lora_index` and `lora_columns`."""

    @abstractmethod
    def prepare_rope(self) -> None:
        """The rotary tables every layer shares."""

    @abstractmethod
    def token_ids(self) -> str:
        """The token ids as the embedding reads them."""

    @abstractmethod
    def attention_block(self, i: int, layer: torch.nn.Module, qkv: str) -> tuple[str, str | None]:
        """Layer i's attention from its fused q|k|v: (output, this step's K|V or None)."""

    # -- shared parts ---------------------------------------------------------------------------

    def from_blocks(self, weight: torch.Tensor | QuantWeight) -> bool:
        """Whether `weight` is written from its GGUF blocks as they are (the q4_1 format holds
        every block format exactly: onnx_blocks.py) rather than de-quantised and re-quantised."""
        return isinstance(weight, QuantWeight) and self.spec.offsets

    def linear(self, x: str, weight: torch.Tensor | QuantWeight, bias: torch.Tensor | None, name: str,
               rank: int | None = None) -> str:
        """x @ W^T (+ bias); `rank`: x's, where the writer knows it (hidden states [B, S, K], the
        head's rows [T, K]), which spares the block sums reading x's shape."""
        g, spec = self.g, self.spec
        if self.from_blocks(weight):
            y = self.block_linear(x, weight, name, rank)
            return y if bias is None else g.op("Add", [y, g.init(f"{name}.bias", as_numpy(bias))])
        w = as_numpy(weight)  # [out, in]
        if spec.quantization == "none":
            y = g.op("MatMul", [x, g.init(f"{name}.weight", w.T)])
        elif spec.offsets:
            y = self._offset_linear(x, pack_q4_offsets(w), name, rank)
        else:
            y = self.quantized_matmul(x, w, name)
        if bias is not None:
            y = g.op("Add", [y, g.init(f"{name}.bias", as_numpy(bias))])
        return y

    def _offset_linear(self, x: str, w: OffsetNBitsWeight, name: str, rank: int | None) -> str:
        """x @ W^T for W = scale * (q - 8) + offset per block: a symmetric 4-bit product, plus x
        summed over each block of K (`block_sums`, shared by the linears of one input) times the
        offsets [K / block, N]."""
        g, q = self.g, w.nbits
        y = self.q4_matmul(x, q, name)
        shift = g.op("MatMul", [self.block_sums(x, q.k, q.block_size, rank),
                                g.init(f"{name}.offsets", np.ascontiguousarray(w.offsets.T))])
        return g.op("Add", [y, shift])

    def block_sums(self, x: str, k: int, block: int, rank: int | None = None) -> str:
        """x [.., K] (`rank` dimensions; None: read from x) summed over each block of K (shared by
        the linears of one input): x as [.., K / block, block] times a column of ones. The same bits
        as the MatMul by a 0/1 [K, K / block] matrix it replaces (MLAS sums each output in order
        either way), without reading that matrix every step (8 MiB per [8192, 256] node at the 1B
        shape). Not ReduceSum: ONNX Runtime's CPU ReduceSum sums in an order that depends on x's
        address (docs/onnx.md, "The offsets' block sums")."""
        g = self.g
        sums = self._block_sums.get((x, block))
        if sums is None:
            if rank is None:
                lead = g.op("Shape", [x], end=-1)
                blocks = g.op("Reshape", [x, g.op("Concat", [lead, g.const([k // block, block])], axis=0)])
                back = g.op("Concat", [lead, g.const([k // block])], axis=0)
            else:  # 0: keep that dimension of x (no Shape and Concat per input)
                blocks = g.op("Reshape", [x, g.const([0] * (rank - 1) + [k // block, block])])
                back = g.const([0] * (rank - 1) + [k // block])
            summed = g.op("MatMul", [blocks, g.const([[1.0]] * block, np.float32)])  # [.., K / block, 1]
            sums = self._block_sums[(x, block)] = g.op("Reshape", [summed, back])
        return sums

    def block_linear(self, x: str, weight: QuantWeight, name: str, rank: int | None = None) -> str:
        """x @ W^T over a GGUF's blocks: per format part (stacked along N) its levels and scales
        as they are, plus block sums times its offsets where it has them; parts concatenated."""
        g, outs = self.g, []
        parts = weight.parts
        for i, blocks in enumerate(parts):
            part = block_part(blocks)
            tag = name if len(parts) == 1 else f"{name}.part{i}"
            y, offsets = self.block_matmul(x, part, tag)
            if offsets is not None:
                k, block = part.nbits.k, part.nbits.block_size
                shift = g.op("MatMul", [self.block_sums(x, k, block, rank), g.init(f"{tag}.offsets", offsets.T)])
                y = g.op("Add", [y, shift])
            outs.append(y)
        return outs[0] if len(outs) == 1 else g.op("Concat", outs, axis=-1)

    def embedding(self, ids: str) -> str:
        if self.embed_from_blocks():
            return self.block_embedding(ids)[0]
        return self.g.op("Gather", [self.g.init("embed.weight", as_numpy(self.model.embed)), ids], axis=0)

    def embed_from_blocks(self) -> bool:
        embed = self.model.embed
        return self.from_blocks(embed) and len(embed.formats) == 1

    def block_embedding(self, ids: str) -> tuple[str, BlockPart]:
        """Rows `ids` ([d0, d1]) of a one-format quantised table, de-quantised in the graph as
        `Blocks.dequantize` does ((q - zero) * scale + offset, the same float32 operations, so
        exactly): a gather of MatMulNBits-packed levels (`embed.qweight`, which a tied head's
        MatMulNBits reads too), per-block scales and offsets. Returns the rows and the part."""
        g = self.g
        (part,) = block_parts(self.model.embed, centre=False)  # exact: no int8 activations here
        nb = part.nbits
        levels = g.init("embed.qweight", nb.packed)
        scales = g.init("embed.scales", nb.scales.reshape(nb.n, -1))
        rows = g.op("Gather", [levels, ids], axis=0)  # [d0, d1, blocks, bytes]
        if nb.bits == 4:  # the even element in the low nibble
            low = g.op("BitwiseAnd", [rows, g.const(15, np.uint8)])
            high = g.op("BitShift", [rows, g.const(4, np.uint8)], direction="RIGHT")
            pairs = g.op("Concat", [g.op("Unsqueeze", [low, g.const([-1])]),
                                    g.op("Unsqueeze", [high, g.const([-1])])], axis=-1)
            rows = g.op("Reshape", [pairs, g.const([0, 0, part.blocks, nb.block_size])])
        w = g.op("Cast", [rows], to=TensorProto.FLOAT)
        if part.zero:
            w = g.op("Sub", [w, g.const(float(part.zero), np.float32)])
        per_block = g.op("Unsqueeze", [g.op("Gather", [scales, ids], axis=0), g.const([-1])])
        w = g.op("Mul", [w, per_block])
        if part.offsets is not None:
            offsets = g.init("embed.offsets", part.offsets)
            w = g.op("Add", [w, g.op("Unsqueeze", [g.op("Gather", [offsets, ids], axis=0), g.const([-1])])])
        return g.op("Reshape", [w, g.const([0, 0, nb.k])]), part

    def lm_head(self, rows: str) -> str:
        return self.linear(rows, self.model.lm_head_weight(), None, "lm_head", rank=2)

    def rms_norm(self, x: str, weight: torch.Tensor, name: str, skip: str | None = None) -> tuple[str, str]:
        """RMSNorm of (x + skip); returns (normalised, the sum that is the next residual)."""
        # Gemma's weights are offsets from 1: added here in float32, as its RMSNorm does.
        w = as_numpy(weight)
        w = self.g.init(f"{name}.weight", w + np.float32(self.cfg.norm_offset) if self.cfg.norm_offset else w)
        return self.normalize(x, w, skip)

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

    def site_sizes(self) -> dict[str, tuple[int, int]]:
        cfg = self.cfg
        h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        return {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * inter), "down": (inter, h)}

    def kv_input(self, layer: int, kind: str) -> onnx.ValueInfoProto:
        """Layer `layer`'s key or value store as the graph reads it: the paged cache slab."""
        return helper.make_tensor_value_info(f"cache.{layer}.{kind}", KV_DTYPES[self.spec.kv_dtype],
                                             ["cache_rows", self.cfg.head_dim])

    def inputs(self) -> list[onnx.ValueInfoProto]:
        cfg = self.cfg
        vi = helper.make_tensor_value_info
        ins = self.step_inputs()
        if not self.spec.lora:
            ins = ins[:-2]
        for layer in range(cfg.num_layers if self.spec.lora else 0):
            for site, (fan_in, fan_out) in self.site_sizes().items():
                k = len(lora_sites(cfg)[site])
                ins.append(vi(f"lora.{layer}.{site}.a", TensorProto.FLOAT, [fan_in, f"lora_{site}_columns_x{k}"]))
                ins.append(vi(f"lora.{layer}.{site}.b", TensorProto.FLOAT, [f"lora_{site}_columns_x{k}", fan_out]))
        for layer in range(cfg.num_layers):
            for kind in ("key", "value"):
                ins.append(self.kv_input(layer, kind))
        return ins

    def prepare_shared(self) -> None:
        g, cfg = self.g, self.cfg
        L = cfg.num_layers
        # One set of tables per rotary table of the model (Gemma 3's sliding layers have their own).
        self.prepare_rope()
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

    def kv_outputs(self, kv_out: list[str | None]) -> list[onnx.ValueInfoProto]:
        """This step's keys/values as one `new_kv` output [layers, tokens, 2 * kv_size]."""
        g, cfg, kv_dtype = self.g, self.cfg, self.spec.kv_dtype
        new_kv = g.op("Reshape", [g.op("Concat", kv_out, axis=0), g.const([cfg.num_layers, -1, 2 * cfg.kv_size])])
        if kv_dtype != "float32":
            new_kv = g.op("Cast", [new_kv], to=KV_DTYPES[kv_dtype])
        g.nodes.append(helper.make_node("Identity", [new_kv], ["new_kv"]))
        return [helper.make_tensor_value_info("new_kv", KV_DTYPES[kv_dtype], [cfg.num_layers, "tokens", 2 * cfg.kv_size])]

    def opsets(self) -> list[onnx.OperatorSetIdProto]:
        return [helper.make_opsetid("", OPSET)]

    def properties(self) -> dict[str, str]:
        cfg, spec = self.cfg, self.spec
        return {
            "graph_version": str(GRAPH_VERSION), "flavour": spec.flavour,
            "quantization": spec.quantization, "lora": str(int(spec.lora)),
            "kv_layout": spec.kv_layout,
            "layers": str(cfg.num_layers), "heads": str(cfg.num_heads), "kv_heads": str(cfg.num_kv_heads),
            "group": str(cfg.num_heads // cfg.num_kv_heads), "head_dim": str(cfg.head_dim),
            "vocab": str(cfg.vocab_size),
        }

    # -- the step -----------------------------------------------------------------------------

    def build(self) -> onnx.ModelProto:
        g, cfg, model = self.g, self.cfg, self.model
        self.prepare_shared()
        # Activations are [1, T, h] (flat) or [B, S, h] (rows, "ort").
        x = self.scaled(self.embedding(self.token_ids()), cfg.embedding_multiplier)
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
            qkv = self.lora(self.linear(hn, layer.qkv_weight, layer.qkv_bias, f"{p}.qkv", rank=3), hn, "qkv", i)
            attn, kv_new = self.attention_block(i, layer, qkv)
            kv_out.append(kv_new)
            o = self.lora(self.linear(attn, layer.o_weight, layer.o_bias, f"{p}.o", rank=3), attn, "o", i)
            if post:
                o, _ = self.rms_norm(o, layer.attn_out_norm, f"{p}.attn_out_norm")
            o = self.scaled(o, cfg.residual_multiplier)
            if not pre:
                residual = hn = g.op("Add", [residual, o])
            else:
                hn, residual = self.rms_norm(residual, layer.post_norm, f"{p}.post_norm", o)
            gu = self.lora(self.linear(hn, layer.gate_up_weight, layer.gate_up_bias, f"{p}.gate_up", rank=3), hn, "gate_up", i)
            gate, up = g.op("Split", [gu], n_out=2, axis=-1, num_outputs=2)
            if cfg.activation == "silu":
                act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
            else:  # Gemma's GELU-tanh (ai.onnx Gelu, opset 20+)
                act = g.op("Mul", [g.op("Gelu", [gate], approximate="tanh"), up])
            delta = self.lora(self.linear(act, layer.down_weight, layer.down_bias, f"{p}.down", rank=3), act, "down", i)
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
        outputs += self.kv_outputs(kv_out)
        graph = helper.make_graph(g.nodes, "mace_edge_step", self.inputs(), outputs, g.inits)
        proto = helper.make_model(graph, opset_imports=self.opsets(), ir_version=IR_VERSION,
                                  producer_name="mace-edge", producer_version=str(GRAPH_VERSION))
        helper.set_model_props(proto, self.properties())
        return proto
