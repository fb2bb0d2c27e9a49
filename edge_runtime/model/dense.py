"""Dense causal attention over a padded [batch, length] block: the training and reference path.

No KV cache: each row attends to its own earlier tokens. Used by fine-tuning (autograd flows
through it) and by tests that compare our forward with `transformers`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from edge_runtime.model.llama import LlamaModel, LoraApplier, layer_window, sdpa


class DenseCausalContext:
    """Attention for `batch` rows of `length` tokens, flattened row-major into T = batch*length.

    `attention_mask` [batch, length] marks real tokens (1) and right-padding (0); padded queries
    produce finite garbage that callers ignore. `sliding_window`: a query sees that many keys,
    itself included, in every layer, or a tuple per layer (the model's
    `ModelConfig.layer_windows`); `softcap`: the attention scores' (`ModelConfig.attn_softcap`).
    """

    def __init__(
        self, batch: int, length: int, attention_mask: Tensor | None = None, lora: LoraApplier | None = None,
        sliding_window: int | None | tuple[int | None, ...] = None, softcap: float | None = None,
    ) -> None:
        self.batch = batch
        self.length = length
        self.lora = lora
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.attention_mask = attention_mask
        self._masks: dict[int | None, Tensor | None] = {}

    def _mask(self, window: int | None) -> Tensor | None:
        """[B or 1, 1, L, L] (True = may attend), or None for plain causal attention."""
        if window in self._masks:
            return self._masks[window]
        length, attention_mask = self.length, self.attention_mask
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        if window is not None:
            causal = causal.triu(1 - window)
        mask = None
        if attention_mask is not None:
            causal = causal[None] & attention_mask.bool()[:, None, :]
            # A padded query row with every key masked would softmax to NaN; let it see itself.
            causal = causal | torch.eye(length, dtype=torch.bool)[None]
            mask = causal[:, None]  # [B, 1, L, L]
        elif window is not None:
            mask = causal[None, None]
        self._masks[window] = mask
        return mask

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        b, n = self.batch, self.length
        heads, d = q.shape[1], q.shape[2]
        qh = q.view(b, n, heads, d).transpose(1, 2)
        kh = k.view(b, n, k.shape[1], d).transpose(1, 2)
        vh = v.view(b, n, v.shape[1], d).transpose(1, 2)
        mask = self._mask(layer_window(self.sliding_window, layer))
        out = sdpa(qh, kh, vh, None if mask is None else mask.to(q.device), self.softcap)
        return out.transpose(1, 2).reshape(b * n, heads * d)


def dense_logits(
    model: LlamaModel, input_ids: Tensor, attention_mask: Tensor | None = None, lora: LoraApplier | None = None
) -> Tensor:
    """Logits [B, L, vocab] for every position of a right-padded batch; each row is one sequence
    of its unpadded length (which picks LongRoPE's factors, as a forward of that row alone would)."""
    b, n = input_ids.shape
    lengths = [n] * b if attention_mask is None else attention_mask.sum(dim=1).tolist()
    offsets = torch.tensor([model.rope.offset(int(length)) for length in lengths], device=input_ids.device)
    positions = (torch.arange(n, device=input_ids.device)[None, :] + offsets[:, None]).reshape(-1)
    ctx = DenseCausalContext(b, n, attention_mask, lora, model.cfg.layer_windows, model.cfg.attn_softcap)
    hidden = model.run_layers(model.embed_tokens(input_ids.reshape(-1)), positions, ctx)
    return model.logits(hidden).view(b, n, -1)
