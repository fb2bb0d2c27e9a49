"""kv_prune_when = "pressure" on the model-free harness: pruning is turned on for running streams
(longest context first) before the pool runs dry (compaction needs free blocks to copy into),
before a stream is preempted for blocks and before fine-tune activations are shed for the
ledger, and only the shortfall's worth of streams. Until pruned sequences give
blocks back (kv-compact), a shortage their step did not relieve still ends in a preemption."""

from __future__ import annotations

from dataclasses import dataclass

from edge_runtime.memory import MemoryKind
from edge_runtime.sched.kv_relief import PruneUnderPressure
from edge_runtime.sched.mace import MacePolicy
from edge_runtime.sequence import Sequence
from tests.sched.sim import KV_BLOCK_BYTES, WEIGHTS_BYTES, FakeTrainer, Sim


@dataclass
class FakePruning:
    steps: int = 0  # pruned decode steps taken (the Sim counts them)


def relief(kept_positions: int = 8, block_size: int = 16) -> PruneUnderPressure:
    def start(seq: Sequence) -> None:
        seq.kv_pruning = FakePruning()

    return PruneUnderPressure(start, kept_positions, block_size)


def three_streams(kv_relief: PruneUnderPressure | None) -> tuple[Sim, list[Sequence]]:
    """10 blocks of 16 for prompts of 70, 40 and 20 tokens (5 + 3 + 2 blocks): the 40-token
    stream needs the first new block, when the pool has none. Each fits alone (70 + 80 tokens)."""
    sim = Sim(MacePolicy(), num_blocks=10, kv_relief=kv_relief, latency_budget_s=1.0)
    seqs = [sim.add_request(n, 80, token=t) for n, t in ((70, 7), (40, 50), (20, 100))]
    return sim, seqs


def step_until_blocks_short(sim: Sim, limit: int = 100) -> None:
    for _ in range(limit):
        if sim.scheduler.running and sim.scheduler.blocks_short():
            return
        sim.step()
    raise AssertionError("the streams never ran short of blocks")


def test_without_pressure_pruning_a_block_shortage_preempts_at_once() -> None:
    sim, _ = three_streams(None)
    step_until_blocks_short(sim)
    sim.step()
    assert sim.scheduler.num_preemptions == 1


def test_pressure_turns_pruning_on_for_the_longest_stream_before_the_pool_runs_dry() -> None:
    # The prompts fill the pool; compaction needs free blocks to copy into (headroom: 1 block
    # here), so pruning starts before any stream needs a block: one stream, the longest.
    sim, (longest, middle, shortest) = three_streams(relief())
    while longest.kv_pruning is None:
        assert not sim.scheduler.blocks_short()  # no stream needs a block yet
        sim.step()
    assert sim.pool.num_free == 0 and sim.scheduler.num_preemptions == 0
    assert isinstance(longest.kv_pruning, FakePruning) and longest.kv_pruning.steps == 1
    assert middle.kv_pruning is None and shortest.kv_pruning is None
    assert sim.scheduler.kv_relief.turned_on == 1


def test_pressure_does_not_preempt_while_a_pruned_stream_has_not_stepped_yet() -> None:
    # A shortage met by blocks a just-pruned stream promises: nobody is preempted that iteration.
    kv_relief = relief()
    sim, (longest, middle, shortest) = three_streams(kv_relief)
    step_until_blocks_short(sim)
    assert sim.scheduler.blocks_needed(middle, 1) == 1  # the one asking for a block
    longest.kv_pruning = shortest.kv_pruning = None  # as if they had not been turned on yet
    sim.step()
    assert sim.scheduler.num_preemptions == 0
    assert longest.kv_pruning is not None and longest.kv_pruning.steps == 1


def test_pressure_preempts_only_once_pruned_streams_gave_nothing_back() -> None:
    # The fake pruning frees no block (as before kv-compact): pruning comes first, then the
    # shortage is still short and a stream is preempted; every request still finishes.
    sim, seqs = three_streams(relief())
    sched = sim.scheduler
    step_until_blocks_short(sim)
    while sched.num_preemptions == 0:
        # Streams pruning could still be turned on for: running, unpruned, holding more than a
        # pruned one keeps (1 block), and able to take their next step without a new block.
        prunable = [s for s in sched.running if s.kv_pruning is None and not s.in_prefill
                    and sched.blocks_needed(s, 1) == 0 and len(s.block_table) > 1]
        pending = [s for s in sched.running if s.kv_pruning is not None and s.kv_pruning.steps == 0]
        sim.step()
    assert not prunable and not pending  # the preempting iteration had nothing left to prune
    # Nothing came back, so every stream was turned on, longest first, one per iteration.
    assert all(s.kv_pruning is not None for s in seqs) and sched.kv_relief.turned_on == 3
    assert seqs[0].kv_pruning.steps > seqs[1].kv_pruning.steps > seqs[2].kv_pruning.steps
    for _ in range(3000):
        if not sim.scheduler.has_work():
            break
        sim.step()
    assert len(sim.finished) == 3


def test_pressure_turns_pruning_on_before_the_ledger_sheds_finetune_activations() -> None:
    floor = WEIGHTS_BYTES + FakeTrainer.persistent_bytes
    sim = Sim(MacePolicy(), budget=floor + (4 << 20), latency_budget_s=0.03, kv_relief=relief())
    long, short = sim.add_request(90, 64, token=7), sim.add_request(30, 64, token=50)
    job = sim.add_job(0, forwards=3, backwards=2, held_per_forward=256 * 1024, stage_s=0.015)
    for _ in range(200):
        sim.step()
        if job.work.held_bytes and not long.in_prefill and not short.in_prefill:
            break
    else:
        raise AssertionError("the job never held activations beside two decoding streams")
    sim.scheduler.sync_memory()
    held = sim.ledger.held(MemoryKind.ACTIVATIONS)

    report = sim.ledger.set_budget(sim.ledger.held() - 1)
    assert report.freed == {} and report.satisfied
    assert report.promised_bytes >= KV_BLOCK_BYTES
    assert sim.ledger.held(MemoryKind.ACTIVATIONS) == held and job.abandoned == 0
    assert long.kv_pruning is not None and short.kv_pruning is None
