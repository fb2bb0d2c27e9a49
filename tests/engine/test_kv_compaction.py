"""Compaction of pruned KV (edge_runtime.kv.compaction): a pruned sequence's retained entries packed
into fewer blocks give the same tokens and logits, bit for bit, as masking alone, and the blocks
(and their pages) go back to the pool, which the scheduler and the ledger then count as free."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edge_runtime import SamplingParams
from edge_runtime.memory import MemoryKind
from edge_runtime.model.testing import make_tiny_model_dir

from .helpers import _set_prompt_ids, make_engine

PROMPTS = [list(range(40, 40 + 37)), list(range(100, 100 + 21)), list(range(7, 7 + 52))]
STEPS = 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-compact"), random_norms=True, seed=3,
                               num_heads=4, num_kv_heads=2, num_layers=2)


def _run(engine, prompts, steps, compacting=True, preempt=None, stagger=0, n=1):
    """Greedy-decode every prompt (`n` candidates each) in shared iterations; returns each
    sequence's logits [steps, vocab], its tokens, and the most blocks the pool held at once.
    `preempt`: (iteration, prompt index) preempted to recompute. `stagger`: iterations between
    adding prompts (so a later one can hit an earlier one's cached prompt blocks)."""
    if not compacting:
        engine._compact_pruned_kv = lambda: None
    rows: dict[tuple[str, int], list[torch.Tensor]] = {}
    execute = engine.backend.execute

    def spy(batch, lora=None):
        out = execute(batch)
        sampled = [(item.seq.request.request_id, item.seq.index) for item in batch.items if item.samples]
        for rid, row in zip(sampled, out, strict=True):
            rows.setdefault(rid, []).append(row.detach().cpu().clone())
        return out

    engine.backend.execute = spy
    ids, outputs, most, iteration = [], {}, 0, 0
    pending = list(prompts)
    while pending or engine.has_unfinished():
        if pending and iteration % (stagger + 1) == 0:
            prompt = pending.pop(0)
            rid = engine.add_request(engine.tokenizer.hf.decode(prompt), SamplingParams(max_tokens=steps, ignore_eos=True, n=n))
            _set_prompt_ids(engine, rid, prompt)
            ids.append(rid)
        if preempt is not None and iteration == preempt[0]:
            seq = engine.requests[ids[preempt[1]]].seqs[0]
            engine.scheduler._preempt(seq)
        for out in engine.step():
            outputs[out.request_id] = out
        most = max(most, engine.pool.num_used)
        iteration += 1
    keys = [(rid, i) for rid in ids for i in range(n)]
    return ([torch.stack(rows[key]) for key in keys],
            [outputs[rid].candidates[i].token_ids for rid, i in keys], most)


@pytest.mark.parametrize("policy", ["window", "h2o", "mace"])
def test_compacted_decoding_is_bit_identical_to_masking(model_dir: Path, policy: str) -> None:
    settings = dict(kv_prune_policy=policy, kv_prune_capacity=10, kv_prune_sinks=2)
    masked = _run(make_engine(model_dir, **settings), PROMPTS, STEPS, compacting=False)
    engine = make_engine(model_dir, **settings)
    compacted = _run(engine, PROMPTS, STEPS)
    assert engine.kv_compactions > 0
    for a, b in zip(masked[0], compacted[0], strict=True):
        assert torch.equal(a, b)
    assert masked[1] == compacted[1]
    assert compacted[2] < masked[2]


def _guard_cached_blocks(engine) -> list[int]:
    """Make every compaction check that no block another sequence shares or that caches a prefix
    was written; returns a list that gets, after each, whether a compacted sequence's table kept
    a block another sequence shares."""
    compact, pool, data = engine._compact_pruned_kv, engine.pool, engine.cache.data
    size, seen = pool.block_size, []

    def guarded():
        guarded_blocks = [b for b in range(pool.num_blocks) if pool.ref_count[b] > 1 or pool.hash_of[b] is not None]
        before = {b: data[:, :, b * size : (b + 1) * size].clone() for b in guarded_blocks}
        compact()
        for b, old in before.items():
            assert torch.equal(data[:, :, b * size : (b + 1) * size], old), f"compaction wrote block {b}"
        seen.append(any(s.kv_layout is not None and any(pool.ref_count[b] > 1 for b in s.block_table)
                        for s in engine.scheduler.running))

    engine._compact_pruned_kv = guarded
    return seen


def test_compaction_with_a_shared_prompt_prefix_keeps_it_unwritten_and_the_bits(model_dir: Path) -> None:
    shared = list(range(200, 200 + 32))  # four full blocks of 8
    prompts = [shared + list(range(5, 14)), shared + list(range(60, 75)), shared + [3]]
    # Two candidates of each prompt share its blocks (the second waits for the first's prompt);
    # later prompts hit the first one's cached prefix.
    settings = dict(kv_prune_policy="window", kv_prune_capacity=10, kv_prune_sinks=2)
    masked = _run(make_engine(model_dir, **settings), prompts, STEPS, compacting=False, stagger=3, n=2)
    engine = make_engine(model_dir, **settings)
    seen = _guard_cached_blocks(engine)
    compacted = _run(engine, prompts, STEPS, stagger=3, n=2)
    assert engine.pool.stats.hit_blocks >= 8
    assert any(seen) and engine.kv_compactions > 0  # compacted tables kept shared blocks in place
    for a, b in zip(masked[0], compacted[0], strict=True):
        assert torch.equal(a, b)
    assert masked[1] == compacted[1]


@pytest.mark.parametrize("policy", ["window", "mace"])
def test_a_preempted_compacted_sequence_recomputes_and_keeps_the_bits(model_dir: Path, policy: str) -> None:
    settings = dict(kv_prune_policy=policy, kv_prune_capacity=10, kv_prune_sinks=2)
    masked = _run(make_engine(model_dir, **settings), PROMPTS, STEPS, compacting=False, preempt=(25, 0))
    engine = make_engine(model_dir, **settings)
    compacted = _run(engine, PROMPTS, STEPS, preempt=(25, 0))
    assert engine.scheduler.num_preemptions == 1
    for a, b in zip(masked[0], compacted[0], strict=True):
        assert torch.equal(a, b)
    assert masked[1] == compacted[1]


def test_a_compacted_sequence_holds_the_budgets_share_of_blocks(model_dir: Path) -> None:
    capacity, sinks, steps = 10, 2, 80
    engine = make_engine(model_dir, kv_prune_policy="window", kv_prune_capacity=capacity, kv_prune_sinks=sinks)
    idle: list[int] = []
    on_idle = engine.pool.on_idle
    engine.pool.on_idle = lambda blocks: (idle.extend(blocks), on_idle(blocks))
    prompt = PROMPTS[0]
    rid = engine.add_request(engine.tokenizer.hf.decode(prompt), SamplingParams(max_tokens=steps, ignore_eos=True))
    _set_prompt_ids(engine, rid, prompt)
    seq = engine.requests[rid].seqs[0]
    cfg, size = engine.model.cfg, engine.pool.block_size
    per_block = size * cfg.num_kv_heads
    # Each head keeps its sinks, `capacity` recent positions and the newest: a layer's share.
    budget_blocks = -(-(capacity + sinks + 1) * cfg.num_kv_heads // per_block)
    held = []
    while seq.num_generated < steps - 1:
        engine.step()
        if seq.num_generated > 16:
            held.append(len(seq.block_table))
            assert len(seq.block_table) <= budget_blocks + 1  # + the block new tokens go to
            assert engine.pool.num_used == len(seq.block_table)  # its prompt's blocks went back too
            engine.scheduler.sync_memory()  # the ledger's KV entry is the blocks held
            assert engine.ledger.entries(MemoryKind.KV)["blocks"] == len(seq.block_table) * engine.costs.kv_block_bytes
            # The prompt's full blocks were copied out of, not written: they still cache it.
            assert engine.pool.num_cached_free == len(prompt) // size
    unpruned_blocks = -(-seq.num_computed // size)
    assert max(held) <= budget_blocks + 1 < unpruned_blocks // 3
    # Each compaction after the first gave a block's pages back (the pool hands it out again as
    # the next write block); the first gave back the prompt's blocks, which still cache it.
    assert len(idle) >= engine.kv_compactions - 1 >= 3


def test_compact_packs_retained_entries_and_gives_the_freed_pages_back() -> None:
    from edge_runtime.kv.block_pool import BlockPool
    from edge_runtime.kv.cache import KVCache
    from edge_runtime.kv.compaction import compact, entry_rows, table_slots

    from .test_kv_memory import _cfg, slab_resident

    cfg = _cfg()  # 4 layers x 8 KV heads x 64 dims, float32: 256 KiB a block of 16
    size, blocks, kv = 16, 80, cfg.num_kv_heads
    cache = KVCache(cfg, blocks, size, torch.float32, "cpu")
    pool = BlockPool(blocks, size, enable_prefix_cache=True, on_idle=cache.release_blocks)
    table = [pool.allocate() for _ in range(64)]
    n = 64 * size - 5
    pool.register(table[0], b"shared")
    assert pool.match(b"shared") == table[0]  # another sequence holds block 0 too
    pool.register(table[1], b"cached")  # only this sequence holds block 1, which caches a prefix
    slots = table_slots(table, size)[:n]
    torch.manual_seed(0)
    cache.data[:, :, slots] = torch.randn(cfg.num_layers, 2, n, kv, cfg.head_dim)
    before = cache.data[:, :, slots].clone()
    retained = torch.rand(cfg.num_layers, kv, n) < 0.25
    retained[:, :, :4] = True
    outside = [b for b in range(blocks) if b not in table]
    resident = slab_resident(cache)

    done = compact(None, retained, table, pool, cache)

    assert done is not None and done.allocated == 0
    moved = retained.clone()
    moved[:, :, :size] = False  # what block 0 holds stays there
    # Every layer's entries packed together: the sum decides the blocks, not the fullest layer.
    assert done.block_table[0] == table[0]  # the shared block stays where it is, in the table
    assert len(done.block_table) == 1 + -(-int(moved.sum()) // (cfg.num_layers * size * kv)) < 64 // 3
    assert pool.num_free == len(outside) + len(done.released)  # block 0 is still the other's
    # Their pages went back: all but the cached block 1's (and the last block's unwritten tail).
    assert resident - slab_resident(cache) >= (len(done.released) - 1) * 256 * 1024 - 64 * 1024
    rows = entry_rows(done.layout, done.block_table, n, size, cfg.num_layers, kv, blocks * size)
    slab = cache.data.view(-1, cfg.head_dim)
    for layer in range(cfg.num_layers):
        for kind in (0, 1):
            got = slab[rows[layer] + kind * blocks * size * kv]  # [kv, n, d]
            want = before[layer, kind].transpose(0, 1)
            assert torch.equal(got[retained[layer]], want[retained[layer]])
    assert torch.equal(cache.data[:, :, size : 2 * size], before[:, :, size : 2 * size])  # block 1 unwritten
    assert pool.hash_of[table[1]] == b"cached" and table[1] in done.released


def test_the_blocks_compaction_frees_are_room_for_more_streams(model_dir: Path) -> None:
    """A pool too small for three unpruned streams: masking alone must preempt (its blocks stay
    held), compaction lets all three decode side by side."""
    settings = dict(kv_prune_policy="window", kv_prune_capacity=10, kv_prune_sinks=2)
    probe = make_engine(model_dir)
    per_block = probe.costs.kv_block_bytes
    small = dict(settings, kv_cache_bytes=22 * per_block)  # unpruned, the three need 30 blocks
    masked_engine = make_engine(model_dir, **small)
    assert masked_engine.pool.num_blocks == 22
    _run(masked_engine, PROMPTS, STEPS, compacting=False)
    engine = make_engine(model_dir, **small)
    compacted = _run(engine, PROMPTS, STEPS)
    assert masked_engine.scheduler.num_preemptions > 0
    assert engine.scheduler.num_preemptions == 0
    assert compacted[2] < 22
    # The small pool changed nothing but the schedule: the same bits as with room to spare.
    roomy = _run(make_engine(model_dir, **settings), PROMPTS, STEPS)
    assert compacted[1] == roomy[1]
    assert all(torch.equal(a, b) for a, b in zip(compacted[0], roomy[0], strict=True))


def test_with_no_free_block_compaction_writes_blocks_only_it_holds_that_cached_a_prefix() -> None:
    from edge_runtime.kv.block_pool import BlockPool
    from edge_runtime.kv.cache import KVCache
    from edge_runtime.kv.compaction import compact, entry_rows, table_slots

    from .test_kv_memory import _cfg

    cfg = _cfg()
    size, kv = 16, cfg.num_kv_heads
    cache = KVCache(cfg, 8, size, torch.float32, "cpu")
    pool = BlockPool(8, size, enable_prefix_cache=True, on_idle=cache.release_blocks)
    table = [pool.allocate() for _ in range(8)]  # the whole pool: a prompt's blocks, all cached
    for i, block in enumerate(table):
        pool.register(block, bytes([i]))
    n = 8 * size
    slots = table_slots(table, size)
    cache.data[:, :, slots] = torch.randn(cfg.num_layers, 2, n, kv, cfg.head_dim)
    before = cache.data[:, :, slots].clone()
    retained = torch.zeros(cfg.num_layers, kv, n, dtype=torch.bool)
    retained[:, :, ::4] = True  # a quarter: two blocks' worth
    assert pool.num_free == 0

    done = compact(None, retained, table, pool, cache)

    assert done is not None and done.allocated == 0
    assert len(done.block_table) == 2 and pool.num_free == 6
    assert done.block_table == table[-2:][::-1]  # the prompt's last blocks stopped caching it
    assert all(pool.hash_of[b] is None for b in done.block_table)
    assert all(pool.hash_of[b] is not None for b in done.released)  # the rest still cache it
    rows = entry_rows(done.layout, done.block_table, n, size, cfg.num_layers, kv, 8 * size)
    slab = cache.data.view(-1, cfg.head_dim)
    for layer in range(cfg.num_layers):
        for kind in (0, 1):
            got = slab[rows[layer] + kind * 8 * size * kv][retained[layer]]
            assert torch.equal(got, before[layer, kind].transpose(0, 1)[retained[layer]])


def test_compaction_packs_layers_together_so_the_blocks_follow_the_sum_not_the_fullest_layer() -> None:
    """MACE's capacities are shared across layers by norm: one layer may keep its whole context
    while the others keep little. The blocks must hold the sum of the entries, not the fullest
    layer times the layers."""
    from edge_runtime.kv.block_pool import BlockPool
    from edge_runtime.kv.cache import KVCache
    from edge_runtime.kv.compaction import compact, entry_rows, table_slots

    from .test_kv_memory import _cfg

    cfg = _cfg()  # 4 layers x 8 KV heads
    size, blocks, kv, layers = 16, 40, cfg.num_kv_heads, cfg.num_layers
    cache = KVCache(cfg, blocks, size, torch.float32, "cpu")
    pool = BlockPool(blocks, size, enable_prefix_cache=False, on_idle=cache.release_blocks)
    table = [pool.allocate() for _ in range(32)]
    n = 32 * size
    cache.data[:, :, table_slots(table, size)] = torch.randn(layers, 2, n, kv, cfg.head_dim)
    before = cache.data[:, :, table_slots(table, size)].clone()
    retained = torch.zeros(layers, kv, n, dtype=torch.bool)
    retained[0] = True  # layer 0 keeps everything, the others one position in 16
    retained[1:, :, ::16] = True
    total = int(retained.sum())

    done = compact(None, retained, table, pool, cache)

    assert done is not None
    assert len(done.block_table) == -(-total // (layers * size * kv)) == 10  # per layer: 32 (layer 0)
    rows = entry_rows(done.layout, done.block_table, n, size, layers, kv, blocks * size)
    slab = cache.data.view(-1, cfg.head_dim)
    for layer in range(layers):
        for kind in (0, 1):
            got = slab[rows[layer] + kind * blocks * size * kv][retained[layer]]
            assert torch.equal(got, before[layer, kind].transpose(0, 1)[retained[layer]])
