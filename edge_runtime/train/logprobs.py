"""Sequence log-probs of preference pairs under the policy (an adapter) or the reference (the
base model with the adapter off), plus the cache of reference log-probs: the base is frozen, so a
pair's reference values never change and are computed once.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor

from edge_runtime.model.dense import dense_logits
from edge_runtime.model.llama import LlamaModel, LoraApplier
from edge_runtime.train.pairs import PairTokens
from edge_runtime.train.windows import PairKV, pair_rope_offsets, plan_windows


def token_logps(model: LlamaModel, hidden: Tensor, targets: Tensor) -> Tensor:
    """log p(target | row) for hidden rows [n, hidden] -> [n], in float32."""
    logits = model.logits(hidden).float()
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


@torch.no_grad()
def pair_logps(
    model: LlamaModel, tokens: PairTokens, lora: LoraApplier | None, window_tokens: int | None = None
) -> tuple[float, float]:
    """(log pi(chosen|prompt), log pi(rejected|prompt)) in one pass that runs the prompt once."""
    kv = PairKV(model.cfg.num_layers, model.cfg.layer_windows, model.cfg.attn_softcap)
    sums = torch.zeros(2, dtype=torch.float64)
    device = model.device
    for win in plan_windows(tokens, window_tokens, rope_offsets=pair_rope_offsets(model, tokens)):
        ctx = kv.context(win, lora)
        hidden = model.run_layers(model.embed_tokens(win.input_ids.to(device)), win.positions.to(device), ctx)
        if win.score_rows.numel():
            logp = token_logps(model, hidden.index_select(0, win.score_rows.to(device)), win.targets.to(device))
            sums.index_add_(0, win.owners, logp.double().cpu())
    return float(sums[0]), float(sums[1])


def pair_logps_dense(model: LlamaModel, tokens: PairTokens, lora: LoraApplier | None) -> Tensor:
    """The same two sums from one padded [2, P + C] full-sequence forward (autograd flows): the
    plain reference that the staged task's gradients are checked against."""
    p, c = len(tokens.prompt), tokens.completion_length
    rows = []
    for comp in (tokens.chosen, tokens.rejected):
        rows.append(list(tokens.prompt) + list(comp) + [0] * (c - len(comp)))
    ids = torch.tensor(rows, dtype=torch.long, device=model.device)
    mask = torch.zeros_like(ids)
    mask[0, : p + len(tokens.chosen)] = 1
    mask[1, : p + len(tokens.rejected)] = 1
    logits = dense_logits(model, ids, mask, lora).float()
    sums = []
    for row, comp in enumerate((tokens.chosen, tokens.rejected)):
        pred = logits[row, p - 1 : p - 1 + len(comp)]  # position t predicts token t + 1
        target = torch.tensor(comp, dtype=torch.long, device=model.device)
        sums.append((pred.gather(-1, target[:, None]).squeeze(-1) - torch.logsumexp(pred, -1)).sum())
    return torch.stack(sums)


class ReferenceCache:
    """pair key -> (ref chosen, ref rejected) log-probs, least recently used dropped first."""

    def __init__(self, max_entries: int = 8192) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, tuple[float, float]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tokens: PairTokens) -> bool:
        return self.has(tokens)

    def has(self, tokens: PairTokens, beneath: str = "") -> bool:
        return _key(tokens, beneath) in self._entries

    def get(self, tokens: PairTokens, beneath: str = "") -> tuple[float, float] | None:
        """`beneath`: the fleet version the reference includes ("" for the base alone)."""
        key = _key(tokens, beneath)
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return value

    def put(self, tokens: PairTokens, value: tuple[float, float], beneath: str = "") -> None:
        key = _key(tokens, beneath)
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


def _key(tokens: PairTokens, beneath: str) -> bytes:
    # A reference with the fleet beneath depends on the fleet's version; '\0' cannot occur in
    # an owner@version key.
    return tokens.key if not beneath else beneath.encode() + b"\0" + tokens.key
