"""Token windows over one preference pair, and the attention that lets them run one at a time
(or all in one call of a layer, each still attending as alone: `WindowsContext`).

The prompt is shared: its windows run as one row, then the completion windows run the chosen
and rejected answers side by side (two rows) attending to the prompt's keys/values and to their
own earlier windows (FlexLLM's token-level fine-tuning, sec. 6.1). Keys/values stay in the
autograd graph, so gradients reach earlier windows exactly as in one full-sequence pass.

Each answer is scored as its own sequence, prompt included, would be by one forward. Under
LongRoPE that sequence's length picks the rotary factors of every position, the prompt's too: when
one answer takes its sequence past the switch and the other does not, the prompt's keys differ
between them, so its windows run as two rows as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from edge_runtime.model.llama import LlamaModel, LoraApplier, layer_window, sdpa, window_mask
from edge_runtime.train.pairs import PairTokens

CHOSEN, REJECTED = 0, 1


@dataclass
class Window:
    """Tokens [start, stop) of the prompt (batch 1; 2 when the answers' rotary rows differ) or of
    both completions (batch 2, the shorter right-padded), flattened row-major. Rows `score_rows`
    predict `targets`, which belong to the chosen (owner 0) or rejected (owner 1) completion's
    log-prob sum. `positions` are rows of the model's rotary table (`RotaryTable.offset`)."""

    index: int
    part: str  # "prompt" | "completion"
    start: int
    stop: int
    batch: int
    input_ids: Tensor
    positions: Tensor
    score_rows: Tensor
    targets: Tensor
    owners: Tensor

    @property
    def width(self) -> int:
        return self.stop - self.start

    @property
    def num_rows(self) -> int:
        return self.batch * self.width


def plan_windows(
    tokens: PairTokens, window_tokens: int | None = None, pad_id: int = 0, rope_offsets: tuple[int, int] = (0, 0)
) -> list[Window]:
    """Cut the pair into windows of at most `window_tokens` token rows (None: one prompt window
    and one completion window): the prompt's windows are that many positions wide, the
    completions' half as many (two rows each), so every window's forward is about the same size
    and none is twice the stage the scheduler must find room for. `rope_offsets`: the rotary
    table offsets of the chosen and the rejected sequence (`pair_rope_offsets`)."""
    p = len(tokens.prompt)
    c = tokens.completion_length
    if p == 0 or c == 0:
        raise ValueError("a pair needs a non-empty prompt and completion")
    size = window_tokens or max(p, c)
    completions = (tokens.chosen, tokens.rejected)
    # One prompt row serves both answers unless their rotary rows differ.
    prompt_rows = (rope_offsets[0],) if rope_offsets[0] == rope_offsets[1] else rope_offsets
    windows: list[Window] = []
    for start in range(0, p, size):
        stop = min(p, start + size)
        rows, targets, owners = [], [], []
        if stop == p:  # the last prompt position predicts the first token of each completion
            for owner, comp in enumerate(completions):
                rows.append((owner if len(prompt_rows) == 2 else 0) * (stop - start) + stop - 1 - start)
                targets.append(comp[0])
                owners.append(owner)
        windows.append(_window(len(windows), "prompt", start, stop, len(prompt_rows),
                               list(tokens.prompt[start:stop]) * len(prompt_rows),
                               [t + off for off in prompt_rows for t in range(start, stop)], rows, targets, owners))
    width = max(1, window_tokens // 2) if window_tokens else c
    for start in range(0, c, width):
        stop = min(c, start + width)
        ids: list[int] = []
        rows, targets, owners = [], [], []
        for owner, comp in enumerate(completions):
            base = owner * (stop - start)
            ids.extend(comp[t] if t < len(comp) else pad_id for t in range(start, stop))
            for t in range(start, min(stop, len(comp) - 1)):
                rows.append(base + t - start)
                targets.append(comp[t + 1])
                owners.append(owner)
        positions = [t + off for off in rope_offsets for t in range(p + start, p + stop)]
        windows.append(_window(len(windows), "completion", start, stop, 2, ids, positions, rows, targets, owners))
    return windows


def pair_rope_offsets(model: LlamaModel, tokens: PairTokens) -> tuple[int, int]:
    """The rotary table offsets of prompt + chosen and prompt + rejected, each by its own length."""
    p = len(tokens.prompt)
    return model.rope.offset(p + len(tokens.chosen)), model.rope.offset(p + len(tokens.rejected))


def _window(
    index: int, part: str, start: int, stop: int, batch: int, ids: list[int], positions: list[int],
    rows: list[int], targets: list[int], owners: list[int],
) -> Window:
    def t(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.long)

    return Window(index, part, start, stop, batch, t(ids), t(positions), t(rows), t(targets), t(owners))


class PairKV:
    """Per-layer keys/values of the windows run so far: the prompt's ([1 or 2, kv_heads, P, d])
    and the completions' ([2, kv_heads, C, d]); `sliding_window` is the model's (keys a query sees,
    itself included: one for every layer or a tuple per layer, `ModelConfig.layer_windows`), and
    `softcap` its attention scores' (`ModelConfig.attn_softcap`)."""

    def __init__(self, num_layers: int, sliding_window: int | None | tuple[int | None, ...] = None,
                 softcap: float | None = None) -> None:
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.prompt_k: list[Tensor | None] = [None] * num_layers
        self.prompt_v: list[Tensor | None] = [None] * num_layers
        self.comp_k: list[Tensor | None] = [None] * num_layers
        self.comp_v: list[Tensor | None] = [None] * num_layers

    def context(self, window: Window, lora: LoraApplier | None) -> WindowContext:
        return WindowContext(self, window, lora)

    def contexts(self, windows: list[Window], lora: LoraApplier | None) -> WindowsContext:
        return WindowsContext(self, windows, lora)


def _append(prev: Tensor | None, new: Tensor) -> Tensor:
    # A copy of its own, never the view it came as: a view of a layer's fused q/k/v projection (or
    # rotary output) kept every layer's whole projection alive until the backward (measured at
    # the 1B shape on an H200: 37 of a scoring stage's 51 MiB).
    return new.contiguous() if prev is None else torch.cat([prev, new], dim=2)


class WindowContext:
    """`ForwardContext` for one window: stores its keys/values, attends causally to all before."""

    def __init__(self, kv: PairKV, window: Window, lora: LoraApplier | None) -> None:
        self.kv = kv
        self.window = window
        self.lora = lora

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kv, win = self.kv, self.window
        b, w = win.batch, win.width
        heads, d = q.shape[1], q.shape[2]
        qh = q.view(b, w, heads, d).transpose(1, 2)
        kh = k.view(b, w, k.shape[1], d).transpose(1, 2)
        vh = v.view(b, w, v.shape[1], d).transpose(1, 2)
        if win.part == "prompt":
            keys = kv.prompt_k[layer] = _append(kv.prompt_k[layer], kh)
            values = kv.prompt_v[layer] = _append(kv.prompt_v[layer], vh)
        else:
            comp_k = kv.comp_k[layer] = _append(kv.comp_k[layer], kh)
            comp_v = kv.comp_v[layer] = _append(kv.comp_v[layer], vh)
            pk, pv = kv.prompt_k[layer], kv.prompt_v[layer]
            if pk is None or pv is None:
                raise RuntimeError("completion windows must run after every prompt window")
            keys = torch.cat([pk.expand(b, -1, -1, -1), comp_k], dim=2)
            values = torch.cat([pv.expand(b, -1, -1, -1), comp_v], dim=2)
        offset = keys.shape[2] - w  # positions before this window
        window = layer_window(kv.sliding_window, layer)
        mask = None
        if offset != 0 or window is not None:
            q_pos = torch.arange(offset, offset + w, device=q.device)[:, None]
            k_pos = torch.arange(offset + w, device=q.device)[None, :]
            mask = window_mask(q_pos, k_pos, window)
        out = sdpa(qh, keys, values, mask, kv.softcap)
        return out.transpose(1, 2).reshape(b * w, heads * d)


class WindowsContext:
    """`ForwardContext` for every window in one call, their rows one after another in order: each
    window attends as its own `WindowContext` would (to the keys and values the windows before it
    left in this layer), and every projection reads its weight once for all of them (row-wise,
    the same products): a layer of quantised weights is de-quantised once per pass over the pair,
    with no float copy of it held across windows."""

    def __init__(self, kv: PairKV, windows: list[Window], lora: LoraApplier | None) -> None:
        self.lora = lora
        self.parts = [WindowContext(kv, win, lora) for win in windows]
        self.rows = [win.num_rows for win in windows]

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return torch.cat([ctx.attention(layer, qs, ks, vs) for ctx, qs, ks, vs
                          in zip(self.parts, q.split(self.rows), k.split(self.rows), v.split(self.rows), strict=True)])
