"""Joins the prefix cache's disk tier to the KV slab: a reused prefix's blocks are copied out to
`PrefixStore`, and a prefix the pool no longer holds is read back into fresh blocks (after a
restart, or an eviction) instead of being recomputed. Called by the scheduler's prefix matching.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge_runtime.kv.block_pool import BlockPool
from edge_runtime.kv.cache import KVCache
from edge_runtime.kv.prefix_store import PrefixStore

log = logging.getLogger(__name__)

# Blocks a restore leaves free for the sequence's own new tokens: reading a prefix back is worth
# it only while the pool is not so full that the sequence then cannot be admitted anyway.
FREE_RESERVE = 2


class PrefixTier:
    def __init__(self, store: PrefixStore, cache: KVCache, pool: BlockPool) -> None:
        self.store = store
        self.cache = cache
        self.pool = pool
        layers, kinds, _, heads, dim = cache.data.shape
        self.shape = (layers, kinds, pool.block_size, heads, dim)
        self.block_bytes = int(np.prod(self.shape)) * cache.data.element_size()

    @classmethod
    def open(cls, root: str, limit_bytes: int, cache: KVCache, pool: BlockPool,
             identity: Callable[[], dict[str, Any]]) -> PrefixTier:
        """The tier under `root` for the model, weights and weight format `identity()` names (called
        only when the tier is on); a tier that keeps nothing when `root` is "" or the bound is 0,
        or the folder cannot be used."""
        if not root or limit_bytes <= 0 or not pool.enable_prefix_cache:
            return NoPrefixTier(pool)
        key = hashlib.blake2b(json.dumps(identity(), sort_keys=True).encode(), digest_size=12).hexdigest()
        layers, kinds, _, heads, dim = cache.data.shape
        shape = (layers, kinds, pool.block_size, heads, dim)
        try:
            store = PrefixStore(Path(root), key, shape, str(cache.data.dtype).removeprefix("torch."), limit_bytes)
        except OSError as exc:
            log.warning("prefix store at %s unavailable (%s): prefixes stay in memory only", root, exc)
            return NoPrefixTier(pool)
        return cls(store, cache, pool)

    def _slots(self, block: int) -> slice:
        size = self.pool.block_size
        return slice(block * size, (block + 1) * size)

    def read_block(self, block: int) -> bytes:
        data = self.cache.data[:, :, self._slots(block)].detach().to("cpu").contiguous()
        # numpy has no bfloat16: the raw bytes through a same-width integer view.
        if data.dtype == torch.bfloat16:
            data = data.view(torch.int16)
        return data.numpy().tobytes()

    def write_block(self, block: int, payload: bytes) -> None:
        dtype = self.cache.data.dtype
        raw = torch.frombuffer(bytearray(payload), dtype=torch.int16 if dtype == torch.bfloat16 else dtype)
        values = raw.view(dtype) if dtype == torch.bfloat16 else raw
        self.cache.data[:, :, self._slots(block)].copy_(values.view(self.shape).to(self.cache.data.device))

    def restore(self, owner: str, digest: bytes, parent: bytes | None, tokens: Sequence[int], salt: str) -> int | None:
        """A fresh block holding the stored prefix block `digest` (registered in the prefix cache
        and held once, as a match would), or None."""
        if self.pool.num_free <= FREE_RESERVE or not self.store.holds(owner, digest):
            return None
        stored = self.store.load(owner, digest, self.block_bytes)
        if stored is None or stored.parent != parent or stored.tokens != list(tokens) or stored.salt != salt:
            return None
        block = self.pool.allocate()
        try:
            self.write_block(block, stored.payload)
        except (RuntimeError, ValueError) as exc:
            self.pool.release(block)
            log.warning("prefix store: a block could not be read back (%s)", exc)
            return None
        self.pool.register(block, digest)
        return block

    def remember(self, owner: str, blocks: Sequence[tuple[int, bytes, bytes | None, Sequence[int], str]]) -> None:
        """Blocks (block, hash, parent, tokens, salt) a request just reused from memory: those not on
        disk yet for `owner` are copied out now (their contents are final) and written in the
        background."""
        for block, digest, parent, tokens, salt in blocks:
            if not self.store.holds(owner, digest):
                self.store.save(owner, digest, parent, tokens, salt, self.read_block(block))

    def forget(self, owner: str) -> tuple[int, int]:
        """Erase `owner`'s prefixes: the blocks only their prompts hold leave the in-memory cache,
        and their files the disk. Returns (blocks dropped from memory, files removed)."""
        return self.pool.forget(owner), self.store.erase(owner)

    def close(self) -> None:
        self.store.close()

    def stats(self) -> dict[str, Any]:
        s = self.store.stats
        return {"prefix_store_blocks": len(self.store), "prefix_store_bytes": self.store.nbytes,
                "prefix_store_written_blocks": s.written_blocks, "prefix_store_restored_blocks": s.restored_blocks,
                "prefix_store_refused_files": s.refused_files, "prefix_store_evicted_blocks": s.evicted_blocks}


class NoPrefixTier(PrefixTier):
    """The tier switched off: nothing is kept, nothing is read back (the pool's in-memory cache
    still answers an erasure)."""

    def __init__(self, pool: BlockPool) -> None:  # no store, no slab
        self.pool = pool

    def restore(self, owner: str, digest: bytes, parent: bytes | None, tokens: Sequence[int], salt: str) -> int | None:
        return None

    def remember(self, owner: str, blocks: Sequence[tuple[int, bytes, bytes | None, Sequence[int], str]]) -> None:
        pass

    def forget(self, owner: str) -> tuple[int, int]:
        return self.pool.forget(owner), 0

    def close(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}


def weights_digest(backend: Any, model: Any) -> str:
    """Digest of the weights whose keys and values the slab holds: the backend's own when it took
    one (the ONNX backends key their exports by it), else computed once."""
    digest = getattr(backend, "weights_digest", None)
    if digest:
        return str(digest)
    from edge_runtime.backends.onnx_export import model_hash

    return model_hash(model)
