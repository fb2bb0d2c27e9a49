"""Prefix reuse finer than a block (row-invariant backends): donors (cached full blocks and kept
tails of finished sequences), the longest shared run, the copy into a fresh block, eviction and
erasure of tails, and what `match_prefix` / `release_blocks` do with a sequence's blocks."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from edge_runtime.kv.block_pool import BlockPool, block_hash
from edge_runtime.kv.cache import KVCache
from edge_runtime.sampling import SamplingParams
from edge_runtime.sched.prefix import match_prefix, register_full_blocks, release_blocks
from edge_runtime.sequence import Request, Sequence

SIZE = 4


class Copies:
    """A `copy_rows` that records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, src: int, dst: int, rows: int) -> None:
        self.calls.append((src, dst, rows))


def _seq(tokens: list[int], owner: str = "", computed: int = 0) -> Sequence:
    request = Request("r", "", list(tokens), SamplingParams(max_tokens=4), 0.0, owner=owner)
    seq = Sequence(0, request, 0, list(tokens), decoder=None)  # type: ignore[arg-type]
    request.seqs.append(seq)
    seq.num_computed = computed
    return seq


def _finished(pool: BlockPool, tokens: list[int], computed: int, owner: str = "", salt: str = "") -> list[int]:
    """A sequence that computed `computed` rows of `tokens`, registered its full blocks and was
    released with its tail kept; returns its blocks."""
    seq = _seq(tokens, owner, computed)
    seq.block_table = [pool.allocate() for _ in range(-(-computed // SIZE))]
    register_full_blocks(seq, pool, salt)
    blocks = list(seq.block_table)
    release_blocks(seq, pool, tail_salt=salt)
    return blocks


def test_a_finished_sequences_partial_last_block_stays_cached_without_being_given_back():
    idle: list[list[int]] = []
    pool = BlockPool(8, SIZE, on_idle=idle.append)
    blocks = _finished(pool, [1, 2, 3, 4, 5, 6], computed=6)
    assert pool.num_cached_free == 2 and idle == []  # the full block and the 2-row tail
    assert pool.best_donor(pool.hash_of[blocks[0]], "", [5, 6, 9], "") == (blocks[1], 2)
    # Without a tail salt (a non-invariant backend) the tail is handed back as before.
    other = _seq([7, 8, 9], computed=3)
    other.block_table = [block := pool.allocate()]
    release_blocks(other, pool)
    assert idle == [[block]] and pool.num_cached_free == 2


def test_the_donor_sharing_the_longest_run_wins_full_blocks_included():
    pool = BlockPool(8, SIZE)
    _finished(pool, [1, 2, 9, 9, 9], computed=5)  # full block [1, 2, 9, 9], tail [9]
    tail = _finished(pool, [1, 2, 3], computed=3)[0]  # a tail [1, 2, 3] under the root
    assert pool.best_donor(None, "", [1, 2, 3, 4], "") == (tail, 3)
    full = pool.cached[block_hash(None, [1, 2, 9, 9])]
    assert pool.best_donor(None, "", [1, 2, 9, 7], "") == (full, 3)
    assert pool.best_donor(None, "", [5, 2, 3, 4], "") == (-1, 0)
    assert pool.best_donor(None, "other-adapter", [1, 2, 3, 4], "") == (-1, 0)  # the salt separates


def test_match_copies_the_shared_rows_into_a_fresh_block_and_leaves_the_donor_alone():
    pool = BlockPool(8, SIZE)
    first = _finished(pool, [1, 2, 3, 4, 5, 6, 7], computed=6)  # answer rows 4..5 in the tail
    copies = Copies()
    seq = _seq([1, 2, 3, 4, 5, 6, 8, 9])  # diverges at row 6
    match_prefix(seq, pool, "", copy_rows=copies)
    assert seq.block_table[0] == first[0] and seq.num_computed == 6
    fresh = seq.block_table[1]
    assert fresh not in first and copies.calls == [(first[1], fresh, 2)]
    assert pool.hash_of[fresh] is None and pool.ref_count[first[1]] == 0  # the donor stays cached, unheld
    assert pool.stats.partial_hits == 1 and pool.stats.partial_rows == 2


def test_an_identical_prompt_leaves_only_its_last_token_to_compute():
    pool = BlockPool(8, SIZE)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    _finished(pool, prompt + [11, 12], computed=8)  # its answer's first token computed too
    seq = _seq(prompt)
    match_prefix(seq, pool, "", copy_rows=Copies())
    assert seq.num_computed == len(prompt) - 1
    # Without `copy_rows` (non-invariant backends) reuse stops before the last two, on a full block.
    again = _seq(prompt)
    match_prefix(again, pool, "", amount=len(prompt))
    assert again.num_computed == SIZE and len(again.block_table) == 1


def test_a_prompt_of_whole_blocks_reuses_all_but_its_last_block_then_its_rows_but_the_last():
    pool = BlockPool(8, SIZE)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    _finished(pool, prompt + [9], computed=8)
    seq = _seq(prompt)
    copies = Copies()
    match_prefix(seq, pool, "", copy_rows=copies)
    assert seq.num_computed == 7 and len(copies.calls) == 1 and copies.calls[0][2] == 3


def test_the_copy_is_bit_equal_and_the_donor_unchanged():
    cfg = SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=8)  # what the slab's shape reads
    cache = KVCache(cfg, 4, SIZE, torch.float32, "cpu")  # type: ignore[arg-type]
    cache.data.copy_(torch.randn(cache.data.shape))
    before = cache.data.clone()
    cache.copy_rows(1, 3, 3)
    assert torch.equal(cache.data[:, :, 12:15], before[:, :, 4:7])
    assert torch.equal(cache.data[:, :, 15], before[:, :, 15])  # rows past the copy untouched
    assert torch.equal(cache.data[:, :, :12], before[:, :, :12])


def test_no_copy_when_no_block_is_free_but_the_donor():
    pool = BlockPool(2, SIZE)
    full, tail = _finished(pool, [1, 2, 3, 4, 5], computed=5)  # both blocks cached, free
    seq = _seq([1, 2, 3, 4, 5, 6])
    copies = Copies()
    match_prefix(seq, pool, "", copy_rows=copies)  # takes the full block; the tail is all that is left
    assert seq.block_table == [full] and seq.num_computed == SIZE and copies.calls == []
    assert pool.ref_count[tail] == 0 and pool.best_donor(pool.hash_of[full], "", [5], "") == (tail, 1)


def test_tails_are_evicted_before_their_prefix_and_given_back_then():
    idle: list[list[int]] = []
    pool = BlockPool(3, SIZE, on_idle=idle.append)
    full, tail = _finished(pool, [1, 2, 3, 4, 5], computed=5)
    assert pool.allocate() not in (full, tail)  # the never-used block first
    assert pool.allocate() == tail and pool.best_donor(pool.hash_of[full], "", [5], "") == (-1, 0)
    assert pool.evict_cached(1) == 1 and idle == [[full]] and pool.donors == {}


def test_forget_drops_a_users_tails_and_keeps_them_from_other_users():
    idle: list[list[int]] = []
    pool = BlockPool(8, SIZE, on_idle=idle.append)
    full, tail = _finished(pool, [1, 2, 3, 4, 5, 6], computed=6, owner="alice")
    parent = pool.hash_of[full]
    # Nobody else gets alice's rows finer than a whole block (a timing probe would read her
    # prompt a token at a time), not even requests that name no user.
    assert pool.best_donor(parent, "", [5, 6, 7], "bob") == (-1, 0)
    assert pool.best_donor(parent, "", [5, 6, 7], "") == (-1, 0)
    assert pool.best_donor(parent, "", [5, 6, 7], "alice") == (tail, 2)
    assert pool.forget("alice") == 2
    assert sorted(idle[0]) == sorted([full, tail]) and pool.donors == {} and pool.num_cached_free == 0


def test_blocks_no_user_holds_are_donors_for_everyone():
    pool = BlockPool(8, SIZE)
    _, tail = _finished(pool, [1, 2, 3, 4, 5, 6], computed=6)
    parent = block_hash(None, [1, 2, 3, 4])
    assert pool.best_donor(parent, "", [5, 6], "bob") == (tail, 2)


def test_an_identical_tail_cached_already_is_a_plain_release():
    idle: list[list[int]] = []
    pool = BlockPool(8, SIZE, on_idle=idle.append)
    (first,) = _finished(pool, [1, 2], computed=2)
    (second,) = _finished(pool, [1, 2], computed=2)
    assert pool.hash_of[first] is not None and pool.hash_of[second] is None and idle == [[second]]


def test_compacted_or_pruned_sequences_keep_no_tail():
    pool = BlockPool(8, SIZE)
    seq = _seq([1, 2, 3, 4, 5, 6], computed=6)
    seq.block_table = [pool.allocate(), pool.allocate()]
    register_full_blocks(seq, pool, "")
    seq.kv_pruning = object()
    release_blocks(seq, pool, tail_salt="")
    assert pool.num_cached_free == 1  # the full (prompt) block only


def test_a_kept_tail_is_given_back_when_evicted_under_memory_pressure():
    idle: list[list[int]] = []
    pool = BlockPool(4, SIZE, on_idle=idle.append)
    full, tail = _finished(pool, [1, 2, 3, 4, 5], computed=5)
    assert idle == [] and pool.evict_cached(1) == 1 and idle == [[tail]]  # the tail goes before its prefix
    assert pool.best_donor(pool.hash_of[full], "", [5], "") == (-1, 0) and pool.num_cached_free == 1
