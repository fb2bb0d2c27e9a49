"""Batched multi-LoRA: one flat batch whose rows belong to different adapters (or none).

Rows are grouped by adapter and each group gets `scale * (x @ A^T) @ B^T` (the gather-compute-
scatter of S-LoRA/Punica, without their CUDA kernels: on a CPU or a Jetson at edge batch sizes a
few grouped GEMMs are as fast). Base-model rows get no delta at all, so their output does not
depend on which adapters share the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import Tensor

from edge_runtime.lora.weights import LoraWeights, lora_delta

R = TypeVar("R")


class BatchedLoraApplier:
    def __init__(self, groups: list[tuple[LoraWeights, Tensor | None]], num_rows: int,
                 row_invariant: bool = False) -> None:
        """`groups`: (adapter, row indices); indices None means every row of the batch.
        `row_invariant`: a row's delta does not depend on how many rows its group has (`lora_delta`)."""
        self.groups = groups
        self.num_rows = num_rows
        self.row_invariant = row_invariant

    @classmethod
    def from_rows(
        cls, runs: Sequence[tuple[LoraWeights | None, int]], device: torch.device | str = "cpu",
        row_invariant: bool = False,
    ) -> BatchedLoraApplier | None:
        """`runs`: (adapter or None for the base model, row count) per batch item, in row order.
        Returns None when no row has an adapter (the layers then skip LoRA entirely)."""
        rows_of: dict[int, list[int]] = {}
        weights_of: dict[int, LoraWeights] = {}
        start = 0
        for weights, n in runs:
            if weights is not None:
                rows_of.setdefault(id(weights), []).extend(range(start, start + n))
                weights_of[id(weights)] = weights
            start += n
        if not rows_of:
            return None
        if len(rows_of) == 1 and len(next(iter(rows_of.values()))) == start:
            return cls([(next(iter(weights_of.values())), None)], start, row_invariant)
        groups = [
            (weights_of[k], torch.tensor(rows, dtype=torch.long, device=device)) for k, rows in rows_of.items()
        ]
        return cls(groups, start, row_invariant)

    def delta(self, layer: int, target: str, x: Tensor) -> Tensor | None:
        out: Tensor | None = None
        for weights, rows in self.groups:
            a = weights.a.get((layer, target))
            if a is None:
                continue
            b = weights.b[(layer, target)]
            scale = weights.settings.scale
            if rows is None:
                return lora_delta(x, a, b, scale, row_invariant=self.row_invariant)
            if out is None:
                out = x.new_zeros(x.shape[0], b.shape[0])
            out.index_copy_(0, rows, lora_delta(x.index_select(0, rows), a, b, scale, row_invariant=self.row_invariant))
        return out


def applier_for(
    runs: Sequence[tuple[R | None, int]], weights_of: Callable[[R], LoraWeights], device: torch.device | str = "cpu",
    row_invariant: bool = False,
) -> BatchedLoraApplier | None:
    """Build the applier from per-item adapter references (e.g. `AdapterRef`s resolved through
    the registry's cache); items sharing a reference share one group."""
    resolved: dict[R, LoraWeights] = {}
    weighted: list[tuple[LoraWeights | None, int]] = []
    for ref, n in runs:
        if ref is None:
            weighted.append((None, n))
            continue
        if ref not in resolved:
            resolved[ref] = weights_of(ref)
        weighted.append((resolved[ref], n))
    return BatchedLoraApplier.from_rows(weighted, device, row_invariant)
