"""The weights' digest fed a bounded slab of rows at a time equals the digest of each tensor's whole
`tobytes()` copy, for every layout the models hold (float, bfloat16, a reordered view, blocks)."""

from __future__ import annotations

import hashlib

import torch

from edge_runtime.backends.onnx_export import feed_bytes


def _whole(tensors):
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(t.view(torch.int16).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes())
    return h.hexdigest()


def _slabs(tensors, slab_bytes):
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        feed_bytes(h, t, slab_bytes)
    return h.hexdigest()


def test_slabs_give_the_whole_copys_digest():
    g = torch.Generator().manual_seed(0)
    square = torch.randn(37, 19, generator=g)
    tensors = [
        square,
        torch.randn(11, 5, generator=g).to(torch.bfloat16),
        square[torch.randperm(37, generator=g)][:, 3:17],  # a reordered, sliced view (q/k rows in place)
        square.t(),  # not contiguous
        torch.randint(0, 256, (9, 3, 7), generator=g, dtype=torch.uint8),  # raw block bytes, 3-D
        torch.tensor(2.5),  # 0-dim
        torch.zeros(0, 4),  # empty
        torch.randn(64, generator=g),  # 1-D (a norm)
    ]
    for slab in (1, 7, 64, 1 << 20):  # from a row at a time (a slab under one row) to whole tensors
        assert _slabs(tensors, slab) == _whole(tensors)
