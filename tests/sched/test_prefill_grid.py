"""Prefill chunks on the grid (#31): whatever the policy, the latency budget, the cost estimates,
the token budget, what else is queued, a prefix hit or a preemption, every prefill chunk ends on
a multiple of the KV block size or at the end of what is prefilled, and never leaves one row for
later (a lone row would run as a decode row, which ONNX Runtime rounds otherwise)."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from edge_runtime.sched.bins import grid_piece, settings_determinism
from edge_runtime.sched.registry import POLICIES, make_policy
from tests.sched.sim import Sim


def test_grid_piece_ends_on_the_grid_or_at_the_end_and_never_leaves_one_row() -> None:
    assert grid_piece(0, 40, 100, 16) == 32
    assert grid_piece(0, 15, 100, 16) == 0
    assert grid_piece(0, 15, 100, 16, at_least_one=True) == 16
    assert grid_piece(16, 200, 100, 16) == 84  # the rest, whole
    assert grid_piece(0, 48, 49, 16) == 32  # 48 would leave the last row alone
    assert grid_piece(32, 1, 49, 16, at_least_one=True) == 17  # the last grid chunk takes it


def test_settings_that_break_a_backends_row_invariance_turn_its_deterministic_answer_false() -> None:
    """The token budget that the property test below starts at (17 = a block and the row it never
    leaves alone) is where a grid-reliant backend stops being deterministic; a backend whose rows
    are invariant off the grid keeps its answer; KV pruning breaks either; a False stays False."""
    yes = (True, "rows invariant")
    grid = dict(block_size=16, kv_prune_when=None)
    assert settings_determinism(yes, on_grid=True, max_batched_tokens=17, **grid) == yes
    ok, why = settings_determinism(yes, on_grid=True, max_batched_tokens=16, **grid)
    assert not ok and "max_batched_tokens 16" in why and why.endswith("rows invariant")
    assert settings_determinism(yes, on_grid=False, max_batched_tokens=1, **grid) == yes
    for when in ("always", "pressure"):
        ok, why = settings_determinism(yes, on_grid=False, max_batched_tokens=256, block_size=16, kv_prune_when=when)
        assert not ok and f"kv_prune_when = {when!r}" in why and ("memory pressure" in why) == (when == "pressure")
    no = (False, "not known")
    assert settings_determinism(no, on_grid=True, max_batched_tokens=1, block_size=16, kv_prune_when="always") == no


@given(policy=st.sampled_from(sorted(POLICIES)), prompts=st.lists(st.integers(2, 120), min_size=1, max_size=8),
       repeat=st.booleans(), scale=st.sampled_from([0.25, 1.0, 4.0]), budget_ms=st.sampled_from([2.0, 5.0, 20.0]),
       max_tokens=st.sampled_from([17, 40, 128]), blocks=st.sampled_from([12, 40, 256]))
@settings(max_examples=80, deadline=None)
def test_prefill_chunks_fall_on_the_grid_under_any_budget(policy, prompts, repeat, scale, budget_ms, max_tokens,
                                                         blocks) -> None:
    sim = Sim(make_policy(policy), latency_budget_s=budget_ms / 1000, max_batched_tokens=max_tokens, num_blocks=blocks)
    f = sim.costs.forward  # what another machine's calibration would have given
    sim.costs.forward = dataclasses.replace(f, base_s=f.base_s * scale, token_s=f.token_s * scale)
    for n in prompts + (prompts[:1] if repeat else []):  # a repeat resumes from the prefix cache
        sim.add_request(n, 3)
    size, pieces = sim.pool.block_size, []
    schedule = sim.scheduler.schedule

    def spy(now: float):
        batch = schedule(now)
        pieces.extend((i.seq.num_computed, i.num_tokens, i.seq.num_tokens) for i in batch.items)
        return batch

    sim.scheduler.schedule = spy
    for _ in range(400):
        if not sim.scheduler.has_work():
            break
        sim.step()
    assert not sim.scheduler.has_work()
    prefills = [(start, n, total) for start, n, total in pieces if total - start > 1]  # not a decode step
    assert prefills
    for start, n, total in prefills:
        assert start % size == 0 and ((start + n) % size == 0 or start + n == total), (start, n, total)
        assert total - (start + n) != 1 and n > 1, (start, n, total)
