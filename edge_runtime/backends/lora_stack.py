"""Stacks the adapters of one step into the graph's LoRA inputs: per layer and fused site, A^T
of every adapter side by side ([in, targets * M]) and scale * B^T block-diagonally below each
other ([targets * M, out]); column c (mod M) belongs to adapter `lora_columns[c]`.

Built once per set of adapter versions (versions are immutable) and cached, so steady decoding
re-stacks nothing and a newly published version needs no graph rebuild.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from edge_runtime.backends.onnx_spec import lora_sites
from edge_runtime.lora.weights import LoraWeights, projection_shape
from edge_runtime.model.config import ModelConfig


def stack_adapters(cfg: ModelConfig, adapters: Sequence[LoraWeights]) -> dict[str, np.ndarray]:
    """The `lora_columns` and `lora_a.*` / `lora_b.*` inputs for these adapters (in slot order)."""
    ranks = [w.settings.rank for w in adapters]
    # With no adapter, one all-zero column owned by no row (ONNX Runtime's Split and TensorRT
    # both refuse zero-sized dimensions); its mask is 0 everywhere, so the delta is exactly 0.
    m = max(1, sum(ranks))
    offsets = np.concatenate([[0], np.cumsum(ranks)]).astype(int)
    columns = np.repeat(np.arange(len(adapters), dtype=np.int64), ranks) if adapters else np.array([-2], np.int64)
    out: dict[str, np.ndarray] = {"lora_columns": columns}
    for site, targets in lora_sites(cfg).items():
        k = len(targets)
        fan_in = projection_shape(cfg, targets[0])[0]
        fan_out = sum(projection_shape(cfg, t)[1] for t in targets)
        a = np.zeros((cfg.num_layers, fan_in, k * m), np.float32)
        b = np.zeros((cfg.num_layers, k * m, fan_out), np.float32)
        for layer in range(cfg.num_layers):
            out_off = 0
            for ti, target in enumerate(targets):
                width = projection_shape(cfg, target)[1]
                for j, w in enumerate(adapters):
                    wa = w.a.get((layer, target))
                    if wa is not None:
                        col = ti * m + offsets[j]
                        a[layer, :, col : col + ranks[j]] = _np(wa).T
                        b[layer, col : col + ranks[j], out_off : out_off + width] = (
                            _np(w.b[(layer, target)]).T * w.settings.scale
                        )
                out_off += width
        # One array per site; each layer's input is a contiguous view of it.
        for layer in range(cfg.num_layers):
            out[f"lora.{layer}.{site}.a"] = a[layer]
            out[f"lora.{layer}.{site}.b"] = b[layer]
    return out


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy()


class LoraStackCache:
    """The last few stacks, keyed by the tuple of adapter versions in slot order."""

    def __init__(self, cfg: ModelConfig, capacity: int = 4) -> None:
        self.cfg = cfg
        self.capacity = capacity
        self._stacks: OrderedDict[tuple[Hashable, ...], dict[str, np.ndarray]] = OrderedDict()

    def get(self, key: tuple[Hashable, ...], adapters: Sequence[LoraWeights]) -> dict[str, np.ndarray]:
        stack = self._stacks.get(key)
        if stack is None:
            stack = stack_adapters(self.cfg, adapters)
            self._stacks[key] = stack
            while len(self._stacks) > self.capacity:
                self._stacks.popitem(last=False)
        else:
            self._stacks.move_to_end(key)
        return stack
