"""The "ort" flavour of the step: ONNX Runtime's fused contrib ops (GroupQueryAttention over the
gathered paged context or a dense per-row buffer, SkipSimplifiedLayerNormalization, MatMulNBits,
GatherBlockQuantized for a tied quantised table). Every node costs microseconds of dispatch on a
small CPU, and this cuts ~28 nodes per layer to ~13. Activations are [rows, row tokens, h].
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from edge_runtime.backends.onnx_blocks import BlockPart, centred
from edge_runtime.backends.onnx_spec import rope_by_row
from edge_runtime.backends.onnx_step import StepWriter, as_numpy
from edge_runtime.backends.quantize import NBitsWeight, bits_of, pack_nbits


class OrtStepWriter(StepWriter):
    @property
    def dense(self) -> bool:
        return self.spec.kv_layout == "dense"

    # -- weights ----------------------------------------------------------------------------

    def quantized_matmul(self, x: str, w: np.ndarray, name: str) -> str:
        g, spec = self.g, self.spec
        n, k = w.shape
        bits = bits_of(spec.quantization)
        # 8-bit blocks are symmetric (Q8_0's grid); 4-bit ones min/max with zero points.
        q = pack_nbits(w, bits, symmetric=spec.symmetric or bits == 8)
        ins = [x, g.init(f"{name}.qweight", q.packed), g.init(f"{name}.scales", q.scales)]
        if q.zero_points is not None:
            ins.append(g.init(f"{name}.zero_points", q.zero_points))
        return g.op("MatMulNBits", ins, domain="com.microsoft", K=k, N=n, bits=q.bits, block_size=q.block_size,
                    accuracy_level=spec.accuracy_level)

    def q4_matmul(self, x: str, q: NBitsWeight, name: str) -> str:
        g = self.g
        return g.op("MatMulNBits", [x, g.init(f"{name}.qweight", q.packed), g.init(f"{name}.scales", q.scales)],
                    domain="com.microsoft", K=q.k, N=q.n, bits=4, block_size=q.block_size,
                    accuracy_level=self.spec.accuracy_level)

    def block_matmul(self, x: str, part: BlockPart, name: str) -> tuple[str, np.ndarray | None]:
        """MatMulNBits over the part's levels and scales as they are, with its zero points where
        the op's default (2^(bits-1)) is not its zero."""
        g, nb = self.g, part.nbits
        ins = [x, g.init(f"{name}.qweight", nb.packed), g.init(f"{name}.scales", nb.scales)]
        if nb.zero_points is not None:
            ins.append(g.init(f"{name}.zero_points", nb.zero_points))
        y = g.op("MatMulNBits", ins, domain="com.microsoft", K=nb.k, N=nb.n, bits=nb.bits,
                 block_size=nb.block_size, accuracy_level=self.spec.accuracy_level)
        return y, part.offsets

    def _tied_quantized(self) -> bool:
        return self.spec.quantization != "none" and self.model.lm_head is None

    def embedding(self, ids: str) -> str:
        """Token embeddings. Tied and quantised, the table is stored once as 8-bit blocks
        (symmetric, block 32: the grid of llama.cpp's Q8_0, which is what Q4_1 GGUFs keep for
        this tensor) and serves both GatherBlockQuantized here and the LM head's MatMulNBits:
        28 MB instead of 113 MB for the default model."""
        if self.embed_from_blocks():
            rows, part = self.block_embedding(ids)
            if self.model.lm_head is None:  # the head's MatMulNBits reads the same levels and scales
                self.tied_blocks = self._tied_block_head(part)
            return rows
        if not self._tied_quantized():
            return super().embedding(ids)
        g = self.g
        # 8-bit: symmetric (Q8_0's grid, exact for a Q4_1 GGUF's table). 4-bit: min/max blocks
        # with zero points unless the format is symmetric throughout.
        symmetric = self.spec.head_bits == 8 or self.spec.symmetric
        q = pack_nbits(as_numpy(self.model.embed), self.spec.head_bits, symmetric=symmetric)
        packed = g.init("embed.qweight", q.packed.reshape(q.n, q.k * q.bits // 8))
        scales = g.init("embed.scales", q.scales.reshape(q.n, -1))
        zeros = None if q.zero_points is None else g.init("embed.zero_points", q.zero_points.reshape(q.n, -1))
        self.tied_head = (q, packed, scales, zeros)
        return g.op("GatherBlockQuantized", [packed, ids, scales] + ([zeros] if zeros else []),
                    domain="com.microsoft", bits=q.bits, block_size=q.block_size, gather_axis=0, quantize_axis=1)

    def _tied_block_head(self, part: BlockPart) -> tuple:
        """What the head needs of a tied table written from its blocks, written now (zero points,
        offsets in the block-sum product's layout) so the table's arrays need not be kept."""
        part = centred(part)
        g, nb = self.g, part.nbits
        zeros = None if nb.zero_points is None else g.init("lm_head.zero_points", nb.zero_points)
        offsets = None if part.offsets is None else g.init("lm_head.offsets", part.offsets.T)
        return nb.k, nb.n, nb.bits, nb.block_size, zeros, offsets

    def lm_head(self, rows: str) -> str:
        if self.embed_from_blocks() and self.model.lm_head is None:
            k, n, bits, block, zeros, offsets = self.tied_blocks
            g = self.g
            ins = [rows, "embed.qweight", "embed.scales"] + ([zeros] if zeros else [])
            y = g.op("MatMulNBits", ins, domain="com.microsoft", K=k, N=n, bits=bits, block_size=block,
                     accuracy_level=self.spec.accuracy_level)
            if offsets is None:
                return y
            return g.op("Add", [y, g.op("MatMul", [self.block_sums(rows, k, block, rank=2), offsets])])
        if not self._tied_quantized():
            return super().lm_head(rows)
        q, packed, scales, zeros = self.tied_head
        blob = self.g.op("Reshape", [packed, self.g.const([q.n, q.k // q.block_size, q.block_size * q.bits // 8])])
        ins = [rows, blob, scales]
        if zeros:
            # MatMulNBits takes the same packed zero points, flat.
            ins.append(self.g.op("Reshape", [zeros, self.g.const([-1])]))
        return self.g.op("MatMulNBits", ins, domain="com.microsoft", K=q.k, N=q.n, bits=q.bits,
                         block_size=q.block_size, accuracy_level=self.spec.accuracy_level)

    # -- norms, RoPE, attention -------------------------------------------------------------

    def normalize(self, x: str, w: str, skip: str | None) -> tuple[str, str]:
        g, eps = self.g, self.cfg.rms_norm_eps
        if skip is None:
            return g.op("SimplifiedLayerNormalization", [x, w], epsilon=eps, axis=-1, stash_type=1), x
        out, _, _, total = g.op("SkipSimplifiedLayerNormalization", [x, skip, w], n_out=4,
                                domain="com.microsoft", epsilon=eps)
        return out, total

    def prepare_rope(self) -> None:
        g = self.g
        self.cos_half, self.sin_half = [], []
        rows = self.spec.rope_positions or None  # the engine's context, not every position the model has
        for t, rope in enumerate(self.model.ropes):
            tag = "rope" if t == 0 else f"rope{t}"
            self.cos_half.append(g.init(f"{tag}.cos_half", rope.cos_half.float().cpu().numpy()[:rows]))
            self.sin_half.append(g.init(f"{tag}.sin_half", rope.sin_half.float().cpu().numpy()[:rows]))

    def rotary_embedding(self, x: str, heads: int, table: int = 0) -> str:
        """RoPE of x [B, S, heads * d] outside GroupQueryAttention: ONNX Runtime's
        RotaryEmbedding at the `positions` input's table rows (`rope_by_row`)."""
        cfg = self.cfg
        attrs = {"rotary_embedding_dim": cfg.rotary_dim} if cfg.rotary_dim < cfg.head_dim else {}
        caches = [self.cos_half[table], self.sin_half[table]]
        return self.g.op("RotaryEmbedding", [x, "positions", *caches], domain="com.microsoft",
                         interleaved=0, num_heads=heads, **attrs)

    def token_ids(self) -> str:
        return "input_ids"

    def attention_block(self, i: int, layer: torch.nn.Module, qkv: str) -> tuple[str, str | None]:
        """qkv [B, S, (H + 2 KVH) d] -> (attention [B, S, H d], this step's K|V [B*S, 2 KVH, d];
        None in the dense layout, whose buffer already holds them). GroupQueryAttention applies
        RoPE at each row's positions (from seqlens_k), appends the new keys to the gathered past
        and attends causally; the new K/V are read back from its present outputs so our cache
        can store them. With q/k norms (applied before RoPE, so before the node), or RoPE turned
        outside it (`rope_by_row`), q, k and v go in as three inputs instead of the packed one."""
        g, cfg = self.g, self.cfg
        qkv_inputs = [qkv, "", ""]
        by_row = rope_by_row(cfg)
        if cfg.qk_norm is not None or by_row:
            q, k, v = g.op("Split", [qkv, g.const([cfg.q_size, cfg.kv_size, cfg.kv_size])], n_out=3, axis=-1)
            q, k = self.qk_norm(q, k, layer, f"layers.{i}")
            if by_row and cfg.rope_layers[i]:
                table = cfg.layer_rope_table[i]
                q, k = self.rotary_embedding(q, cfg.num_heads, table), self.rotary_embedding(k, cfg.num_kv_heads, table)
            qkv_inputs = [q, k, v]

        def past(kind: str) -> str:
            if self.dense:
                return f"past.{i}.{kind}"  # [B, KVH, capacity, d], this row's own buffer
            rows = g.op("Gather", [f"cache.{i}.{kind}", "kv_index"], axis=0)  # [B, KVH, P, d]
            return rows if self.spec.kv_dtype == "float32" else g.op("Cast", [rows], to=TensorProto.FLOAT)

        window = -1
        if cfg.layer_windows[i] is not None:  # this layer's window (Gemma mixes windowed and full layers)
            # transformers' window counts the query's own key; this build's attribute may not.
            counts_current = self.spec.gqa_window_counts_current
            if counts_current is None:
                raise ValueError("a sliding-window 'ort' graph needs GraphSpec.gqa_window_counts_current "
                                 "(with_gqa_window probes it)")
            window = cfg.layer_windows[i] if counts_current else cfg.layer_windows[i] - 1
        rope = cfg.rope_layers[i] and not by_row
        inputs = [*qkv_inputs, past("key"), past("value"), "seqlens_k", "total_sequence_length"]
        if rope:
            table = cfg.layer_rope_table[i]
            inputs += [self.cos_half[table], self.sin_half[table]]
        attrs = dict(domain="com.microsoft", num_heads=cfg.num_heads, kv_num_heads=cfg.num_kv_heads,
                     scale=float(cfg.attention_scale), do_rotary=int(rope), rotary_interleaved=0,
                     local_window_size=window)
        if cfg.attn_softcap is not None:  # Gemma 2: tanh(s / cap) * cap on the scaled scores
            attrs["softcap"] = float(cfg.attn_softcap)
        if self.dense:
            # present.* are graph outputs bound to the same memory as past.*: ONNX Runtime then
            # shares the buffer and writes only this step's keys/values, at each row's position.
            return g.node("GroupQueryAttention", inputs, [f"present.{i}.key", f"present.{i}.value"], **attrs), None
        attn, present_k, present_v = g.op("GroupQueryAttention", inputs, n_out=3, **attrs)
        new_k = g.op("GatherND", [present_k, "new_kv_index"])  # [B*S, KVH, d]
        new_v = g.op("GatherND", [present_v, "new_kv_index"])
        return attn, g.op("Concat", [new_k, new_v], axis=1)

    # -- inputs and outputs -----------------------------------------------------------------

    def step_inputs(self) -> list[onnx.ValueInfoProto]:
        cfg = self.cfg
        i64 = TensorProto.INT64
        vi = helper.make_tensor_value_info
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
        return ins

    def dense_shape(self) -> list:
        return ["rows", self.cfg.num_kv_heads, "kv_capacity", self.cfg.head_dim]

    def kv_input(self, layer: int, kind: str) -> onnx.ValueInfoProto:
        if not self.dense:
            return super().kv_input(layer, kind)
        return helper.make_tensor_value_info(f"past.{layer}.{kind}", TensorProto.FLOAT, self.dense_shape())

    def kv_outputs(self, kv_out: list[str | None]) -> list[onnx.ValueInfoProto]:
        if not self.dense:
            return super().kv_outputs(kv_out)
        return [helper.make_tensor_value_info(f"present.{layer}.{kind}", TensorProto.FLOAT, self.dense_shape())
                for layer in range(self.cfg.num_layers) for kind in ("key", "value")]

    def opsets(self) -> list[onnx.OperatorSetIdProto]:
        return [*super().opsets(), helper.make_opsetid("com.microsoft", 1)]
