"""Decode steps replayed as CUDA graphs (issue #33): one graph per (padded batch size, padded
context width), captured once over static input buffers, replayed for every decode-only step
that fits one; steps a graph cannot express run eagerly and say why (`stats`).

A decode step of a small model is thousands of small kernels, each ~9 us to launch from Python:
replaying them as one graph removes the launches. The graph's inputs are the rows' token ids,
rotary rows, context lengths and block tables, copied in with one host-to-device transfer; the
slots each row writes and reads are computed inside the graph from those, so nothing in it
depends on the host. Rows padding a batch up to its graph's size attend to a scratch block of
the KV cache (`KVCache.scratch_block`) that no sequence owns.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from edge_runtime.kv.paged_attention import attend
from edge_runtime.model.llama import layer_window

if TYPE_CHECKING:
    from edge_runtime.kv.cache import KVCache
    from edge_runtime.model.llama import LlamaModel, LoraApplier
    from edge_runtime.sched.batch import Batch

log = logging.getLogger(__name__)

# Padded batch sizes with a graph (a step of B rows replays the smallest one >= B).
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
# The narrowest context width a graph attends over; wider ones double up to the engine's maximum.
MIN_WIDTH = 128


def padded_batch(rows: int, max_batch: int) -> int | None:
    """The captured batch size a step of `rows` decode rows replays, None past `max_batch`."""
    for size in BATCH_SIZES:
        if size >= rows:
            return size if size <= max(max_batch, 1) else None
    return None


def padded_width(context: int, block_size: int, max_width: int) -> int:
    """The key width a graph attends over for a longest context of `context` tokens: a power of
    two from MIN_WIDTH, at most `max_width` (itself rounded up to whole blocks)."""
    cap = -(-max_width // block_size) * block_size
    width = MIN_WIDTH
    while width < context and width < cap:
        width *= 2
    return min(width, max(cap, block_size))


class _Inputs:
    """A graph's static input buffers, all int64 in one tensor so one copy fills them."""

    def __init__(self, batch: int, table_width: int, device: torch.device) -> None:
        self.batch = batch
        self.table_width = table_width
        self.flat = torch.zeros(batch * (3 + table_width), dtype=torch.long, device=device)
        self.ids = self.flat[:batch]
        self.positions = self.flat[batch : 2 * batch]
        self.context = self.flat[2 * batch : 3 * batch]
        self.tables = self.flat[3 * batch :].view(batch, table_width)


class _GraphContext:
    """The `ForwardContext` a captured decode forward runs under: every row one query token at
    the end of its context; keys and values written to and read from slots derived in the graph
    from the block tables (no LoRA, no pruning, no compaction: those steps run eagerly)."""

    lora = None
    row_invariant = False

    def __init__(self, cache: KVCache, context: Tensor, table: Tensor, width: int, windows: Any,
                 softcap: float | None) -> None:
        self.cache = cache
        self.sliding_window = windows
        self.softcap = softcap
        block = cache.block_size
        last = context - 1
        self.slot_mapping = table.gather(1, (last // block)[:, None]).squeeze(1) * block + last % block
        distinct = set(windows) if isinstance(windows, tuple) else {windows}
        self.reads = {w: self._reads(table, context, width, block, w) for w in distinct}

    @staticmethod
    def _reads(table: Tensor, context: Tensor, width: int, block: int, window: int | None) -> tuple[Tensor, Tensor]:
        """(slots [B, W], mask [B, 1, 1, W]) of the keys each row reads under `window`: positions
        from the window's first up to the row's last, in order, as the eager plan lists them;
        the rest of the width masked, pointing at slot 0 as the eager plan's padding does."""
        first = torch.zeros_like(context) if window is None else (context - window).clamp(min=0)
        span = min(width, window) if window is not None else width
        pos = first[:, None] + torch.arange(span, device=context.device)[None, :]
        valid = pos < context[:, None]
        pos = torch.where(valid, pos, torch.zeros_like(pos))
        blocks = table.gather(1, (pos // block).clamp(max=table.shape[1] - 1))
        slots = torch.where(valid, blocks * block + pos % block, torch.zeros_like(pos))
        return slots, valid[:, None, None, :]

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_cache, v_cache = self.cache.layer(layer)
        k_cache.index_copy_(0, self.slot_mapping, k)
        v_cache.index_copy_(0, self.slot_mapping, v)
        slots, mask = self.reads[layer_window(self.sliding_window, layer)]
        b, heads, d = q.shape
        kv_heads = k.shape[1]
        qd = q.view(b, kv_heads, heads // kv_heads, d)
        kd = k_cache[slots].permute(0, 2, 1, 3)  # [B, kv_heads, width, d]
        vd = v_cache[slots].permute(0, 2, 1, 3)
        return attend(qd, kd, vd, mask, self.softcap).reshape(b, heads * d)


def decode_forward(model: LlamaModel, cache: KVCache, ids: Tensor, positions: Tensor, context: Tensor,
                   table: Tensor, width: int) -> Tensor:
    """Logits [B, vocab] in float32 of one decode token per row: what a graph captures."""
    cfg = model.cfg
    ctx = _GraphContext(cache, context, table, width, cfg.layer_windows, cfg.attn_softcap)
    return model(ids, positions, ctx).float()


class _Graph:
    """One captured step. Off CUDA (tests) `graph` is None and `replay` runs the same forward
    over the same static buffers eagerly."""

    def __init__(self, inputs: _Inputs, width: int, forward: Any, graph: Any = None,
                 logits: Tensor | None = None) -> None:
        self.inputs = inputs
        self.width = width
        self.forward = forward
        self.graph = graph
        self.logits = logits

    def replay(self) -> Tensor:
        if self.graph is None:
            return self.forward()
        self.graph.replay()
        return self.logits


class DecodeGraphs:
    """Captures and replays decode-only steps of `model` over `cache` (CUDA only). `max_batch`:
    the most decode rows a step may carry (`engine.max_num_seqs`); `max_context`: the longest
    context, which bounds the widest graph."""

    def __init__(self, model: LlamaModel, cache: KVCache, max_batch: int, max_context: int,
                 compile_step: bool = False) -> None:
        self.model = model
        # `engine.cuda_graphs_compile`: the step's forward compiled by torch.compile (its
        # element-wise kernels fused by Inductor) before it is captured; once, for every shape.
        self.step = decode_forward
        if compile_step:
            self.step = torch.compile(decode_forward, dynamic=True)
        self.cache = cache
        self.device = model.device
        self.max_batch = max_batch
        self.max_context = max_context
        self.max_width = padded_width(max_context, cache.block_size, max_context)  # the widest graph's keys
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self.replayed = 0
        self.eager: Counter[str] = Counter()
        self.capture_s = 0.0
        self.broken: str | None = None  # why capturing failed once: every later step runs eagerly

    def why_eager(self, batch: Batch, lora: LoraApplier | None) -> str | None:
        """Why this step cannot replay a graph (None: it can)."""
        if self.broken is not None:
            return "capture failed"
        if lora is not None:
            return "LoRA rows"
        if not batch.items or padded_batch(len(batch.items), self.max_batch) is None:
            return "batch size"
        for item in batch.items:
            seq = item.seq
            if item.num_tokens != 1 or not item.samples or item.draft:
                return "prefill or draft rows"
            if getattr(seq, "kv_pruning", None) is not None or getattr(seq, "kv_layout", None) is not None:
                return "pruned or compacted KV"
            if seq.num_computed + 1 > self.max_width:
                return "context wider than the widest graph"
        return None

    def run(self, batch: Batch) -> Tensor:
        """Logits [rows, vocab] in float32 of a decode-only step (`why_eager` said None). The
        tensor is the graph's output buffer: valid until the next replay."""
        rows = len(batch.items)
        block = self.cache.block_size
        context = max(item.seq.num_computed + 1 for item in batch.items)
        key = (padded_batch(rows, self.max_batch), padded_width(context, block, self.max_context))
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.capture(*key)
        inputs = graph.inputs
        rope = self.model.rope
        tw = inputs.table_width
        ids, positions, lengths, tables = [], [], [], []
        for item in batch.items:
            seq = item.seq
            start = seq.num_computed
            ids.append(seq.token_ids[start])
            positions.append(start + rope.offset(seq.num_tokens))
            lengths.append(start + 1)
            table = seq.block_table[:tw]
            tables.extend(table)
            tables.extend([table[-1]] * (tw - len(table)))
        self._pad(ids, positions, lengths, tables, inputs.batch - rows, tw)
        inputs.flat.copy_(torch.tensor(ids + positions + lengths + tables, dtype=torch.long), non_blocking=False)
        logits = graph.replay()
        self.replayed += 1
        return logits[:rows]

    def _pad(self, ids: list[int], positions: list[int], lengths: list[int], tables: list[int], n: int,
             tw: int) -> None:
        """Rows that pad a step to its graph's size: one token at position 0 in the scratch block."""
        ids.extend([0] * n)
        positions.extend([0] * n)
        lengths.extend([1] * n)
        tables.extend([self.cache.scratch_block] * (n * tw))

    def capture(self, batch: int, width: int) -> _Graph:
        """The graph of `batch` rows over `width` keys, captured now (its warm-up runs write only
        the scratch block)."""
        started = time.perf_counter()
        block = self.cache.block_size
        inputs = _Inputs(batch, width // block, self.device)
        ids, positions, lengths, tables = [], [], [], []
        self._pad(ids, positions, lengths, tables, batch, inputs.table_width)
        inputs.flat.copy_(torch.tensor(ids + positions + lengths + tables, dtype=torch.long))

        def forward() -> Tensor:
            return self.step(self.model, self.cache, inputs.ids, inputs.positions, inputs.context, inputs.tables,
                             width)

        if self.device.type != "cuda":
            captured = _Graph(inputs, width, forward)
            self.graphs[(batch, width)] = captured
            return captured
        try:
            with torch.inference_mode():
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):  # kernels compiled and handles made before capture
                        forward()
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    logits = forward()
        except Exception as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            log.warning("capturing a decode graph (batch %d, width %d) failed; decode runs eagerly: %s",
                        batch, width, self.broken)
            raise
        captured = _Graph(inputs, width, forward, graph, logits)
        self.graphs[(batch, width)] = captured
        spent = time.perf_counter() - started
        self.capture_s += spent
        log.info("captured the decode graph of batch %d over %d keys in %.2f s", batch, width, spent)
        return captured

    def warm(self, max_rows: int | None = None) -> None:
        """Capture every batch size up to `max_rows` (default `max_batch`) at the narrowest width,
        as at start-up, so a short request's first steps do not wait on a capture."""
        width = padded_width(1, self.cache.block_size, self.max_context)
        for size in BATCH_SIZES:
            if size > (max_rows or self.max_batch) or self.broken is not None:
                break
            if (size, width) not in self.graphs:
                try:
                    self.capture(size, width)
                except Exception:
                    break

    def stats(self) -> dict[str, Any]:
        return {"replayed": self.replayed, "eager": dict(self.eager), "captured": len(self.graphs),
                "capture_s": round(self.capture_s, 3), "broken": self.broken}
