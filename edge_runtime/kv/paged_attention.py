"""Attention over the paged KV cache for one engine iteration.

Built once per iteration from the scheduled sequences, then called by every layer: it writes the
new keys/values into their slots and attends each query to its sequence's cached context.
Decode rows (one query each) are batched into a single padded attention call; prefill chunks
attend one sequence at a time, or, with the compiled kernel (kv/attention.c), every row alone over
its causal prefix as a decode row would. Results do not depend on the batch (see `attend`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from edge_runtime.kv import attention_kernel
from edge_runtime.kv.cache import KVCache
from edge_runtime.kv.compaction import CompactLayout, entry_rows, position_slots, slab_row
from edge_runtime.kv.pruning import DecodePruning, HeadPruning
from edge_runtime.model.llama import (
    KEY_TILE,
    LoraApplier,
    key_tiled_attention,
    layer_window,
    softcap,
    window_mask,
)


@dataclass
class SeqAttention:
    """One sequence's part of the flat batch: rows [q_start, q_start + q_len) are its new tokens,
    whose positions end at ctx_len - 1; `block_table` lists the cache blocks of positions
    0..ctx_len-1 in order. With `pruning`, a decode step attends each KV head's retained
    positions only (edge_runtime.kv.pruning); with `layout`, those entries were compacted
    (edge_runtime.kv.compaction): the table holds them packed, and the new token goes to the
    layout's next slot."""

    q_start: int
    q_len: int
    ctx_len: int
    block_table: list[int]
    pruning: HeadPruning | None = None
    layout: CompactLayout | None = None


class PagedContext:
    """`sliding_window`: keys a query sees, itself included, in every layer, or a tuple per layer
    (`ModelConfig.layer_windows`: Gemma mixes sliding and full layers); each distinct window
    gets its own plan of which cached keys each sequence reads. `softcap`: the attention
    scores' (`ModelConfig.attn_softcap`)."""

    def __init__(
        self,
        cache: KVCache,
        seqs: list[SeqAttention],
        device: torch.device,
        lora: LoraApplier | None = None,
        sliding_window: int | None | tuple[int | None, ...] = None,
        softcap: float | None = None,
        row_invariant: bool = False,
    ) -> None:
        self.cache = cache
        self.lora = lora
        # Each row's projections and attention computed the same way whatever shares the batch
        # (`edge_runtime.model.llama.tiled_linear`; `attend`'s `min_rows`).
        self.row_invariant = row_invariant
        self._min_rows = ATTEND_MIN_ROWS if row_invariant else 2
        self.sliding_window = sliding_window
        self.softcap = softcap
        # The compiled decode attention and KV write (kv/attention.c) where this cache and mode allow,
        # but not on the row-invariant path: there a decode row must keep the bits it has inside a
        # prefill chunk (docs/scheduler.md: a preemption's recompute, a draft's verify rows), and
        # chunks attend through torch's key tiles.
        self.compiled = attention_kernel.usable(cache.data) and not row_invariant
        if any(s.layout is not None and s.q_len != 1 for s in seqs):
            raise ValueError("a compacted sequence only decodes (a recompute starts from a fresh table)")
        slots = {id(s): position_slots(s.layout, s.block_table, cache.block_size) for s in seqs}
        self.slot_mapping = torch.cat([slots[id(s)][s.ctx_len - s.q_len : s.ctx_len] for s in seqs]).to(device)
        windows = set(sliding_window) if isinstance(sliding_window, tuple) else {sliding_window}
        self.plans = {w: _WindowPlan(seqs, slots, device, w, self.compiled) for w in windows}
        # Decode KV pruning (edge_runtime.kv.pruning) runs only where every layer sees its whole
        # context (the engine refuses it with windows), so it masks the one plan there is.
        self.decode_pruning = None
        self.decode_entries = None
        pruned = [s for s in seqs if s.q_len == 1 and s.pruning is not None]
        if pruned:
            plan = self.plans[None]
            rows = [(i, s.ctx_len, s.pruning) for i, s in enumerate(plan.decodes) if s.pruning is not None]
            layers, _, _, kv_heads, _ = cache.data.shape
            self.decode_pruning = DecodePruning(rows, plan.decode_mask, layers, kv_heads)
            if any(s.layout is not None for s in plan.decodes):
                self.decode_entries = _decode_entries(plan, cache.block_size, layers, kv_heads,
                                                      cache.data.shape[2], device)

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_cache, v_cache = self.cache.layer(layer)
        if (self.compiled and attention_kernel.rows_ok(k, k_cache.dtype) and attention_kernel.rows_ok(v, k_cache.dtype)
                and k_cache.is_contiguous()):
            attention_kernel.write_kv(k, v, self.slot_mapping, k_cache, v_cache)
        else:
            k_cache.index_copy_(0, self.slot_mapping, k)
            v_cache.index_copy_(0, self.slot_mapping, v)
        plan = self.plans[layer_window(self.sliding_window, layer)]
        t, heads, d = q.shape
        kv_heads = k.shape[1]
        group = heads // kv_heads
        out = q.new_empty(t, heads * d)
        compiled = self.compiled and attention_kernel.decode_shapes_ok(q, k_cache)
        if compiled and plan.prefill_rows is not None:
            # Every prefill row alone over its causal prefix, as a decode row over the same keys:
            # its bits then follow its own prefix only, not the chunk's extent (issue #31).
            attention_kernel.prefill_attention(q, k_cache, v_cache, *plan.prefill_rows, self.softcap, out,
                                               torch.get_num_threads())
        prefills = () if compiled and plan.prefill_rows is not None else plan.prefills
        for start, n, kv_index, mask in prefills:
            # [n, heads, d] -> [kv_heads, group * n, d]: the query heads sharing a KV head are
            # folded into the rows, so GQA needs no copy of keys or values.
            qh = q[start : start + n].view(n, kv_heads, group, d).permute(1, 2, 0, 3).reshape(kv_heads, group * n, d)
            kh = k_cache.index_select(0, kv_index).transpose(0, 1)  # [kv_heads, ctx, d]
            vh = v_cache.index_select(0, kv_index).transpose(0, 1)
            if mask is None:
                mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            o = attend(qh, kh, vh, mask.repeat(group, 1), self.softcap, self._min_rows, self.row_invariant)
            out[start : start + n] = o.view(kv_heads, group, n, d).permute(2, 0, 1, 3).reshape(n, heads * d)

        if compiled and plan.decode_rows is not None:
            self._decode_compiled(layer, plan, q, k_cache, v_cache, out)
        elif plan.decode_rows is not None:
            threads = torch.get_num_threads()
            if not plan.has_prefills and threads > 1 and q.device.type == "cpu":
                # A decode-only step's attention is a few small GEMMs a layer: on one thread. Split
                # across threads, each call waits on a worker waking (or on the core that the GGUF
                # kernel's pool still spins on after a product): ~0.1 ms a call on a busy 2-core box.
                torch.set_num_threads(1)
                try:
                    return self._decode(layer, plan, q, k_cache, v_cache, out)
                finally:
                    torch.set_num_threads(threads)
            return self._decode(layer, plan, q, k_cache, v_cache, out)
        return out

    def _decode_compiled(self, layer: int, plan: _WindowPlan, q: Tensor, k_cache: Tensor, v_cache: Tensor,
                         out: Tensor) -> None:
        """The decode rows' attention in one compiled call on this thread (kv/attention.c): each
        row computed alone, so its bits do not depend on the rows beside it or their contexts;
        compacted rows read their entries where they lie, pruned positions get exact zero
        weights."""
        b, width = plan.decode_index.shape
        heads, d = q.shape[1:]
        kv_heads = k_cache.shape[1]
        keys, values, entries, shift = k_cache, v_cache, None, 0
        if self.decode_entries is not None:
            keys = values = self.cache.data
            entries, shift = self.decode_entries[layer], self.cache.data.shape[2] * kv_heads
        pruning = self.decode_pruning
        mask = weights = None
        if pruning is not None:
            mask, weights = pruning.masks[layer][:, :, 0], torch.empty(b, heads, width)
        attention_kernel.decode_attention(q, keys, values, plan.decode_index, plan.decode_lens, plan.decode_rows,
                                          self.softcap, out, entries, shift, mask, weights)
        if pruning is not None:
            group = heads // kv_heads
            pruning.observe(layer, out.index_select(0, plan.decode_rows).view(b, kv_heads, group, d),
                            weights.view(b, kv_heads, group, width))

    def _decode(self, layer: int, plan: _WindowPlan, q: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor) -> Tensor:
        """The decode rows' attention (one query row each, in one padded call) into `out`."""
        heads, d = q.shape[1:]
        kv_heads = k_cache.shape[1]
        group = heads // kv_heads
        b = plan.decode_rows.shape[0]
        qd = q.index_select(0, plan.decode_rows).view(b, kv_heads, group, d)
        if self.decode_entries is None:
            # One flat index_select (several times faster than advanced indexing by the
            # [B, width] index on the CPU; the same rows): [B, kv_heads, width, d].
            flat, shape = plan.decode_index.view(-1), (b, -1, kv_heads, d)
            kd = k_cache.index_select(0, flat).view(shape).permute(0, 2, 1, 3)
            vd = v_cache.index_select(0, flat).view(shape).permute(0, 2, 1, 3)
        else:
            # Some rows are compacted: every (row, position, head) gathered from where its
            # entry lies, into the layout and strides above, so every row keeps its bits.
            entries = self.decode_entries[layer]  # [B, width, kv_heads]: slab rows of keys
            slab = self.cache.data.view(-1, d)
            kd = slab[entries].permute(0, 2, 1, 3)
            vd = slab[entries + self.cache.data.shape[2] * kv_heads].permute(0, 2, 1, 3)
        if self.decode_pruning is None:
            o = attend(qd, kd, vd, plan.decode_mask, self.softcap, self._min_rows, self.row_invariant)
        else:
            o = self.decode_pruning.attend(layer, qd, kd, vd)
        out.index_copy_(0, plan.decode_rows, o.reshape(b, heads * d))
        return out


def _decode_entries(plan: _WindowPlan, block_size: int, layers: int, kv_heads: int, num_slots: int,
                    device: torch.device) -> Tensor:
    """[layers, B, width, kv_heads]: the slab row (`compaction.slab_row`) of the key each decode row
    reads for each position and head; a compacted row's where its layout put them (any layer's
    plane), the others' their own layer's slot."""
    lanes = torch.arange(kv_heads, device=device)
    planes = torch.arange(layers, device=device)[:, None, None, None]
    entries = slab_row(plan.decode_index[None, :, :, None], planes, lanes, num_slots, kv_heads)
    for i, s in enumerate(plan.decodes):
        if s.layout is not None:
            rows = entry_rows(s.layout, s.block_table, s.ctx_len, block_size, layers, kv_heads, num_slots)
            entries[:, i, : s.ctx_len] = rows.transpose(1, 2).to(device)
    return entries


class _WindowPlan:
    """Which cached keys each sequence reads under one window (None: its whole context)."""

    def __init__(self, seqs: list[SeqAttention], slots: dict[int, Tensor], device: torch.device,
                 sliding_window: int | None, compiled: bool = False) -> None:
        decodes = [s for s in seqs if s.q_len == 1]
        self.decodes = decodes
        self._window = sliding_window
        # (sequence, position of its first key slot, those slots) per prefill chunk
        self._runs = []
        for s in seqs:
            if s.q_len > 1:
                first = 0 if sliding_window is None else max(0, s.ctx_len - s.q_len - sliding_window + 1)
                self._runs.append((s, first, slots[id(s)][first : s.ctx_len].to(device)))
        # With the compiled kernel: (slots, starts, lens, rows) of `attention_kernel.prefill_attention`,
        # every chunk's key slots in one array, each row reading its own causal (windowed) run of it.
        self.prefill_rows = _prefill_rows(self._runs, sliding_window) if compiled and self._runs else None

        self.decode_rows = None
        if decodes:
            width = max(s.ctx_len for s in decodes)
            index = torch.zeros(len(decodes), width, dtype=torch.long)
            valid = torch.zeros(len(decodes), width, dtype=torch.bool)
            for i, s in enumerate(decodes):
                first = 0 if sliding_window is None else max(0, s.ctx_len - sliding_window)
                n = s.ctx_len - first
                index[i, :n] = slots[id(s)][first : s.ctx_len]
                valid[i, :n] = True
            self.decode_rows = torch.tensor([s.q_start for s in decodes], dtype=torch.long, device=device)
            self.decode_index = index.to(device)
            self.decode_lens = valid.sum(1).to(device)  # each row's key count: its index row's first entries
            # [B, 1, 1, width]: broadcast over kv heads and the folded query heads.
            self.decode_mask = valid.to(device)[:, None, None, :]

    @property
    def has_prefills(self) -> bool:
        return bool(self._runs)

    @functools.cached_property
    def prefills(self) -> list[tuple[int, int, Tensor, Tensor | None]]:
        """(first row, rows, key slots, mask or None: causal over the chunk alone) per prefill chunk,
        for torch's `attend`."""
        out = []
        for s, first, kv_index in self._runs:
            mask = None
            if s.ctx_len != s.q_len or self._window is not None:
                device = kv_index.device
                q_pos = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=device)[:, None]
                k_pos = torch.arange(first, s.ctx_len, device=device)[None, :]
                mask = window_mask(q_pos, k_pos, self._window)
            out.append((s.q_start, s.q_len, kv_index, mask))
        return out


def _prefill_rows(runs: list[tuple[SeqAttention, int, Tensor]], window: int | None) -> tuple[Tensor, ...]:
    """`prefill_attention`'s (slots, starts, lens, rows) for the chunks `runs` ((sequence, position of
    its first key slot, those slots)): the row at position p reads positions [max(0, p + 1 - window), p]
    (all of [0, p] without a window), the keys a decode row at p reads."""
    starts, lens, rows, offset = [], [], [], 0
    for s, first, kv_index in runs:
        ends = torch.arange(s.ctx_len - s.q_len + 1, s.ctx_len + 1)  # each row's position + 1
        row_first = ends.new_zeros(s.q_len) if window is None else (ends - window).clamp(min=0)
        starts.append(offset + row_first - first)
        lens.append(ends - row_first)
        rows.append(torch.arange(s.q_start, s.q_start + s.q_len))
        offset += kv_index.shape[0]
    device = runs[0][2].device
    return (torch.cat([kv for _, _, kv in runs]), *(torch.cat(x).to(device) for x in (starts, lens, rows)))


# The fewest query rows `attend` multiplies at once on the row-invariant path: torch's CPU batched
# GEMM rounds a row differently with 1 or 2 rows than with 3 or more (measured with 64-wide heads
# over 100 to 2,100 keys); 3 or more agree, whatever the key count or zero-weight padding.
ATTEND_MIN_ROWS = 4


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, cap: float | None = None, min_rows: int = 2,
           tiled_keys: bool = False) -> Tensor:
    """softmax(q k^T / sqrt(d)) v with the softmax in fp32; q [..., rows, d], k/v [..., keys, d],
    mask (True = may attend) broadcastable to [..., rows, keys]; the scores soft-capped by `cap`
    (Gemma 2) before the mask.

    Written out rather than through SDPA on purpose: SDPA's blocked kernels round differently
    depending on how many keys (padding included) and queries share a call, so a sequence's
    tokens would change with the batch it ran in. Plain matmuls with at least two rows (see
    `edge_runtime.model.llama.linear`) compute each row the same way in any batch; padded keys
    get exact zero weights, which add nothing to the sums. Fewer than `min_rows` query rows are
    padded to that many (repeats of the first), so a one-token chunk and a lone decode row take
    the kernel the other rows take.

    With `tiled_keys` (the row-invariant path), the keys are padded to a multiple of KEY_TILE
    and the weighted sum goes tile by tile (`key_tiled_attention`): the softmax rounds a row of
    under 16 keys otherwise than the same row padded past 16, and the weighted sum's GEMM splits
    a long reduction by the whole key count, so a decode row's output followed the widest
    context among the decode rows beside it (both measured on torch's CPU float32 kernels).
    """
    if q.is_cuda and cap is None and not tiled_keys:
        # On a GPU one fused kernel (SDPA's memory-efficient one takes a boolean mask) instead
        # of six: a decode step there is bound by its kernel count (issue #33), and its rows'
        # rounding is not claimed to be batch-invariant (TorchBackend.determinism).
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    rows = q.shape[-2]
    if rows < min_rows:
        pad = q[..., :1, :].expand(*q.shape[:-2], min_rows - rows, q.shape[-1])
        q = torch.cat([q, pad], dim=-2)
        if mask.shape[-2] == rows and rows > 1:
            mask = torch.cat([mask, mask[..., :1, :].expand(*mask.shape[:-2], min_rows - rows, mask.shape[-1])], -2)
    pad = -k.shape[-2] % KEY_TILE if tiled_keys else 0
    if pad:  # padded keys are masked out: exact zero weights
        k, v = (torch.cat([x, x.new_zeros(*x.shape[:-2], pad, x.shape[-1])], -2) for x in (k, v))
        mask = torch.cat([mask, mask.new_zeros(*mask.shape[:-1], pad)], -1)
    scores = softcap(torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5), cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = key_tiled_attention(weights, v) if tiled_keys else torch.matmul(weights, v)
    return out[..., :rows, :] if out.shape[-2] != rows else out
