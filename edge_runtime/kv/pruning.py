"""Decode-time KV cache pruning: which cached positions each KV head of a sequence still attends to.

MACE's norm-guided pruning (paper sec. 4.3) and two baselines on the same state: StreamingLLM's
attention sinks plus a sliding window, and H2O's accumulated-attention eviction. Pruning masks
positions out of one head's attention; it never moves a key (keys are cached already rotated, so
a retained key keeps its original RoPE position). Knows nothing of blocks, ledgers or scheduling.

"Used" is measured, since the paper does not define it: position p is used by KV head h at a
decode step when some query head of h's group gives it at least `use_ratio` times the uniform
share of attention (weight >= use_ratio / retained positions of h).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

POLICIES = ("off", "mace", "window", "h2o")
WHEN = ("always", "pressure")  # every sequence from its first decode step | turned on under memory pressure


@dataclass(frozen=True)
class PruningSettings:
    """The engine's kv_prune_* settings, checked. `capacity` is C_total / heads: the mean number
    of positions one KV head of one sequence keeps (C_total = capacity x layers x kv heads)."""

    policy: str
    capacity: int
    window: int = 0  # W, in decode steps; 0 = no idle rule
    norm_threshold: float = 0.0  # tau; 0 = no norm rule
    sinks: int = 4
    use_ratio: float = 1.0
    when: str = "always"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown KV pruning policy {self.policy!r}; use one of {', '.join(POLICIES)}")
        if self.when not in WHEN:
            raise ValueError(f"kv_prune_when must be one of {', '.join(WHEN)} (got {self.when!r})")
        if self.policy != "off" and self.capacity < 1:
            raise ValueError(f"kv_prune_capacity must be at least 1 position per head with policy "
                             f"{self.policy!r} (got {self.capacity})")
        if self.window < 0 or self.sinks < 0:
            raise ValueError("kv_prune_window and kv_prune_sinks cannot be negative")
        if not (self.norm_threshold >= 0 and math.isfinite(self.norm_threshold)):
            raise ValueError(f"kv_prune_norm_threshold must be a finite number >= 0 (got {self.norm_threshold})")
        if not (self.use_ratio > 0 and math.isfinite(self.use_ratio)):
            raise ValueError(f"kv_prune_use_ratio must be a finite number > 0 (got {self.use_ratio})")

    @classmethod
    def from_config(cls, config: Any) -> PruningSettings | None:
        """The settings of an `EngineConfig`, or None when pruning is off."""
        settings = cls(config.kv_prune_policy, config.kv_prune_capacity, config.kv_prune_window,
                       config.kv_prune_norm_threshold, config.kv_prune_sinks, config.kv_prune_use_ratio,
                       config.kv_prune_when)
        return None if settings.policy == "off" else settings


def head_capacities(mean_norms: Tensor, total: int, limit: int | None = None) -> Tensor:
    """C_h = floor(w_h * C_total) with w_h = mean_norm_h / sum of mean norms, and the remainder
    one position each to the heads of largest w_h (MACE eq. in sec. 4.3). Any shape; int64 out.
    All-zero norms (nothing observed yet) share C_total equally.

    With `limit` (the context length: no head can hold more), a head whose share reaches it gets
    `limit` and the rest of C_total is shared the same way among the others (the paper does not
    say what happens to capacity a head cannot use; giving it away means a C_total that holds
    the whole context prunes nothing)."""
    weights = mean_norms.double().flatten()
    saturated = torch.zeros_like(weights, dtype=torch.bool)
    while True:
        if bool(saturated.all()):  # C_total holds every head's whole context
            return torch.full_like(mean_norms, limit, dtype=torch.long)
        budget = total - (0 if limit is None else limit * int(saturated.sum()))
        active = weights.masked_fill(saturated, 0.0)
        if not bool(active.sum() > 0):  # nothing observed yet (or only zero norms left): equal shares
            active = (~saturated).double()
        share = active / active.sum() * budget
        reached = ~saturated & (share >= limit) if limit is not None else torch.zeros_like(saturated)
        if not bool(reached.any()):
            break
        saturated |= reached
    caps = torch.floor(share).long()
    if limit is not None:
        caps[saturated] = limit
    free = ~saturated
    remainder = int(budget - caps[free].sum()) if bool(free.any()) else 0
    if remainder > 0:  # fewer than the unsaturated heads; each gets at most one more
        order = torch.argsort(active.masked_fill(saturated, -1.0), descending=True, stable=True)
        caps[order[:remainder]] += 1
    return caps.view(mean_norms.shape)


def evict_over_capacity(retained: Tensor, key: Tensor, caps: Tensor, protected: Tensor) -> None:
    """Drop, in place, each head's retained, unprotected positions of smallest `key` until the head
    holds at most caps[h] positions (or only protected ones). retained/protected: [..., n] bool;
    key: [..., n] (distinct values per head make the choice unique); caps: [...]."""
    excess = (retained.sum(-1) - caps).clamp(min=0)
    most = int(excess.max()) if excess.numel() else 0
    if most == 0:
        return
    evictable = retained & ~protected
    never = float("inf") if key.is_floating_point() else torch.iinfo(key.dtype).max
    key = key.masked_fill(~evictable, never)
    # Usually one position per head per step: topk finds it without sorting the whole context.
    found = key.topk(min(most, key.shape[-1]), dim=-1, largest=False, sorted=True)
    take = torch.arange(found.indices.shape[-1], device=key.device) < excess.unsqueeze(-1)
    take &= found.values != never
    drop = torch.zeros_like(retained)
    drop.scatter_(-1, found.indices, take)
    retained &= ~drop


class HeadPruning:
    """One sequence's pruning state over its [layers, kv_heads] heads and positions 0..length-1:
    which positions each head retains, when each was last used, H2O's accumulated attention, and
    the running sum of each head's attention-output norm."""

    def __init__(self, settings: PruningSettings, num_layers: int, num_kv_heads: int,
                 device: torch.device | str = "cpu") -> None:
        self.settings = settings
        self.device = torch.device(device)
        heads = (num_layers, num_kv_heads)
        self.length = 0
        self.retained = torch.ones(*heads, 0, dtype=torch.bool, device=self.device)
        self.last_used = torch.zeros(*heads, 0, dtype=torch.long, device=self.device)
        self.score = torch.zeros(*heads, 0, dtype=torch.float32, device=self.device)
        self.norm_sum = torch.zeros(heads, dtype=torch.float64, device=self.device)
        self.last_norm = torch.zeros(heads, dtype=torch.float64, device=self.device)
        self.steps = 0
        self._observed_len = 0

    @property
    def num_heads(self) -> int:
        return self.retained.shape[0] * self.retained.shape[1]

    @property
    def retained_entries(self) -> int:
        """(head, position) pairs still attended: what a per-head compacted cache would hold."""
        return int(self.retained[:, :, : self.length].sum())

    def kv_bytes(self, head_dim: int, element_size: int) -> int:
        """Bytes of keys and values the retained entries hold."""
        return 2 * self.retained_entries * head_dim * element_size

    def pruned_blocks(self, block_size: int) -> list[int]:
        """Indices into the sequence's block table of the full blocks whose every position every
        head has pruned: what a paged cache could give back without compacting (not done yet)."""
        full = self.length // block_size
        if full == 0:
            return []
        layers, heads = self.retained.shape[:2]
        blocks = self.retained[:, :, : full * block_size].reshape(layers, heads, full, block_size)
        return (~blocks.any(-1).any(0).any(0)).nonzero().view(-1).tolist()

    def mean_norms(self) -> Tensor:
        """The rolling mean of each head's attention-output L2 norm over the decode steps so far."""
        return self.norm_sum / max(1, self.steps)

    def mask(self, n: int) -> Tensor:
        """[layers, kv_heads, n] bool: which of positions 0..n-1 each head attends. Positions not
        seen before (the prompt, the newest token) start retained."""
        self._grow(n)
        return self.retained[:, :, :n]

    def _grow(self, n: int) -> None:
        if n <= self.length:
            return
        if n > self.retained.shape[-1]:
            room = max(n, 2 * self.retained.shape[-1], 64)
            self.retained = _extend(self.retained, room, True)
            self.last_used = _extend(self.last_used, room, 0)
            self.score = _extend(self.score, room, 0.0)
        # A position arrives as just used: the idle rule counts from its arrival.
        self.retained[:, :, self.length : n] = True
        self.last_used[:, :, self.length : n] = self.steps
        self.score[:, :, self.length : n] = 0.0
        self.length = n

    def observe(self, n: int, weight_max: Tensor, weight_sum: Tensor, norms: Tensor) -> None:
        """One decode step over positions 0..n-1 (the newest is n-1): weight_max/weight_sum
        [layers, kv_heads, n] are the largest and the summed attention weight each position got
        from the query heads of each KV head's group; norms [layers, kv_heads] the mean L2 norm
        of those query heads' attention outputs. Then prune. A step seen already (the engine runs
        a batch again to isolate a fault) changes nothing."""
        if n <= self._observed_len:
            return
        self._observed_len = n
        self._grow(n)
        self.steps += 1
        t = self.steps
        retained = self.retained[:, :, :n]
        counts = retained.sum(-1, keepdim=True)
        used = retained & (weight_max.to(self.device).float() * counts >= self.settings.use_ratio)
        self.last_used[:, :, :n].masked_fill_(used, t)
        self.score[:, :, :n] += weight_sum.to(self.device).float()
        norms = norms.to(self.device, torch.float64)
        self.norm_sum += norms
        self.last_norm = norms
        self._prune(n, t)

    def _prune(self, n: int, t: int) -> None:
        s = self.settings
        retained = self.retained[:, :, :n]
        positions = torch.arange(n, device=self.device)
        protected = (positions < s.sinks) | (positions == n - 1)
        protected = protected.expand_as(retained)
        heads = retained.shape[:2]
        if s.policy == "mace":
            last_used = self.last_used[:, :, :n]
            drop = torch.zeros_like(retained)
            if s.window > 0:
                drop |= t - last_used > s.window
            if s.norm_threshold > 0:
                # A head whose output norm falls below tau is uninformative this step: it keeps
                # only what it used now (and its sinks).
                drop |= (self.last_norm < s.norm_threshold).unsqueeze(-1) & (last_used < t)
            retained &= ~(drop & ~protected)
            caps = head_capacities(self.mean_norms(), s.capacity * self.num_heads, limit=n)
            # Least recently used first; among equals, the oldest position.
            key = last_used * (n + 1) + positions
        elif s.policy == "window":
            caps = torch.full(heads, s.capacity, dtype=torch.long, device=self.device)
            key = positions.expand_as(retained)
        else:  # h2o: the recent half of the budget stays, the rest goes to the heaviest hitters
            caps = torch.full(heads, s.capacity, dtype=torch.long, device=self.device)
            protected = protected | (positions >= n - s.capacity // 2)
            key = self.score[:, :, :n]
        evict_over_capacity(retained, key, caps, protected)


def _extend(t: Tensor, size: int, fill: Any) -> Tensor:
    out = torch.full((*t.shape[:-1], size), fill, dtype=t.dtype, device=t.device)
    out[..., : t.shape[-1]] = t
    return out


def attend_observed(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """`edge_runtime.kv.paged_attention.attend`, same operations in the same order (so the same
    bits), also returning the attention weights [..., rows, keys]."""
    rows = q.shape[-2]
    if rows == 1:
        q = q.expand(*q.shape[:-2], 2, q.shape[-1]).contiguous()
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(weights, v)
    if rows == 1:
        return out[..., :1, :], weights[..., :1, :]
    return out, weights


class DecodePruning:
    """The pruned decode rows of one iteration. Built before the forward from each row's state;
    every layer's decode attention then masks with it and reports what it saw; after the last
    layer the states take the step and prune."""

    def __init__(self, rows: list[tuple[int, int, HeadPruning]], decode_mask: Tensor,
                 num_layers: int, num_kv_heads: int) -> None:
        """rows: (row in the decode batch, context length, state); decode_mask: [B, 1, 1, width]."""
        b, width = decode_mask.shape[0], decode_mask.shape[-1]
        device = decode_mask.device
        masks = decode_mask.expand(b, num_kv_heads, 1, width).unsqueeze(0).repeat(num_layers, 1, 1, 1, 1)
        for row, n, state in rows:
            masks[:, row, :, 0, :n] &= state.mask(n).to(device)
        self.masks = masks  # [layers, B, kv_heads, 1, width]
        self.rows = rows
        self.index = torch.tensor([row for row, _, _ in rows], dtype=torch.long, device=device)
        self.num_layers = num_layers
        self._max: list[Tensor] = []
        self._sum: list[Tensor] = []
        self._norm: list[Tensor] = []

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Decode attention of layer `layer` (q [B, kv_heads, group, d], k/v [B, kv_heads, width, d])
        over each head's retained positions; notes the pruned rows' weights and output norms."""
        out, weights = attend_observed(q, k, v, self.masks[layer])
        self.observe(layer, out, weights)
        return out

    def observe(self, layer: int, out: Tensor, weights: Tensor) -> None:
        """Notes layer `layer`'s decode attention (out [B, kv_heads, group, d], weights
        [B, kv_heads, group, width]) for the pruned rows; after the last layer, the states take it."""
        w = weights.index_select(0, self.index).float()  # [P, kv_heads, group, width]
        self._max.append(w.amax(2))
        self._sum.append(w.sum(2))
        self._norm.append(out.index_select(0, self.index).float().norm(dim=-1).mean(-1))
        if layer == self.num_layers - 1 and len(self._norm) == self.num_layers:
            self._commit()

    def _commit(self) -> None:
        wmax, wsum, norms = torch.stack(self._max), torch.stack(self._sum), torch.stack(self._norm)
        for j, (_, n, state) in enumerate(self.rows):
            state.observe(n, wmax[:, j, :, :n], wsum[:, j, :, :n], norms[:, j])
        self._max, self._sum, self._norm = [], [], []
