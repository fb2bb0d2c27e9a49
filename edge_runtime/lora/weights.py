"""One adapter's tensors: A [r, in] and B [out, r] per (layer, projection), in PEFT's convention.

Also the single-adapter applier (every row gets this adapter), which training uses with leaf
tensors that require grad. Knows shapes from the model config; nothing about files or users.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from edge_runtime.lora.config import ALL_TARGETS, AdapterError, LoraSettings
from edge_runtime.model.config import ModelConfig
from edge_runtime.model.llama import FUSED_TARGETS, linear, row_invariant_linear

Key = tuple[int, str]  # (layer index, projection name)


def projection_shape(cfg: ModelConfig, target: str) -> tuple[int, int]:
    """(in_features, out_features) of a projection, as Hugging Face's nn.Linear has them."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
        "qkv_proj": (h, q + 2 * kv),
        "gate_up_proj": (h, 2 * inter),
    }[target]


@dataclass
class LoraWeights:
    """A and B for every targeted projection of every layer; `delta` makes it a `LoraApplier`."""

    settings: LoraSettings
    a: dict[Key, Tensor]
    b: dict[Key, Tensor]

    @classmethod
    def init(
        cls, cfg: ModelConfig, settings: LoraSettings, seed: int = 0, dtype: torch.dtype = torch.float32
    ) -> LoraWeights:
        """PEFT's default init: A Kaiming-uniform (as nn.Linear), B zero, so the adapter starts
        as the identity and the policy equals the reference at step 0. The targets are named as
        the model names its projections (`LoraSettings.for_model`)."""
        settings = settings.for_model(cfg.fused_projections)
        gen = torch.Generator().manual_seed(seed)
        a: dict[Key, Tensor] = {}
        b: dict[Key, Tensor] = {}
        for layer in range(cfg.num_layers):
            for target in settings.target_modules:
                fan_in, fan_out = projection_shape(cfg, target)
                # kaiming_uniform_(a=sqrt(5)) bound = sqrt(6 / ((1 + 5) * fan_in)) = 1 / sqrt(fan_in)
                bound = 1.0 / math.sqrt(fan_in)
                a[(layer, target)] = (torch.rand(settings.rank, fan_in, generator=gen) * 2 - 1).mul_(bound).to(dtype)
                b[(layer, target)] = torch.zeros(fan_out, settings.rank, dtype=dtype)
        return cls(settings, a, b)

    def check_shapes(self, cfg: ModelConfig) -> None:
        """Raise AdapterError unless every tensor fits this model."""
        for (layer, target), a in self.a.items():
            part_of_fused = any(target in parts for parts in FUSED_TARGETS.values())
            if (target in FUSED_TARGETS and not cfg.fused_projections) or (part_of_fused and cfg.fused_projections):
                raise AdapterError(
                    f"adapter targets {target}, which this {cfg.model_type} model does not have: its projections are "
                    + ("fused (qkv_proj, gate_up_proj)" if cfg.fused_projections else "separate (q/k/v_proj, gate/up_proj)"))
            if layer >= cfg.num_layers or target not in self.settings.target_modules:
                raise AdapterError(f"adapter has weights for layer {layer} {target}, which this model/config lacks")
            fan_in, fan_out = projection_shape(cfg, target)
            b = self.b.get((layer, target))
            r = self.settings.rank
            if b is None or tuple(a.shape) != (r, fan_in) or tuple(b.shape) != (fan_out, r):
                raise AdapterError(
                    f"adapter weights for layer {layer} {target} have shapes {tuple(a.shape)}, "
                    f"{None if b is None else tuple(b.shape)}; this model needs ({r}, {fan_in}), ({fan_out}, {r})"
                )
        if set(self.a) != set(self.b):
            raise AdapterError("adapter has lora_A without lora_B (or the reverse) for some projection")

    def check_values(self) -> None:
        """Raise AdapterError if any tensor holds NaN or an infinity (it would poison every row
        the adapter serves)."""
        for key in self.keys():
            for which, tensor in (("lora_A", self.a[key]), ("lora_B", self.b.get(key))):
                if tensor is not None and not bool(torch.isfinite(tensor).all()):
                    raise AdapterError(f"adapter weights for layer {key[0]} {key[1]} {which} hold values that "
                                       "are not finite (NaN or infinity)")

    def validate(self, cfg: ModelConfig) -> None:
        """Everything an adapter read from outside must pass before it is served: rank and alpha
        within limits, shapes fit `cfg`, every value finite. AdapterError names the first failure."""
        self.settings.check_limits()
        self.check_shapes(cfg)
        self.check_values()

    def keys(self) -> list[Key]:
        return sorted(self.a)

    def parameters(self) -> list[Tensor]:
        """A then B for each key, in a fixed order (the optimizer's parameter order)."""
        return [t for k in self.keys() for t in (self.a[k], self.b[k])]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parameters())

    @property
    def num_params(self) -> int:
        return sum(t.numel() for t in self.parameters())

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> LoraWeights:
        """A detached copy (always a copy, so a published snapshot never aliases trainable leaves)."""

        def conv(t: Tensor) -> Tensor:
            return t.detach().to(dtype=dtype or t.dtype, device=device or t.device, copy=True)

        return LoraWeights(self.settings, {k: conv(v) for k, v in self.a.items()}, {k: conv(v) for k, v in self.b.items()})

    def trainable(self, device: torch.device | str | None = None) -> LoraWeights:
        """A float32 copy whose tensors are leaves that require grad, on `device` (the model's:
        the staged forward multiplies them with its activations) or where they are."""
        copy = self.to(torch.float32, device)
        for t in copy.parameters():
            t.requires_grad_(True)
        return copy

    def delta(self, layer: int, target: str, x: Tensor) -> Tensor | None:
        """`scale * B(A(x))` for every row of x ([T, in] -> [T, out])."""
        a = self.a.get((layer, target))
        if a is None:
            return None
        return lora_delta(x, a, self.b[(layer, target)], self.settings.scale)


def concat_ranks(parts: Sequence[LoraWeights]) -> LoraWeights:
    """One LoRA equal to the sum of `parts`: sum_i s_i B_i A_i = [s_1 B_1 | s_2 B_2 | ...] [A_1; A_2; ...],
    rank sum(r_i) and scale 1 (each part's scale folded into its B). A projection a part does
    not target gets zeros in that part's rows and columns, so every projection has the full
    rank. This is how the fleet adapter and a user's adapter are served together: every
    per-row LoRA path (the batched applier, the ONNX graph's stacked inputs) takes it as one
    adapter."""
    if not parts:
        raise ValueError("concat_ranks needs at least one adapter")
    rank = sum(p.settings.rank for p in parts)
    targets = tuple(t for t in ALL_TARGETS if any(t in p.settings.target_modules for p in parts))
    settings = LoraSettings(rank=rank, alpha=float(rank), target_modules=targets)
    first = next(iter(parts[0].a.values()))
    a: dict[Key, Tensor] = {}
    b: dict[Key, Tensor] = {}
    for key in sorted(set().union(*(p.a for p in parts))):
        shapes = [(p.a[key].shape[1], p.b[key].shape[0]) for p in parts if key in p.a]
        fan_in, fan_out = shapes[0]
        a_parts, b_parts = [], []
        for p in parts:
            r = p.settings.rank
            if key in p.a:
                a_parts.append(p.a[key].detach().to(first.dtype))
                b_parts.append(p.b[key].detach().to(first.dtype) * p.settings.scale)
            else:
                a_parts.append(first.new_zeros(r, fan_in))
                b_parts.append(first.new_zeros(fan_out, r))
        a[key] = torch.cat(a_parts, 0)
        b[key] = torch.cat(b_parts, 1)
    return LoraWeights(settings, a, b)


def lora_delta(x: Tensor, a: Tensor, b: Tensor, scale: float, dropout: float = 0.0,
               row_invariant: bool = False) -> Tensor:
    """PEFT's LoRA term `B(A(dropout(x))) * scale`, computed in the adapter's dtype and returned
    in x's, so a bf16 base can carry float32 master weights while training. `row_invariant`: each
    row's bits a function of that row alone, whatever the row count (`row_invariant_linear`)."""
    h = x if x.dtype == a.dtype else x.to(a.dtype)
    if dropout:
        h = F.dropout(h, dropout, training=True)
    # `linear`, not F.linear: a group of one row must round like the same row in a bigger group,
    # so a user's greedy output does not depend on who shares the batch.
    lin = row_invariant_linear if row_invariant else linear
    out = lin(lin(h, a), b) * scale
    return out if out.dtype == x.dtype else out.to(x.dtype)


class TrainingLora:
    """The applier used while training: the trainable weights on every row, with dropout."""

    def __init__(self, weights: LoraWeights, dropout: float | None = None) -> None:
        self.weights = weights
        self.dropout = weights.settings.dropout if dropout is None else dropout

    def delta(self, layer: int, target: str, x: Tensor) -> Tensor | None:
        w = self.weights
        a = w.a.get((layer, target))
        if a is None:
            return None
        return lora_delta(x, a, w.b[(layer, target)], w.settings.scale, self.dropout)


class SummedLora:
    """Several appliers on every row, their deltas added: while training a user's adapter, the
    frozen fleet adapter beneath the trainable one (two stacks, not one concatenated copy: the
    trainable leaves would be copied on every call)."""

    def __init__(self, *appliers: TrainingLora | LoraWeights) -> None:
        self.appliers = appliers

    def delta(self, layer: int, target: str, x: Tensor) -> Tensor | None:
        out: Tensor | None = None
        for applier in self.appliers:
            d = applier.delta(layer, target, x)
            if d is not None:
                out = d if out is None else out + d
        return out


def draws_dropout(applier: object) -> bool:
    """Whether `applier` (None, LoRA weights, a `TrainingLora` or a `SummedLora` of them) draws
    dropout masks: a recompute must then replay each window's own draw (train/staged.py)."""
    if isinstance(applier, SummedLora):
        return any(draws_dropout(a) for a in applier.appliers)
    return bool(getattr(applier, "dropout", 0.0))
