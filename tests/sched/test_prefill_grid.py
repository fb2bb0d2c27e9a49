"""Prefill chunks on a fixed grid (docs/scheduler.md): every policy's chunk boundaries are the
same whatever the latency budget, the cost estimates and the other requests; a prefix-cache hit
resumes on a grid point."""

from __future__ import annotations

import dataclasses

import pytest

from edge_runtime.kv.block_pool import BlockPool, block_hash
from edge_runtime.sched.bins import Bin
from edge_runtime.sched.prefix import match_prefix
from edge_runtime.sched.registry import POLICIES, make_policy
from edge_runtime.sched.task import Task, TaskKind
from tests.sched.sim import Sim

GRID = 32
LENGTHS = (5, 31, 32, 45, 100, 200)


def _boundaries(policy: str, budget_s: float, cost_scale: float, crowd: int) -> dict[int, list[int]]:
    """Where each measured prompt's prefill chunks ended (by prompt length), with `crowd` other
    decoding streams present. (Read after each step: the last chunk's step also sampled.)"""
    sim = Sim(make_policy(policy), latency_budget_s=budget_s)
    sim.scheduler.prefill_chunk_tokens = GRID
    f = sim.costs.forward
    sim.costs.forward = dataclasses.replace(f, base_s=f.base_s * cost_scale, token_s=f.token_s * cost_scale,
                                            attend_s=f.attend_s * cost_scale, logit_s=f.logit_s * cost_scale)
    for k in range(crowd):
        sim.add_request(7 + 3 * k, 40, token=11 + k)
    seqs = {n: sim.add_request(n, 2) for n in LENGTHS}
    ends: dict[int, list[int]] = {n: [] for n in LENGTHS}
    for _ in range(2000):
        if len(sim.finished) == len(seqs) + crowd:
            break
        batch = sim.step()
        for item in batch.items:
            seq = item.seq
            if seq.num_prompt in ends and seq is seqs[seq.num_prompt] and seq.num_generated <= 1:
                ends[seq.num_prompt].append(seq.num_computed)
    return ends


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_chunk_boundaries_are_on_the_grid_whatever_the_load(policy: str) -> None:
    reference = _boundaries(policy, 0.02, 1.0, 0)
    for n, ends in reference.items():
        assert ends and ends[-1] == n
        assert all(e % GRID == 0 for e in ends[:-1]), (n, ends)
    for budget_s, scale, crowd in ((0.004, 1.0, 6), (0.02, 0.25, 3), (0.02, 4.0, 8), (0.2, 1.0, 12)):
        got = _boundaries(policy, budget_s, scale, crowd)
        for n in LENGTHS:
            # How many chunks share a forward may change; a chunk never ends off the grid.
            assert set(got[n]) <= set(range(GRID, n, GRID)) | {n}, (policy, budget_s, scale, crowd, n, got[n])
            assert got[n][-1] == n


def test_grid_pieces_end_on_grid_points_or_the_end() -> None:
    sim = Sim(make_policy("mace"))
    seq = sim.add_request(100, 2)
    b = Bin(sim.costs, 1.0, 1 << 30, 64, 64, 256, 16, sim.block_size, chunk_tokens=GRID)
    assert b.grid_pieces(Task(TaskKind.PREFILL, 0, 0, seq=seq, remaining=100, context=0), 256) == [32, 64, 96, 100]
    assert b.grid_pieces(Task(TaskKind.PREFILL, 0, 0, seq=seq, remaining=36, context=64), 256) == [32, 36]
    assert b.grid_pieces(Task(TaskKind.PREFILL, 0, 0, seq=seq, remaining=100, context=0), 70) == [32, 64]
    assert b.grid_pieces(Task(TaskKind.PREFILL, 0, 0, seq=seq, remaining=100, context=0), 20) == []
    assert b.grid_pieces(Task(TaskKind.PREFILL, 0, 0, seq=seq, remaining=20, context=0), 20) == [20]
    assert b.grid_pieces(Task(TaskKind.DECODE, 0, 0, seq=seq, remaining=1, context=101), 256) == [1]


@pytest.mark.parametrize(("cached_blocks", "reused"), [(3, 0), (4, 4), (5, 4), (8, 8), (11, 8), (12, 12)])
def test_prefix_hits_stop_on_a_grid_point(cached_blocks: int, reused: int) -> None:
    size = 8
    pool = BlockPool(32, size)
    tokens = list(range(100, 200))  # 100 tokens: 12 full blocks before the last one, 96 = 3 x 32
    parent = None
    for i in range(cached_blocks):
        parent = block_hash(parent, tokens[i * size : (i + 1) * size])
        pool.register(pool.allocate(), parent)
    for block in range(cached_blocks):
        pool.release(block)
    sim = Sim(make_policy("fcfs"), block_size=size)
    seq = sim.add_request(100, 1)
    seq.token_ids = list(tokens)
    match_prefix(seq, pool, "", grid=4 * size)
    assert seq.num_computed == reused * size
    assert len(seq.block_table) == reused
    assert pool.num_used == reused
