"""Turns the scheduler's batch into the index tensors of the exported step graph.

Pure numpy: which cache rows each sequence attends to, where this step's new keys land, the
additive mask, and which rows yield logits. Shared by the ONNX Runtime and TensorRT backends;
knows nothing about sessions or adapters' weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MASKED = float(np.finfo(np.float32).min)  # exp() of it is exactly 0, like -inf, but never NaN


@dataclass
class StepItem:
    """One sequence's part of a step: `tokens` are fed at positions start, start+1, ..."""

    tokens: list[int]
    start: int
    block_table: list[int]
    samples: bool
    lora_slot: int = -1  # index into the step's stacked adapters; -1 = base model
    rope_offset: int = 0  # added to positions for rows of the rotary table (`RotaryTable.offset`)
    num_logits: int = 1  # trailing rows that yield logits when it samples (a draft's rows: edge_runtime.spec)
    # Trailing rows that only repeat the last token so that GroupQueryAttention gets two query rows
    # (`query_pad`): they yield no logits and their keys/values are not kept.
    pad: int = 0


def query_pad(item: StepItem) -> StepItem:
    """`item` (one token) fed as two query rows: the token again at the next position, whose
    key/value lands past the context and is dropped. ONNX Runtime's CPU GroupQueryAttention
    forms probabilities x V with a matrix-vector kernel for one query row and a matrix kernel for
    two or more, which round differently; with this, a decode row rounds as the same position
    in a prefill or verify chunk (#31, docs/onnx.md "Row invariance"). The kernel takes two
    query rows with a past only in a run of one sequence, so such an item runs alone."""
    return StepItem([*item.tokens, item.tokens[-1]], item.start, item.block_table, item.samples, item.lora_slot,
                    item.rope_offset, item.num_logits, item.pad + 1)


@dataclass
class StepPlan:
    inputs: dict[str, np.ndarray]
    slot_mapping: np.ndarray  # [T] cache slot of each new token (for writing new_kv back)
    num_tokens: int  # T, the rows of new_kv
    real_tokens: int  # leading rows that belong to the batch (the rest duplicate a lone row)
    sampling_items: list[int] = field(default_factory=list)  # item index of each logits row
    real_rows: np.ndarray | None = None  # rows of new_kv that are real tokens (None: the first real_tokens)
    present: int = 0  # GroupQueryAttention's present length (the "ort" graph)
    real_positions: np.ndarray | None = None  # position of each real row (the dense layout)


def pad_lone_row(steps: list[StepItem], table_rows: int) -> list[StepItem]:
    """`steps` with a lone one-token item fed as two query rows (`query_pad`), where the rotary
    table (`table_rows` rows) has a row for the copy's position: a context's very last position
    has none, and runs as one query row."""
    if len(steps) != 1 or len(steps[0].tokens) != 1 or steps[0].start + steps[0].rope_offset + 1 >= table_rows:
        return steps
    return [query_pad(steps[0])]


def sampling_rows(items: list[StepItem]) -> list[tuple[int, int]]:
    """(item index, rows back from its last row, padding included) of each logits row, in
    output order: one per sampling item, `num_logits` for one whose rows carry a draft."""
    return [(i, it.num_logits + it.pad - j) for i, it in enumerate(items) if it.samples for j in range(it.num_logits)]


def place_logits(out: list, indices: list[int], items: list, logits) -> None:
    """Put each sampling item's logits rows ([num_logits, vocab] slices of one run's `logits`,
    in `indices` order) at `out[item index]`."""
    sampling = [i for i in indices if items[i].samples]
    for i, part in zip(sampling, logits.split([items[i].num_logits for i in sampling]), strict=True):
        out[i] = part


def split_groups(q_lens: list[int], max_waste: float = 2.0) -> list[list[int]]:
    """Item indices per graph run: all decode rows together, prefill chunks grouped so the padded
    query grid stays within `max_waste` x their real tokens (a mixed batch padded to its longest
    chunk would spend most of its attention on padding)."""
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    prefills = sorted((i for i, n in enumerate(q_lens) if n > 1), key=lambda i: -q_lens[i])
    groups: list[list[int]] = [decodes] if decodes else []
    current: list[int] = []
    for i in prefills:
        longest = q_lens[current[0]] if current else q_lens[i]
        if current and longest * (len(current) + 1) > max_waste * (sum(q_lens[j] for j in current) + q_lens[i]):
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def plan_step(
    items: list[StepItem],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    sliding_window: int | None | tuple[int | None, ...] = None,
    pad_single_row: bool = True,
) -> StepPlan:
    """Index tensors for one graph run over `items` (see docs/onnx.md for each input).

    `sliding_window`: the keys a query sees (itself included) in every layer, or a tuple per
    layer (`ModelConfig.layer_windows`). Where windowed and full layers mix (Gemma), the keys
    gathered are every sequence's whole context and `attn_bias_local` masks the window for the
    windowed layers."""
    local_window = None
    if isinstance(sliding_window, tuple):
        windows = set(sliding_window)
        if len(windows) > 2 or (len(windows) == 2 and None not in windows):
            raise ValueError(f"layer windows {sorted(windows, key=str)}: one window and full attention at most")
        local_window = next((w for w in windows if w is not None), None) if len(windows) == 2 else None
        sliding_window = None if len(windows) == 2 else windows.pop()
    real_tokens = sum(len(it.tokens) for it in items)
    if pad_single_row and real_tokens == 1:
        # A lone row would take the matrix-vector kernels, whose rounding differs from the
        # matrix paths a batch takes; a duplicate keeps greedy output batch-invariant.
        items = [items[0], StepItem(items[0].tokens, items[0].start, items[0].block_table, False, items[0].lora_slot,
                                    items[0].rope_offset)]
    group = num_heads // num_kv_heads
    q_lens = np.array([len(it.tokens) for it in items])
    starts = np.array([it.start for it in items])
    ctx = starts + q_lens
    if sliding_window is None:
        first = np.zeros_like(starts)
    else:
        first = np.maximum(0, starts - sliding_window + 1)
    b, s, w = len(items), int(q_lens.max()), int((ctx - first).max())
    t = int(q_lens.sum())
    row0 = np.concatenate([[0], np.cumsum(q_lens)[:-1]])

    # Cache slot of key position first+j of each sequence (0 where past its context).
    slots = np.zeros((b, w), np.int64)
    for i, it in enumerate(items):
        pos = np.arange(first[i], ctx[i])
        table = np.asarray(it.block_table, np.int64)
        slots[i, : len(pos)] = table[pos // block_size] * block_size + pos % block_size
    heads_kv = np.arange(num_kv_heads)
    kv_index = slots[:, None, :] * num_kv_heads + heads_kv[None, :, None]  # [B, KVH, W]

    # Query grid [B, G, S]: chunk index s of sequence b (padding repeats its last token).
    s_idx = np.minimum(np.arange(s)[None, :], q_lens[:, None] - 1)  # [B, S]
    tok = row0[:, None] + s_idx  # flat token row
    qpos = starts[:, None] + s_idx  # [B, S]
    gi = np.arange(group)
    heads_q = heads_kv[None, :, None, None] * group + gi[None, None, :, None]  # [1, KVH, G, 1]
    q_index = (tok[:, None, None, :] * num_heads + heads_q).reshape(b, num_kv_heads, group * s)

    key_pos = first[:, None] + np.arange(w)[None, :]  # [B, W]
    allowed = key_pos[:, None, :] <= qpos[:, :, None]  # [B, S, W]
    if sliding_window is not None:
        allowed &= key_pos[:, None, :] > qpos[:, :, None] - sliding_window
    bias = np.where(allowed, 0.0, MASKED).astype(np.float32)
    attn_bias = np.broadcast_to(bias[:, None], (b, group, s, w)).reshape(b, 1, group * s, w)
    local_bias = None
    if local_window is not None:
        allowed &= key_pos[:, None, :] > qpos[:, :, None] - local_window
        bias = np.where(allowed, 0.0, MASKED).astype(np.float32)
        local_bias = np.broadcast_to(bias[:, None], (b, group, s, w)).reshape(b, 1, group * s, w)

    seq_of = np.repeat(np.arange(b), q_lens)  # [T]
    chunk_of = np.arange(t) - row0[seq_of]
    pos_of = starts[seq_of] + chunk_of
    new_kv_index = np.stack(
        [np.repeat(seq_of, num_kv_heads), np.tile(heads_kv, t), np.repeat(pos_of - first[seq_of], num_kv_heads)],
        axis=1,
    )
    heads_all = np.arange(num_heads)
    h_kv, g_in = heads_all // group, heads_all % group
    out_index = ((seq_of[:, None] * num_kv_heads + h_kv[None, :]) * group + g_in[None, :]) * s + chunk_of[:, None]

    sampling = sampling_rows(items)
    logit_rows = np.array([row0[i] + q_lens[i] - back for i, back in sampling], np.int64)
    sampling = [i for i, _ in sampling]
    slot_mapping = np.concatenate([
        slots[i, starts[i] - first[i] : ctx[i] - first[i]] for i in range(b)
    ])
    lora_index = np.repeat(np.array([it.lora_slot for it in items], np.int64), q_lens)
    inputs = {
        "input_ids": np.array([tok_id for it in items for tok_id in it.tokens], np.int64),
        "positions": (pos_of + np.array([it.rope_offset for it in items])[seq_of]).astype(np.int64),
        "q_index": np.ascontiguousarray(q_index, np.int64),
        "kv_index": np.ascontiguousarray(kv_index, np.int64),
        "new_kv_index": np.ascontiguousarray(new_kv_index, np.int64),
        "attn_bias": np.ascontiguousarray(attn_bias),
        "out_index": np.ascontiguousarray(out_index, np.int64),
        "logit_rows": logit_rows,
        "lora_index": lora_index,
    }
    if local_bias is not None:
        inputs["attn_bias_local"] = np.ascontiguousarray(local_bias)
    return StepPlan(inputs, slot_mapping.astype(np.int64), t, real_tokens, sampling)


def split_groups_gqa(q_lens: list[int], starts: list[int], max_waste: float = 2.0,
                     single_alone: bool = False) -> list[list[int]]:
    """Groups for the GroupQueryAttention graph, whose rows must share one query length unless
    none has a past: decode rows together (`single_alone`: each alone, for `query_pad`), first
    chunks of prompts grouped (padded to the longest within `max_waste`), and each continuation
    chunk alone."""
    firsts = [i for i, n in enumerate(q_lens) if n > 1 and starts[i] == 0]
    singles = [i for i, n in enumerate(q_lens) if n == 1]
    groups = [[i] for i in singles] if single_alone else [singles]
    groups += [[firsts[j] for j in g] for g in split_groups([q_lens[i] for i in firsts], max_waste)]
    groups += [[i] for i, n in enumerate(q_lens) if n > 1 and starts[i] > 0]
    return [g for g in groups if g]


def plan_gqa_step(
    items: list[StepItem], block_size: int, num_kv_heads: int, pad_single_row: bool = True, rope_rows: bool = False
) -> StepPlan:
    """Inputs of the "ort" graph: rows [B, S] (shorter first chunks padded with their last
    token), each row's past slots for ONNX Runtime's GroupQueryAttention (see docs/onnx.md);
    with `rope_rows`, each token's rotary table row (`positions`, a `rope_by_row` graph's)."""
    real_tokens = sum(len(it.tokens) - it.pad for it in items)
    if pad_single_row and real_tokens == 1 and not items[0].pad:
        items = [items[0], StepItem(items[0].tokens, items[0].start, items[0].block_table, False, items[0].lora_slot,
                                    items[0].rope_offset)]
    b = len(items)
    q_lens = np.array([len(it.tokens) for it in items])
    real_lens = q_lens - np.array([it.pad for it in items])
    starts = np.array([it.start for it in items])
    s = int(q_lens.max())
    if s > 1 and b > 1 and starts.any():
        raise ValueError("rows with a past must be run one at a time when they feed several tokens")
    ctx = starts + q_lens
    total = int(ctx.max())
    # The past buffer is as long as the longest context ("static cache": ONNX Runtime then
    # keeps each row's seqlens_k + 1 - S past entries and writes the new ones after them).
    past = present = total

    # Every row's block table padded into one array, so slots come from one vectorised lookup
    # (this runs once per decode step: per-row Python here costs tokens/s).
    width = max(len(it.block_table) for it in items)
    tables = np.zeros((b, width), np.int64)
    for i, it in enumerate(items):
        tables[i, : len(it.block_table)] = it.block_table

    def slots_at(rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
        return tables[rows, pos // block_size] * block_size + pos % block_size

    heads = np.arange(num_kv_heads)
    grid = np.arange(past)[None, :]
    rows_b = np.arange(b)[:, None]
    last = np.maximum(starts + real_lens - 1, 0)[:, None]  # a padding row's position has no slot
    past_slots = np.where(grid < starts[:, None], slots_at(rows_b, np.minimum(grid, last)), 0)
    s_idx = np.minimum(np.arange(s)[None, :], q_lens[:, None] - 1)  # [B, S]
    if s == 1:
        ids = np.array([[it.tokens[0]] for it in items], np.int64)
    else:
        ids = np.array([list(it.tokens) + [it.tokens[-1]] * (s - len(it.tokens)) for it in items], np.int64)
    lora_index = np.repeat(np.array([[it.lora_slot] for it in items], np.int64), s, axis=1)
    pos = (starts[:, None] + s_idx).reshape(-1)  # [B*S] position of each (padded) row
    row_seq = np.repeat(np.arange(b), s)
    new_kv_index = np.empty((b * s, num_kv_heads, 3), np.int64)
    new_kv_index[..., 0] = row_seq[:, None]
    new_kv_index[..., 1] = heads[None, :]
    new_kv_index[..., 2] = pos[:, None]
    real_rows = np.nonzero((np.arange(s)[None, :] < real_lens[:, None]).reshape(-1))[0][:real_tokens]
    sampling = sampling_rows(items)
    inputs = {
        "input_ids": ids,
        "kv_index": past_slots[:, None, :] * num_kv_heads + heads[None, :, None],
        "seqlens_k": (ctx - 1).astype(np.int32),
        "total_sequence_length": np.array(total, np.int32),
        "new_kv_index": new_kv_index,
        "logit_rows": np.array([i * s + q_lens[i] - back for i, back in sampling], np.int64),
        "lora_index": lora_index,
    }
    sampling = [i for i, _ in sampling]
    if rope_rows:
        inputs["positions"] = pos.reshape(b, s) + np.array([[it.rope_offset] for it in items], np.int64)
    slot_mapping = slots_at(row_seq[real_rows], pos[real_rows])
    return StepPlan(inputs, slot_mapping, b * s, real_tokens, sampling, real_rows, present)


def plan_dense_step(items: list[StepItem], idle: list[bool], block_size: int, rope_rows: bool = False) -> StepPlan:
    """Inputs of the "ort" graph with the dense KV layout. Row b of the run is row r0 + b of the
    backend's per-sequence buffers; `idle[b]` marks a row whose sequence is not in this step
    (it feeds one dummy token whose key lands past its valid context, where the next real token
    overwrites it, and yields nothing). Rows with a past must all be single tokens, as for
    `plan_gqa_step`; first chunks are padded with their last token."""
    b = len(items)
    q_lens = np.array([len(it.tokens) for it in items])
    starts = np.array([it.start for it in items])
    s = int(q_lens.max())
    if s > 1 and b > 1 and starts.any():
        raise ValueError("rows with a past must be run one at a time when they feed several tokens")
    if s > 1 and any(idle):
        raise ValueError("idle rows can only join single-token (decode) runs")
    ctx = starts + q_lens
    if s == 1:
        ids = np.array([[it.tokens[0]] for it in items], np.int64)
    else:
        ids = np.array([list(it.tokens) + [it.tokens[-1]] * (s - len(it.tokens)) for it in items], np.int64)
    s_idx = np.minimum(np.arange(s)[None, :], q_lens[:, None] - 1)
    pos = (starts[:, None] + s_idx).reshape(-1)
    row_seq = np.repeat(np.arange(b), s)
    real_lens = q_lens - np.array([it.pad for it in items])  # a padding row's key is not kept (`query_pad`)
    real = (np.arange(s)[None, :] < real_lens[:, None]) & ~np.asarray(idle, bool)[:, None]
    real_rows = np.nonzero(real.reshape(-1))[0]
    sampling = [(i, back) for i, back in sampling_rows(items) if not idle[i]]
    width = max(1, max(len(it.block_table) for it in items))
    tables = np.zeros((b, width), np.int64)
    for i, it in enumerate(items):
        tables[i, : len(it.block_table)] = it.block_table
    rows, at = row_seq[real_rows], pos[real_rows]
    slot_mapping = tables[rows, at // block_size] * block_size + at % block_size
    inputs = {
        "input_ids": ids,
        "seqlens_k": (ctx - 1).astype(np.int32),
        "total_sequence_length": np.array(int(ctx.max()), np.int32),
        "logit_rows": np.array([i * s + q_lens[i] - back for i, back in sampling], np.int64),
        "lora_index": np.repeat(np.array([[it.lora_slot] for it in items], np.int64), s, axis=1),
    }
    if rope_rows:  # as for plan_gqa_step
        inputs["positions"] = pos.reshape(b, s) + np.array([[it.rope_offset] for it in items], np.int64)
    return StepPlan(inputs, slot_mapping, b * s, len(real_rows), [i for i, _ in sampling], real_rows, int(ctx.max()),
                    at)


class DecodeInputs:
    """Inputs of the dense layout's steady decode step, preallocated: every row of the run
    feeds one token and samples. The arrays are filled in place each step, so a binding by
    pointer to their first n rows stays valid until n changes (or the arrays grow);
    `plan_dense_step` builds the same graph inputs for such a step, except that the logits
    come out in the items' order rather than the rows' (`logit_rows` gathers them)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.input_ids = np.zeros((rows, 1), np.int64)
        self.seqlens_k = np.zeros(rows, np.int32)
        self.total_sequence_length = np.zeros((), np.int32)
        self.logit_rows = np.zeros(rows, np.int64)  # the run's row of each item, in item order
        self.lora_index = np.full((rows, 1), -1, np.int64)
        self.positions = np.zeros(rows, np.int64)  # each item's new position
        self.slot_mapping = np.zeros(rows, np.int64)  # each item's new paged-cache slot
        self.rope_rows = np.zeros((rows, 1), np.int64)  # each row's rotary table row (`rope_by_row` graphs)

    def fill(self, rows: list[int], tokens: list[int], starts: list[int], slots: list[int],
             lora_slots: list[int] | None, rope_offsets: list[int] | None = None) -> None:
        """Item i runs in row rows[i] (rows: a permutation of 0..n-1) and feeds tokens[i] at
        position starts[i] (its context after the step is starts[i] + 1); its key/value goes to
        paged-cache slot slots[i]; its rotary table row is starts[i] + rope_offsets[i]."""
        n = len(rows)
        if n > self.rows:
            raise ValueError(f"{n} decode rows; these inputs hold {self.rows}")
        self.logit_rows[:n] = rows
        self.input_ids[rows, 0] = tokens
        self.seqlens_k[rows] = starts
        self.rope_rows[rows, 0] = starts if rope_offsets is None else np.add(starts, rope_offsets)
        self.total_sequence_length[()] = max(starts) + 1
        self.positions[:n] = starts
        self.slot_mapping[:n] = slots
        if lora_slots is not None:
            self.lora_index[rows, 0] = lora_slots

    def views(self, n: int, lora: bool, rope_rows: bool = False) -> dict[str, np.ndarray]:
        """The graph inputs for n rows (views of the preallocated arrays)."""
        out = {
            "input_ids": self.input_ids[:n],
            "seqlens_k": self.seqlens_k[:n],
            "total_sequence_length": self.total_sequence_length,
            "logit_rows": self.logit_rows[:n],
        }
        if lora:
            out["lora_index"] = self.lora_index[:n]
        if rope_rows:
            out["positions"] = self.rope_rows[:n]
        return out
