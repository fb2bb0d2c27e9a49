"""The KV block pool: allocation, reference counts, prefix-cache reuse and LRU eviction."""

from __future__ import annotations

import pytest

from edge_runtime.kv.block_pool import BlockPool, block_hash


def test_allocate_and_release_return_blocks_to_the_pool() -> None:
    pool = BlockPool(4, 16)
    blocks = [pool.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3] and pool.num_free == 0
    with pytest.raises(RuntimeError):
        pool.allocate()
    for b in blocks:
        pool.release(b)
    assert pool.num_free == 4


def test_double_release_is_detected() -> None:
    pool = BlockPool(2, 16)
    b = pool.allocate()
    pool.release(b)
    with pytest.raises(RuntimeError):
        pool.release(b)


def test_registered_block_is_reused_after_release_and_counts_a_hit() -> None:
    pool = BlockPool(4, 4)
    h = block_hash(None, [1, 2, 3, 4])
    b = pool.allocate()
    pool.register(b, h)
    pool.release(b)
    assert pool.num_cached_free == 1
    assert pool.match(h) == b
    assert pool.ref_count[b] == 1 and b not in pool.free
    assert pool.stats.hit_rate == 1.0


def test_shared_block_needs_every_reference_released() -> None:
    pool = BlockPool(2, 4)
    h = block_hash(None, [9, 9, 9, 9])
    b = pool.allocate()
    pool.register(b, h)
    assert pool.match(h) == b  # a second sequence shares it
    pool.release(b)
    assert pool.num_free == 1  # still held by one
    pool.release(b)
    assert pool.num_free == 2


def test_uncached_blocks_are_handed_out_before_cached_ones_and_lru_evicts_oldest() -> None:
    pool = BlockPool(3, 4)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    ha, hb = block_hash(None, [1] * 4), block_hash(None, [2] * 4)
    pool.register(a, ha)
    pool.register(b, hb)
    pool.release(a)  # freed first: least recently used
    pool.release(b)
    pool.release(c)  # holds no prefix: handed out first
    assert pool.allocate() == c
    assert pool.allocate() == a  # evicts the oldest cached prefix
    assert pool.match(ha) is None
    assert pool.match(hb) == b
    assert pool.stats.evictions == 1


def test_hash_depends_on_parent_and_adapter_salt() -> None:
    tokens = [5, 6, 7, 8]
    assert block_hash(None, tokens) != block_hash(b"x", tokens)
    assert block_hash(None, tokens, "alice@1") != block_hash(None, tokens, "alice@2")
    assert block_hash(None, tokens) == block_hash(None, list(tokens))


def test_disabled_prefix_cache_never_matches() -> None:
    pool = BlockPool(2, 4, enable_prefix_cache=False)
    h = block_hash(None, [1, 2, 3, 4])
    b = pool.allocate()
    pool.register(b, h)
    pool.release(b)
    assert pool.match(h) is None


def test_an_erasure_drops_the_blocks_only_that_users_prompts_hold() -> None:
    """GDPR: a cached block holds the prompts of those who registered or reused it; erasing one of
    them drops the blocks no one else's prompt holds (free ones handed out first and reported
    idle; a held one stays with its holder but is no longer matched), and keeps shared ones."""
    idle: list[int] = []
    pool = BlockPool(4, 4, on_idle=idle.extend)
    mine, shared, held = pool.allocate(), pool.allocate(), pool.allocate()
    h_mine, h_shared, h_held = (block_hash(None, [t] * 4) for t in (1, 2, 3))
    for block, h in ((mine, h_mine), (shared, h_shared), (held, h_held)):
        pool.register(block, h)
        pool.claim(block, "alice")
    pool.claim(shared, "bob")  # bob's prompt reused it: his data too
    pool.release(mine)
    pool.release(shared)  # `held` stays held by a running request of alice's
    idle.clear()

    assert pool.forget("") == 0  # nobody: nothing
    assert pool.forget("alice") == 2
    assert pool.match(h_mine) is None and pool.match(h_held) is None
    assert idle == [mine]  # free and holding nothing now: its memory may go back
    assert pool.allocate() == mine  # handed out before the block still caching bob's prefix
    assert pool.match(h_shared) == shared
    pool.release(held)  # alice's request ends: the block goes back holding nothing
    assert pool.hash_of[held] is None and pool.forget("bob") == 1
    assert pool.forget("alice") == 0 and not pool.owners
