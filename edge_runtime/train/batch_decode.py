"""Greedy answers of several prompts at once under one adapter, a few tokens per call, and the logits
another policy gives those answers in one forward: the publish guard's generation, batched and cut
into pieces the scheduler can fit beside serving (train/guard_task.py). No registry, no engine.

The prompts are left-padded to one width so every sequence's next token is the last column; a pad
column is masked out of every query's keys (and sees only itself, so its softmax stays finite).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from edge_runtime.model.llama import LlamaModel, LoraApplier, layer_window, sdpa


class BatchKV:
    """Per-layer keys/values [B, kv_heads, columns, d] of B left-padded sequences (`ForwardContext`)."""

    def __init__(self, model: LlamaModel, pads: Sequence[int], lora: LoraApplier | None) -> None:
        self.lora = lora
        self.pads = torch.tensor(list(pads), dtype=torch.long)
        self.windows = model.cfg.layer_windows
        self.softcap = model.cfg.attn_softcap
        self.k: list[Tensor | None] = [None] * model.cfg.num_layers
        self.v: list[Tensor | None] = [None] * model.cfg.num_layers

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v) if t is not None)

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        b = len(self.pads)
        w = q.shape[0] // b
        heads, d = q.shape[1], q.shape[2]
        qh = q.view(b, w, heads, d).transpose(1, 2)
        kh = k.view(b, w, k.shape[1], d).transpose(1, 2)
        vh = v.view(b, w, v.shape[1], d).transpose(1, 2)
        prev_k, prev_v = self.k[layer], self.v[layer]
        keys = self.k[layer] = kh if prev_k is None else torch.cat([prev_k, kh], dim=2)
        values = self.v[layer] = vh if prev_v is None else torch.cat([prev_v, vh], dim=2)
        total = keys.shape[2]
        q_col = torch.arange(total - w, total, device=q.device)[:, None]
        k_col = torch.arange(total, device=q.device)[None, :]
        # Real tokens are contiguous after the pads, so column distance is position distance.
        allowed = layer_window_mask(q_col, k_col, layer_window(self.windows, layer))
        mask = (allowed[None] & (k_col[None] >= self.pads.to(q.device)[:, None, None])) | (k_col == q_col)[None]
        out = sdpa(qh, keys, values, mask[:, None], self.softcap)
        return out.transpose(1, 2).reshape(b * w, heads * d)


def layer_window_mask(q_col: Tensor, k_col: Tensor, window: int | None) -> Tensor:
    mask = k_col <= q_col
    return mask if window is None else mask & (k_col > q_col - window)


def _forward(model: LlamaModel, kv: BatchKV, ids: Tensor, positions: Tensor) -> Tensor:
    """ids, positions: [B, w] -> hidden [B, w, hidden]."""
    b, w = ids.shape
    device = model.device
    hidden = model.run_layers(model.embed_tokens(ids.reshape(-1).to(device)), positions.reshape(-1).to(device), kv)
    return hidden.view(b, w, -1)


class BatchDecode:
    """Greedy answers of `prompts` under `lora`: `prefill()` once, then `decode(steps)` until `done`.
    `ids[i]` ends at the first stop id (included) or at `max_new_tokens`; `logits[i]` holds the
    logits that chose each of them (float32, CPU)."""

    def __init__(self, model: LlamaModel, prompts: Sequence[Sequence[int]], lora: LoraApplier | None,
                 max_new_tokens: int, stop_ids: frozenset[int] = frozenset()) -> None:
        self.model = model
        self.prompts = [list(p) for p in prompts]
        self.lora = lora
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop_ids
        self.ids: list[list[int]] = [[] for _ in self.prompts]
        self.logits: list[list[Tensor]] = [[] for _ in self.prompts]
        self.finished = [False] * len(self.prompts)
        self._kv: BatchKV | None = None
        self._next: Tensor | None = None  # [B, 1] the tokens fed next
        self._pos: Tensor | None = None  # [B] their positions
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.prompts or all(self.finished) or self.steps >= self.max_new_tokens

    @property
    def held_bytes(self) -> int:
        return 0 if self._kv is None else self._kv.nbytes

    def reset(self) -> None:
        """Forget everything (memory pressure): start again from `prefill`."""
        self.__init__(self.model, self.prompts, self.lora, self.max_new_tokens, self.stop_ids)  # type: ignore[misc]

    @torch.no_grad()
    def prefill(self) -> None:
        width = max(len(p) for p in self.prompts)
        pads = [width - len(p) for p in self.prompts]
        offsets = [self.model.rope.offset(len(p) + self.max_new_tokens) for p in self.prompts]
        ids = torch.tensor([[0] * pad + p for pad, p in zip(pads, self.prompts, strict=True)], dtype=torch.long)
        positions = torch.tensor([[off + max(0, c - pad) for c in range(width)] for pad, off in zip(pads, offsets, strict=True)],
                                 dtype=torch.long)
        self._kv = BatchKV(self.model, pads, self.lora)
        hidden = _forward(self.model, self._kv, ids, positions)
        self._take(hidden[:, -1])
        self._pos = positions[:, -1] + 1

    @torch.no_grad()
    def decode(self, steps: int) -> None:
        for _ in range(steps):
            if self.done:
                return
            if self._kv is None or self._next is None or self._pos is None:
                raise RuntimeError("prefill before decoding")
            hidden = _forward(self.model, self._kv, self._next, self._pos[:, None])
            self._take(hidden[:, -1])
            self._pos = self._pos + 1

    def _take(self, last_hidden: Tensor) -> None:
        logits = self.model.logits(last_hidden).float().cpu()
        tokens = logits.argmax(-1)
        for i, token in enumerate(tokens.tolist()):
            if not self.finished[i]:
                self.ids[i].append(token)
                # A copy of the row: a view would keep the whole step's [rows, vocab] alive (#28).
                self.logits[i].append(logits[i].clone())
                self.finished[i] = token in self.stop_ids
        self.steps += 1
        self._next = tokens[:, None]
        if self.done:
            self._kv = None  # nothing more to attend to: give the memory back now


@torch.no_grad()
def batch_answer_logits(model: LlamaModel, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]],
                        lora: LoraApplier | None, max_new_tokens: int) -> list[Tensor]:
    """The logits [len(answer), vocab] under `lora` that predict each token of each answer given its
    prompt and the answer before it, all sequences in one forward. `max_new_tokens` picks the rotary
    offset as `BatchDecode` did (LongRoPE)."""
    return list(each_answer_logits(model, prompts, answers, lora, max_new_tokens))


def each_answer_logits(model: LlamaModel, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]],
                       lora: LoraApplier | None, max_new_tokens: int) -> Iterator[Tensor]:
    """`batch_answer_logits`' tensors one answer at a time (one forward), so a caller that reduces
    each (a KL) holds one answer's [len, vocab] logits, not the batch's (#28)."""
    seqs = [list(p) + list(a[:-1]) for p, a in zip(prompts, answers, strict=True)]
    if not seqs:
        return
    width = max(len(s) for s in seqs)
    pads = [width - len(s) for s in seqs]
    offsets = [model.rope.offset(len(p) + max_new_tokens) for p in prompts]
    ids = torch.tensor([[0] * pad + s for pad, s in zip(pads, seqs, strict=True)], dtype=torch.long)
    positions = torch.tensor([[off + max(0, c - pad) for c in range(width)] for pad, off in zip(pads, offsets, strict=True)],
                             dtype=torch.long)
    hidden = _forward(model, BatchKV(model, pads, lora), ids, positions)
    for i, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        if not answer:
            yield torch.zeros(0, model.cfg.vocab_size)
            continue
        first = pads[i] + len(prompt) - 1
        yield model.logits(hidden[i, first:first + len(answer)]).float().cpu()
