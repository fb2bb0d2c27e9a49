"""The KV slab's resident memory follows the blocks that hold something (what the memory ledger
counts), not the slab's size: pages are taken on first write and given back when a block idles."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import torch

from edge_runtime.kv.block_pool import BlockPool
from edge_runtime.kv.cache import KVCache, bytes_per_block
from edge_runtime.model.config import ModelConfig
from tests.fresh_process import in_fresh_process

MiB = 1 << 20


def _anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def slab_resident(cache: KVCache) -> int:
    """Resident bytes of the slab's own pages (mincore over its range), whatever else the process
    allocates beside it: threads that earlier tests left keep allocating in a long session, and
    the kernel may merge the slab's mapping with its anonymous neighbours."""
    page = mmap.PAGESIZE
    pages = -(-cache.nbytes // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(cache.data.data_ptr(), pages * page, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore over the KV slab failed")
    return sum(v & 1 for v in vec) * page


def _cfg() -> ModelConfig:
    # 4 layers x 8 kv heads x 64 dims in float32: a block of 16 tokens is 32 KiB per layer plane.
    from transformers import LlamaConfig

    return ModelConfig.from_hf(LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=512,
                                           num_hidden_layers=4, num_attention_heads=8,
                                           num_key_value_heads=8, head_dim=64, max_position_embeddings=4096))


def test_kv_slab_is_resident_only_for_blocks_that_hold_keys() -> None:
    # In a fresh interpreter: the process's resident memory is the measurement, and threads that
    # earlier tests left (pools, pagers, writers) allocate beside it in a long test session.
    in_fresh_process(__name__, "_slab_follows_the_blocks")


def _slab_follows_the_blocks() -> None:
    cfg = _cfg()
    num_blocks = 256  # 256 blocks x 4 layers x 2 x 32 KiB = 64 MiB
    before = _anon()
    cache = KVCache(cfg, num_blocks, 16, torch.float32, "cpu")
    assert cache.nbytes == 64 * MiB == num_blocks * bytes_per_block(cfg, 16, torch.float32)
    assert _anon() - before < 8 * MiB, "an empty slab must not be resident"
    assert float(cache.data.abs().sum()) == 0.0  # reads as zeros, like torch.zeros

    cache.data.fill_(1.0)
    assert _anon() - before > 60 * MiB
    pool = BlockPool(num_blocks, 16, enable_prefix_cache=True, on_idle=cache.release_blocks)
    blocks = [pool.allocate() for _ in range(num_blocks)]
    for block in blocks[: num_blocks // 2]:
        pool.release(block)  # no cached prefix: idle at once
    assert _anon() - before < 40 * MiB
    k, v = cache.layer(0)
    assert float(k[: 16 * (num_blocks // 2)].abs().sum()) == 0.0  # released blocks read as zeros
    assert float(v[16 * (num_blocks // 2):].abs().min()) == 1.0  # blocks still held keep their values


def test_evicted_prefix_blocks_are_given_back() -> None:
    cfg = _cfg()
    cache = KVCache(cfg, 256, 16, torch.float32, "cpu")
    idle: list[int] = []
    pool = BlockPool(256, 16, enable_prefix_cache=True, on_idle=lambda b: (idle.extend(b), cache.release_blocks(b)))
    block = pool.allocate()
    cache.data[:, :, block * 16:(block + 1) * 16] = 2.0
    pool.register(block, b"prefix")
    pool.release(block)
    assert idle == []  # still caches a prefix: its memory is the ledger's prefix-cache entry
    assert float(cache.data[:, :, block * 16:(block + 1) * 16].min()) == 2.0
    assert pool.evict_cached(1) == 1
    assert idle == [block]
    assert float(cache.data[:, :, block * 16:(block + 1) * 16].abs().max()) == 0.0
