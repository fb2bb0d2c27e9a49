"""The reference backend: runs one scheduled batch through our PyTorch forward.

Turns the scheduler's batch into flat token tensors and a paged-attention context, and returns
the logits of the rows that sample a token. Other backends (ONNX Runtime, TensorRT) implement
the same `Backend` protocol.
"""

from __future__ import annotations

import torch

from edge_runtime.backends.base import Backend
from edge_runtime.backends.cuda_graphs import DecodeGraphs
from edge_runtime.kv.cache import KVCache
from edge_runtime.kv.paged_attention import PagedContext, SeqAttention
from edge_runtime.lora.batched import applier_for
from edge_runtime.lora.registry import AdapterRegistry
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

    def stats(self) -> dict:
        """What the engine's stats show of this backend: its CUDA graphs' counters, if any."""
        return {} if self.graphs is None else {"cuda_graphs": self.graphs.stats()}

    def determinism(self) -> tuple[bool, str]:
        if not self.row_invariant:
            return False, "engine.deterministic is off: a row's rounding follows how many rows share its forward"
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
        if lora is None and self.adapters is not None:
            runs = [(item.seq.request.served, item.num_tokens) for item in batch.items]
            lora = applier_for(runs, self.adapters.served_weights, self.device)
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
                           self.model.cfg.attn_softcap, self.row_invariant)
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        rows = torch.tensor(logit_rows, dtype=torch.long, device=device)
        logits = self.model(input_ids, pos, ctx, logit_rows=rows)
        return logits.float()
