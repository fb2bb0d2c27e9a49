"""Dense causal attention over a padded [batch, length] block: the training and reference path.

No KV cache: each row attends to its own earlier tokens. Used by fine-tuning (autograd flows
through it) and by tests that compare our forward with `transformers`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from edge_runtime.model.llama import LlamaModel, LoraApplier


class DenseCausalContext:
    """Attention for `batch` rows of `length` tokens, flattened row-major into T = batch*length.

    `attention_mask` [batch, length] marks real tokens (1) and right-padding (0); padded queries
    produce finite garbage that callers ignore. `sliding_window`: a query sees that many keys,
    itself included (the model's `ModelConfig.sliding_window`).
    """

    def __init__(
        self, batch: int, length: int, attention_mask: Tensor | None = None, lora: LoraApplier | None = None,
        sliding_window: int | None = None,
    ) -> None:
        self.batch = batch
        self.length = length
        self.lora = lora
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        if sliding_window is not None:
            causal = causal.triu(1 - sliding_window)
        self.mask = None
        if attention_mask is not None:
            causal = causal[None] & attention_mask.bool()[:, None, :]
            # A padded query row with every key masked would softmax to NaN; let it see itself.
            causal = causal | torch.eye(length, dtype=torch.bool)[None]
            self.mask = causal[:, None]  # [B, 1, L, L]
        elif sliding_window is not None:
            self.mask = causal[None, None]
        self._causal_only = self.mask is None

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        b, n = self.batch, self.length
        heads, d = q.shape[1], q.shape[2]
        qh = q.view(b, n, heads, d).transpose(1, 2)
        kh = k.view(b, n, k.shape[1], d).transpose(1, 2)
        vh = v.view(b, n, v.shape[1], d).transpose(1, 2)
        if self._causal_only:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=self.mask.to(q.device), enable_gqa=True)
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
    ctx = DenseCausalContext(b, n, attention_mask, lora, model.cfg.sliding_window)
    hidden = model.run_layers(model.embed_tokens(input_ids.reshape(-1)), positions, ctx)
    return model.logits(hidden).view(b, n, -1)
