"""The "standard" flavour of the step: only ai.onnx ops (opset 21, block-wise DequantizeLinear for
weight-only quantisation, attention written out over a flat token batch), the form TensorRT
parses and the reference the "ort" graph is checked against. Activations are [1, tokens, h].
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from edge_runtime.backends.onnx_blocks import BlockPart, signed_levels
from edge_runtime.backends.onnx_spec import local_window
from edge_runtime.backends.onnx_step import StepWriter
from edge_runtime.backends.quantize import (
    BLOCK_SIZE,
    NBitsWeight,
    bits_of,
    nbits_levels,
    quantize_symmetric,
)


class StandardStepWriter(StepWriter):
    # -- weights ----------------------------------------------------------------------------

    def quantized_matmul(self, x: str, w: np.ndarray, name: str) -> str:
        # Symmetric block-wise (TensorRT's weight-only INT4/INT8 takes no zero point).
        n, k = w.shape
        bits = bits_of(self.spec.quantization)
        q, scale = quantize_symmetric(w, bits)  # [N, K/b, b], [N, K/b]
        return self.g.op("MatMul", [x, self._block_dequantized(q.reshape(n, k), scale, bits, name)])

    def q4_matmul(self, x: str, q: NBitsWeight, name: str) -> str:
        # Signed INT4 blocks (q - 8 fits [-8, 7]) for DequantizeLinear.
        signed = (nbits_levels(q).astype(np.int8) - 8).reshape(q.n, q.k)
        return self.g.op("MatMul", [x, self._block_dequantized(signed, q.scales.reshape(q.n, -1), 4, name)])

    def block_matmul(self, x: str, part: BlockPart, name: str) -> tuple[str, np.ndarray | None]:
        nb = part.nbits
        signed, offsets = signed_levels(part)
        w = self._block_dequantized(signed, nb.scales.reshape(nb.n, -1), nb.bits, name, nb.block_size)
        return self.g.op("MatMul", [x, w]), offsets

    def _block_dequantized(self, q: np.ndarray, scale: np.ndarray, bits: int, name: str,
                           block_size: int = BLOCK_SIZE) -> str:
        """Signed levels q [N, K] and scales [N, K / block] as a block-wise DequantizeLinear whose
        output is the weight in MatMul's layout [K, N] (blocks along K, axis 0)."""
        qt = q.T
        tensor = helper.make_tensor(
            f"{name}.qweight", TensorProto.INT4 if bits == 4 else TensorProto.INT8, list(qt.shape),
            qt.reshape(-1).astype(np.int8).tolist() if bits == 4 else qt.tobytes(), raw=bits == 8,
        )
        self.g.add(tensor)
        return self.g.op("DequantizeLinear", [tensor.name, self.g.init(f"{name}.scales", scale.T)], axis=0,
                         block_size=block_size)

    # -- norms, RoPE, attention -------------------------------------------------------------

    def normalize(self, x: str, w: str, skip: str | None) -> tuple[str, str]:
        g, eps = self.g, self.cfg.rms_norm_eps
        total = x if skip is None else g.op("Add", [x, skip])
        ms = g.op("ReduceMean", [g.op("Mul", [total, total]), g.const([-1])], keepdims=1)
        inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [ms, g.const(eps, np.float32)])])])
        return g.op("Mul", [g.op("Mul", [total, inv]), w]), total

    def prepare_rope(self) -> None:
        g = self.g
        self.cos_full, self.sin_full = [], []
        self.position_ids = g.op("Unsqueeze", ["positions", g.const([0])])  # [1, T]
        for t, rope in enumerate(self.model.ropes):
            tag = "rope" if t == 0 else f"rope{t}"
            # [1, T, 1, d]: broadcast over heads, gathered once per step for every layer.
            for name, table in zip(("cos_full", "sin_full"), (t.float().cpu().numpy() for t in rope.tables()), strict=True):
                rows = g.op("Gather", [g.init(f"{tag}.{name}", table), self.position_ids], axis=0)
                getattr(self, name).append(g.op("Unsqueeze", [rows, g.const([2])]))

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

    def token_ids(self) -> str:
        return self.g.op("Unsqueeze", ["input_ids", self.g.const([0])])

    def attention_block(self, i: int, layer: torch.nn.Module, qkv: str) -> tuple[str, str | None]:
        g, cfg = self.g, self.cfg
        q, k, v = g.op("Split", [qkv, g.const([cfg.q_size, cfg.kv_size, cfg.kv_size])], n_out=3, axis=-1)
        q, k = self.qk_norm(q, k, layer, f"layers.{i}")
        if cfg.rope_layers[i]:  # SmolLM3's NoPE layers attend without positions
            table = cfg.layer_rope_table[i]
            q, k = self.rotary(q, cfg.num_heads, table), self.rotary(k, cfg.num_kv_heads, table)
        kv_new = g.op("Concat", [k, v], axis=-1)
        return self.attention(i, q, k, v), kv_new

    def scores(self, q: str, k: str) -> str:
        g, scale = self.g, float(self.cfg.attention_scale)
        kt = g.op("Transpose", [k], perm=[0, 1, 3, 2])
        return self.softcap(g.op("Mul", [g.op("MatMul", [q, kt]), g.const(scale, np.float32)]), self.cfg.attn_softcap)

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

    # -- inputs -----------------------------------------------------------------------------

    def step_inputs(self) -> list[onnx.ValueInfoProto]:
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
