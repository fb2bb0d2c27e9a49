"""Builds each iteration's batch: decode steps and prefill chunks, within a token budget and the
free KV blocks, in the order the policy gives; preempts (to be recomputed) when blocks run out;
and after the forward, records what was computed and registers full blocks in the prefix cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from edge_runtime.kv.block_pool import BlockPool, block_hash
from edge_runtime.sched.policy import Policy, Task, TaskKind
from edge_runtime.sequence import SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # new tokens fed this iteration

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so its last row yields a token."""
        return self.seq.num_computed + self.num_tokens == self.seq.num_tokens


@dataclass
class Batch:
    items: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        policy: Policy,
        max_batched_tokens: int = 256,
        max_num_seqs: int = 32,
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.max_batched_tokens = max_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_needed(self, seq: Sequence, new_tokens: int) -> int:
        size = self.pool.block_size
        total = -(-(seq.num_computed + new_tokens) // size)
        return max(0, total - len(seq.block_table))

    def _release(self, seq: Sequence) -> None:
        # Tail first: the head of a prompt is the most shareable, so it is evicted last.
        for block in reversed(seq.block_table):
            self.pool.release(block)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.WAITING
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _match_prefix(self, seq: Sequence) -> None:
        """Reuse cached full blocks of this sequence's tokens (never its last token: that one
        must run through the model to produce logits)."""
        size = self.pool.block_size
        salt = seq.request.adapter_key
        parent = None
        for i in range((seq.num_tokens - 1) // size):
            h = block_hash(parent, seq.token_ids[i * size : (i + 1) * size], salt)
            block = self.pool.match(h)
            if block is None:
                break
            seq.block_table.append(block)
            seq.block_hashes.append(h)
            seq.num_computed += size
            parent = h

    def _ready(self, seq: Sequence) -> bool:
        # Sibling candidates wait for candidate 0's prompt so they reuse its cached blocks
        # instead of computing the same prompt n times.
        if seq.index == 0 or seq.num_computed > 0 or not self.pool.enable_prefix_cache:
            return True
        first = seq.request.seqs[0]
        return first.status is SeqStatus.FINISHED or first.num_computed >= first.num_prompt

    # -- one iteration ----------------------------------------------------------------------

    def schedule(self, now: float) -> Batch:
        tasks = [
            Task(TaskKind.PREFILL if s.in_prefill else TaskKind.DECODE, s, s.arrival) for s in self.running
        ]
        tasks += [Task(TaskKind.PREFILL, s, s.arrival) for s in self.waiting if self._ready(s)]
        budget = self.max_batched_tokens
        items: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        chosen: set[int] = set()
        for task in self.policy.order(tasks, now):
            seq = task.seq
            if seq.status is SeqStatus.WAITING and seq in preempted:
                continue
            if budget <= 0 or len(items) >= self.max_num_seqs:
                break
            fresh = seq.status is SeqStatus.WAITING
            if fresh and not seq.block_table:
                self._match_prefix(seq)
                metrics = seq.request.metrics
                if metrics is not None and seq.index == 0 and seq.preemptions == 0:
                    metrics.cached_prompt_tokens = seq.num_computed
            n = min(seq.num_tokens - seq.num_computed, budget)
            need = self.blocks_needed(seq, n)
            while need > self.pool.num_free:
                victims = [s for s in self.running if s is not seq and id(s) not in chosen]
                if fresh or not victims:
                    break
                victim = self.policy.victim(victims, now)
                self._preempt(victim)
                preempted.append(victim)
            if need > self.pool.num_free:
                if fresh:
                    self._release(seq)  # give back matched prefix blocks; retry later
                    if self.policy.stop_at_first_misfit():
                        break
                    continue
                # A running sequence with no one left to preempt: recompute it later.
                self._preempt(seq)
                preempted.append(seq)
                continue
            for _ in range(need):
                seq.block_table.append(self.pool.allocate())
            if fresh:
                self.waiting.remove(seq)
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
            items.append(ScheduledSeq(seq, n))
            chosen.add(id(seq))
            budget -= n
        return Batch(items, preempted)

    def commit(self, batch: Batch) -> None:
        """Advance computed counts and register newly full blocks in the prefix cache."""
        size = self.pool.block_size
        for item in batch.items:
            seq = item.seq
            seq.num_computed += item.num_tokens
            full = seq.num_computed // size
            salt = seq.request.adapter_key
            while len(seq.block_hashes) < full:
                i = len(seq.block_hashes)
                parent = seq.block_hashes[-1] if seq.block_hashes else None
                h = block_hash(parent, seq.token_ids[i * size : (i + 1) * size], salt)
                self.pool.register(seq.block_table[i], h)
                seq.block_hashes.append(h)
