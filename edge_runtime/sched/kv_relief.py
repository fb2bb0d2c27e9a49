"""Decode KV pruning turned on per sequence under memory pressure (kv_prune_when = "pressure"):
which running sequences start pruning, and how many blocks that is expected to give back. It
decides only: the engine builds each sequence's pruning state (edge_runtime.kv.pruning), and the
block accounting gives the blocks back once a pruned step has run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from edge_runtime.sequence import Sequence


@dataclass
class PruneUnderPressure:
    start: Callable[[Sequence], None]  # gives the sequence its pruning state (norm statistics start then)
    kept_positions: int  # positions one KV head of a pruned sequence is expected to keep (capacity + sinks)
    block_size: int
    turned_on: int = 0  # sequences pruning was turned on for, over the engine's life

    @property
    def compaction_headroom(self) -> int:
        """Free blocks kept for compaction: a sequence turned on mid-generation holds blocks the
        prefix cache registered, which compaction copies out of, never writes; the blocks of a
        pruned sequence's kept positions may all have to come fresh from the pool."""
        return -(-(self.kept_positions + 1) // self.block_size)

    def expected_blocks_freed(self, seq: Sequence) -> int:
        """Blocks the sequence should hold beyond a pruned one's (its kept positions plus the
        next token): what pruning it is expected to give back. An estimate: MACE's per-head
        capacities vary around the mean, so the real figure is what the pool gets back."""
        keep = -(-(self.kept_positions + 1) // self.block_size)
        return max(0, len(seq.block_table) - keep)

    def pending_blocks(self, decodes: Iterable[Sequence]) -> int:
        """Blocks promised by sequences whose pruning is on but has not pruned a step yet."""
        return sum(self.expected_blocks_freed(s) for s in decodes
                   if s.kv_pruning is not None and s.kv_pruning.steps == 0)

    def relieve(self, decodes: list[Sequence], want_blocks: int) -> int:
        """Turn pruning on for unpruned `decodes` (running streams whose next step can run),
        longest context first, until the blocks promised, with those already promised, reach
        `want_blocks`; returns the blocks promised.

        Longest first because the longest context gives back the most blocks per sequence
        turned on, so the fewest streams lose exact attention for the room needed, and a
        sequence shorter than what a pruned one keeps would give back nothing at all."""
        promised = self.pending_blocks(decodes)
        candidates = [s for s in decodes if s.kv_pruning is None and self.expected_blocks_freed(s) > 0]
        candidates.sort(key=lambda s: s.num_computed, reverse=True)  # stable: ties keep their order
        for seq in candidates:
            if promised >= want_blocks:
                break
            self.start(seq)
            self.turned_on += 1
            promised += self.expected_blocks_freed(seq)
        return promised
