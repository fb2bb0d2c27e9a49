"""The scheduler with prefix reuse to the token (a row-invariant backend's `copy_rows`), on the
model-free harness: the copied block counts as a used block, a repeated prompt runs one row, and a
prompt is admitted with its copy only when all its blocks fit."""

from __future__ import annotations

from edge_runtime.sched.mace import MacePolicy
from tests.sched.sim import Sim


def _sim(num_blocks: int = 64) -> tuple[Sim, list]:
    sim = Sim(MacePolicy(), num_blocks=num_blocks, latency_budget_s=1.0)
    copies: list = []
    sim.scheduler.copy_rows = lambda src, dst, rows: copies.append((src, dst, rows))
    return sim, copies


def _run(sim: Sim, prompt_len: int, max_tokens: int = 4):
    seq = sim.add_request(prompt_len, max_tokens)
    rows = 0
    while sim.scheduler.has_work():
        batch = sim.step()
        rows += sum(item.num_tokens for item in batch.items if item.seq is seq)
    return seq, rows


def test_a_repeated_prompt_runs_one_row_and_holds_no_block_after():
    sim, copies = _sim()
    _run(sim, 37)
    seq, rows = _run(sim, 37)
    assert seq.request.metrics.cached_prompt_tokens == 36 and rows == 1 + 3
    assert len(copies) == 1 and copies[0][2] == 36 - 32
    assert sim.pool.num_used == 0  # the copy was counted as used and released with the rest
    assert sim.scheduler.sync_memory() == sim.pool.num_cached_free


def test_a_prompt_whose_whole_prefill_finds_no_blocks_waits_without_copying():
    """The bin prices a waiting prompt's blocks from position 0, which covers its matched blocks,
    the copy and the rest: it is admitted whole or not at all."""
    sim, copies = _sim(num_blocks=8)
    _run(sim, 20, max_tokens=2)  # a full block and a kept tail
    cached = sim.pool.num_cached_free
    hog = [sim.pool.allocate() for _ in range(sim.pool.num_free - cached)]  # only the cached blocks are free
    seq = sim.add_request(20 + 40, 1)  # shares the 20 rows, needs 4 blocks in all
    sim.step()
    assert copies == [] and seq.block_table == [] and sim.pool.num_cached_free == cached
    for block in hog:
        sim.pool.release(block)
    while sim.scheduler.has_work():
        sim.step()
    assert len(copies) == 1 and seq.request.metrics.cached_prompt_tokens == 20 and sim.pool.num_used == 0
