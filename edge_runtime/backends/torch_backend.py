"""The reference backend: runs one scheduled batch through our PyTorch forward.

Turns the scheduler's batch into flat token tensors and a paged-attention context, and returns
the logits of the rows that sample a token. Other backends (ONNX Runtime, TensorRT) implement
the same `Backend` protocol.
"""

from __future__ import annotations

import os

import torch

from edge_runtime.backends.base import Backend
from edge_runtime.backends.cuda_graphs import DecodeGraphs
from edge_runtime.kv import attention_kernel
from edge_runtime.kv.cache import KVCache
from edge_runtime.kv.paged_attention import PagedContext, SeqAttention
from edge_runtime.lora.batched import applier_for
from edge_runtime.lora.registry import AdapterRegistry
from edge_runtime.model import gguf_layer
from edge_runtime.model.llama import LlamaModel, LoraApplier
from edge_runtime.sched.scheduler import Batch


class TorchBackend(Backend):
    name = "torch"
    reads_pruned_kv = True  # PagedContext reads each sequence's pruning state and compacted layout
    verifies_drafts = True

    def __init__(self, model: LlamaModel, cache: KVCache, adapters: AdapterRegistry | None = None,
                 row_invariant: bool = False, graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.cache = cache
        self.device = model.device
        self.adapters = adapters
        # `engine.deterministic`: projections in fixed row tiles, attention over at least
        # ATTEND_MIN_ROWS query rows and in KEY_TILE key tiles (edge_runtime.model.llama).
        self.row_invariant = row_invariant
        # `engine.cuda_graphs`: decode-only steps replayed as CUDA graphs (backends.cuda_graphs).
        self.graphs = graphs
        self._gap: tuple[tuple, str | None] | None = None  # fast_path_gap's answer and the switches it read

    def stats(self) -> dict:
        """What the engine's stats show of this backend: its CUDA graphs' counters, if any."""
        return {} if self.graphs is None else {"cuda_graphs": self.graphs.stats()}

    def fast_path_gap(self) -> str | None:
        """Why this model's serving rows are not row-invariant without `engine.deterministic`'s
        tiles, or None where they are: a GGUF read in place on the CPU whose every layer takes the
        fused int8 layer and whose head is an int8 K-quant product (gguf_layer), attending through
        the compiled per-row kernel (prefill rows as decode rows, kv/attention.c), LoRA deltas in
        row tiles. Asked each step, answered again only when a switch it reads (MACE_ATTN_KERNEL, ...)
        changed (~0.1 ms to find out, on the 1B)."""
        key = tuple(os.environ.get(name) for name in (attention_kernel.ENV, *gguf_layer.SWITCHES))
        if self._gap is not None and self._gap[0] == key:
            return self._gap[1]
        if self.device.type != "cpu":
            gap = f"torch on {self.device.type}: the compiled per-row kernels run on the CPU only"
        else:
            gap = (attention_kernel.invariance_gap(self.cache.data, self.model.cfg.num_heads)
                   or gguf_layer.row_invariance_gap(self.model))
        self._gap = (key, gap)
        return gap

    def determinism(self) -> tuple[bool, str]:
        gap = self.fast_path_gap()
        if gap is None:
            return True, ("a GGUF read in place on the CPU: fused int8 row products in every layer and the head, "
                          "each row's attention alone over its own prefix (compiled; a prefill row as a decode row), "
                          "LoRA deltas in row tiles: a row's bits do not depend on its chunk or batch")
        if not self.row_invariant:
            return False, f"engine.deterministic is off and the in-place fast path does not apply ({gap})"
        if self.device.type != "cpu":
            return False, (f"torch on {self.device.type}: the row-invariant path is checked on the CPU "
                           "only; GPU GEMMs may still pick kernels by the batch's shape")
        return True, ("torch on the CPU with engine.deterministic: projections in 16-row tiles, attention over "
                      "at least 4 query rows and 64-key tiles, prefill chunks on the block grid")

    @torch.inference_mode()
    def execute(self, batch: Batch, lora: LoraApplier | None = None) -> torch.Tensor:
        """Logits [rows that sample, vocab] in float32, in batch order. Without an explicit
        `lora`, each item's pinned adapter versions (fleet and user, from the registry, as one
        LoRA of their ranks concatenated) apply to its rows."""
        # Where the fast path is row-invariant it is `engine.deterministic`'s path too (no torch tiles).
        fast = self.fast_path_gap() is None
        if lora is None and self.adapters is not None:
            runs = [(item.seq.request.served, item.num_tokens) for item in batch.items]
            lora = applier_for(runs, self.adapters.served_weights, self.device, row_invariant=fast)
        if self.graphs is not None:
            why = self.graphs.why_eager(batch, lora)
            if why is None:
                try:
                    return self.graphs.run(batch)
                except Exception:  # logged and kept by DecodeGraphs: this and later steps run eagerly
                    why = "capture failed"
            self.graphs.eager[why] += 1
        ids: list[int] = []
        positions: list[int] = []
        seqs: list[SeqAttention] = []
        logit_rows: list[int] = []
        rope = self.model.rope
        for item in batch.items:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed
            # Probe sequences (cost calibration) carry no pruning state.
            seqs.append(SeqAttention(len(ids), n, start + n, seq.block_table, getattr(seq, "kv_pruning", None),
                                     getattr(seq, "kv_layout", None)))
            ids.extend(item.tokens())
            # Rows of the rotary table: LongRoPE picks its factors by the sequence's whole length.
            offset = rope.offset(seq.num_tokens)
            positions.extend(range(start + offset, start + n + offset))
            # A decode row with a draft yields every fed row's logits (edge_runtime.spec).
            logit_rows.extend(range(len(ids) - item.num_logits, len(ids)))
        device = self.device
        ctx = PagedContext(self.cache, seqs, device, lora, self.model.cfg.layer_windows,
                           self.model.cfg.attn_softcap, self.row_invariant and not fast)
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        rows = torch.tensor(logit_rows, dtype=torch.long, device=device)
        logits = self.model(input_ids, pos, ctx, logit_rows=rows)
        return logits.float()
