"""One iteration's bin: latency, memory, KV-block, token and sequence capacity, and what has been
placed in it. Prices each task with the cost model; knows nothing of priorities (policies) or of
how blocks are allocated (scheduler).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from edge_runtime.sched.cost_model import CostModel
from edge_runtime.sched.task import Task, TaskKind
from edge_runtime.sequence import SeqStatus


def grid_piece(start: int, n: int, end: int, grid: int, at_least_one: bool = False) -> int:
    """How many of the `n` tokens a prefill chunk from `start` may take so that it ends on the
    grid (a multiple of `grid`, the KV block size) or at the prompt's `end`, and never leaves a
    single row for later (0: none). Chunk boundaries are thus a function of the request alone,
    whatever the budget (#31): a policy decides how many grid chunks go into a bin, never where
    one starts. A lone last row would run as a decode row, whose attention ONNX Runtime rounds
    otherwise than a row of a longer chunk. With `at_least_one`, the smallest piece the grid
    allows (the first grid point after `start`, or the end) when `n` reaches none."""
    stop = min(start + n, end)
    if stop < end:
        stop -= stop % grid
        if stop == end - 1:
            stop -= grid
    if stop <= start and at_least_one:
        stop = min(end, start + grid - start % grid)
        if stop == end - 1:
            stop = end
    return max(0, stop - start)


def settings_determinism(answer: tuple[bool, str], *, on_grid: bool, max_batched_tokens: int, block_size: int,
                         kv_prune_when: str | None) -> tuple[bool, str]:
    """A backend's `determinism()` answer as an engine's settings leave it. `on_grid`: the backend's
    rows are invariant only with prefill chunks on the block grid, which a token budget under the
    grid's largest smallest chunk (a block and the row it never leaves alone) forces off it;
    `kv_prune_when` (None: no KV pruning): a pruned stream keeps the keys its own attention used,
    under pressure from when memory ran short, and a preempted one recomputes them all."""
    if not answer[0]:
        return answer
    if kv_prune_when is not None:
        return False, (f"KV pruning is on (kv_prune_when = {kv_prune_when!r}): a stream's kept keys follow its "
                       + ("memory pressure, " if kv_prune_when == "pressure" else "") + "and a preemption's "
                       "recompute restores them all; without pruning: " + answer[1])
    if on_grid and max_batched_tokens <= block_size:
        return False, (f"max_batched_tokens {max_batched_tokens} <= the KV block size {block_size}: prefill chunks "
                       "leave the block grid, where this backend's rows are invariant; otherwise: " + answer[1])
    return answer


@dataclass(slots=True)
class Placement:
    task: Task
    amount: int  # tokens (inference) or consecutive stages (fine-tune)
    latency_s: float
    memory_bytes: int  # transient + held growth, as charged against the bin
    blocks: int = 0  # KV blocks it allocates
    fresh_blocks: int = 0  # ... of which come from never-cached free blocks (new bytes)


@dataclass
class Bin:
    costs: CostModel
    latency_budget_s: float  # math.inf for policies without a latency budget
    memory_bytes: int  # ledger bytes free for this iteration
    free_blocks: int
    fresh_blocks: int  # free blocks that hold no cached prefix: taking one costs new bytes
    token_budget: int
    max_seqs: int
    block_size: int
    slo_tbt_s: float = math.inf
    slo_ttft_factor: float = 5.0
    latency_s: float = 0.0
    used_bytes: int = 0
    tokens: int = 0
    blocks: int = 0
    fresh: int = 0
    forward_s: float = 0.0  # the forward's share of `latency_s`
    inference: list[Placement] = field(default_factory=list)
    finetune: list[Placement] = field(default_factory=list)
    _seq_ids: set[int] = field(default_factory=set, repr=False)
    # (context, tokens, samples) -> seconds: one plan prices a task in every bin it tries (and a
    # prefill at several chunk sizes); the cost model does not change while a plan is made.
    _priced: dict[tuple[int, int, bool], float] = field(default_factory=dict, repr=False)

    # -- capacity ----------------------------------------------------------------------------

    @property
    def free_latency_s(self) -> float:
        return self.latency_budget_s - self.latency_s

    @property
    def free_memory(self) -> int:
        return self.memory_bytes - self.used_bytes

    @property
    def empty(self) -> bool:
        return not self.inference and not self.finetune

    @property
    def full(self) -> bool:
        return self.free_latency_s <= 0 or self.free_memory <= 0

    def empty_like(self) -> Bin:
        """A later iteration with this one's capacity (MACE's bins 2..n)."""
        return Bin(self.costs, self.latency_budget_s, self.memory_bytes, self.free_blocks, self.fresh_blocks,
                   self.token_budget, self.max_seqs, self.block_size, self.slo_tbt_s, self.slo_ttft_factor,
                   _priced=self._priced)

    # -- pricing -----------------------------------------------------------------------------

    def _inference_cost(self, task: Task, n: int) -> tuple[float, int, int, int]:
        """(seconds, bytes, blocks, fresh blocks) of `n` more tokens of the task's sequence."""
        seq = task.seq
        assert seq is not None
        samples = n == task.remaining
        key = (task.context, n, samples)
        seconds = self._priced.get(key)
        if seconds is None:
            seconds = self._priced[key] = self.costs.inference_s(task.context, n, samples)
        if not self.inference:
            seconds += self.costs.forward_base_s  # the first inference item pays for the forward
        # Slots, not context: a compacted sequence (edge_runtime.kv.compaction) holds fewer.
        blocks = max(0, -(-(seq.num_slots + n) // self.block_size) - len(seq.block_table))
        fresh = min(blocks, self.fresh_blocks - self.fresh)
        # Logits memory is charged even for a chunk that does not sample: a prefix-cache hit at
        # admission can turn it into the prompt's last chunk.
        nbytes = fresh * self.costs.kv_block_bytes + self.costs.inference_bytes(n, True)
        return seconds, nbytes, blocks, fresh

    def _stage_costs(self, task: Task, limit: int) -> list[tuple[float, int]]:
        job = task.job
        assert job is not None
        return [(self.costs.stage_s(c.kind, c.seconds), c.memory_bytes) for c in job.stage_costs(limit)]

    def cost(self, task: Task) -> tuple[float, int]:
        """(seconds, bytes) of the whole task as it stands (prefill: all its tokens; fine-tune:
        its next stage): MACE's GETWORKLOAD."""
        if task.kind is TaskKind.FINETUNE:
            stages = self._stage_costs(task, 1)
            return stages[0] if stages else (0.0, 0)
        seconds, nbytes, _, _ = self._inference_cost(task, task.remaining)
        return seconds, nbytes

    # -- fitting -----------------------------------------------------------------------------

    def whole_fit(self, task: Task) -> tuple[float, int] | None:
        """(seconds, bytes) of the whole task (a prefill's remaining tokens, a decode step, a
        fine-tune job's next stage) if it fits as it is, else None. An empty bin waives the
        latency budget for a unit of work (a decode step, one stage), as `largest_fit` does."""
        if task.kind is TaskKind.FINETUNE:
            stages = self._stage_costs(task, 1)
            if not stages:
                return None
            seconds, nbytes = stages[0]
            ok = nbytes <= self.free_memory and (seconds <= self.free_latency_s or self.empty)
            return (seconds, nbytes) if ok else None
        seq = task.seq
        assert seq is not None
        n = task.remaining
        if len(self.inference) >= self.max_seqs or seq.seq_id in self._seq_ids or n > self.token_budget - self.tokens:
            return None
        seconds, nbytes, blocks, _ = self._inference_cost(task, n)
        ok = (blocks <= self.free_blocks - self.blocks and nbytes <= self.free_memory
              and (seconds <= self.free_latency_s or (self.empty and n == 1)))
        return (seconds, nbytes) if ok else None

    def largest_fit(self, task: Task, max_stages: int | None = None, ignore_latency: bool = False) -> int:
        """The largest piece of `task` this bin can take (0: none). Memory, blocks, tokens and
        sequences are hard limits; latency too (unless `ignore_latency`), except that an empty
        bin takes the smallest piece of anything (a lone stage longer than the budget must
        still run some time)."""
        if task.kind is TaskKind.FINETUNE:
            return self._stages_fit(task, max_stages, ignore_latency)
        seq = task.seq
        assert seq is not None
        if len(self.inference) >= self.max_seqs or seq.seq_id in self._seq_ids:
            return 0
        top = min(task.remaining, self.token_budget - self.tokens)
        if top <= 0:
            return 0
        if seq.status is SeqStatus.WAITING:
            # Admit a prompt only if its whole prefill will find blocks (as FlexLLM and vLLM do),
            # so half-admitted prompts cannot hold the cache hostage.
            whole = max(0, -(-(task.context + task.remaining) // self.block_size) - len(seq.block_table))
            if whole > self.free_blocks - self.blocks:
                return 0

        def fits(n: int, check_latency: bool = not ignore_latency) -> bool:
            seconds, nbytes, blocks, _ = self._inference_cost(task, n)
            return (blocks <= self.free_blocks - self.blocks and nbytes <= self.free_memory
                    and (not check_latency or seconds <= self.free_latency_s))

        if fits(top):
            lo = top
        else:
            lo, hi = 0, top  # fits(lo) holds (vacuously for 0), fits(hi) does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if fits(mid):
                    lo = mid
                else:
                    hi = mid
        raw = lo
        if task.kind is TaskKind.PREFILL:
            lo = grid_piece(task.context, lo, task.context + task.remaining, self.block_size)
        if lo == 0 and self.empty:
            end = task.context + task.remaining
            # The grid's smallest chunk; else, where the token budget or memory cannot hold it,
            # progress off the grid (a request's rows then depend on those limits too).
            for smallest in (grid_piece(task.context, min(top, self.block_size), end, self.block_size, True), raw,
                             min(top, self.block_size)):
                if 0 < smallest <= top and fits(smallest, check_latency=False):
                    return smallest
        return lo

    def _stages_fit(self, task: Task, max_stages: int | None, ignore_latency: bool) -> int:
        limit = task.remaining if max_stages is None else min(max_stages, task.remaining)
        seconds, nbytes, count = 0.0, 0, 0
        for stage_s, stage_bytes in self._stage_costs(task, limit):
            seconds += stage_s
            nbytes += stage_bytes
            over_latency = (not ignore_latency and seconds > self.free_latency_s
                            and not (self.empty and count == 0))
            if nbytes > self.free_memory or over_latency:
                break
            count += 1
        return count

    def extend_stages(self, placement: Placement) -> int:
        """Give a fine-tune placement of this bin as many of its job's following stages as still
        fit (latency and memory); returns how many were added."""
        task = placement.task
        following = self._stage_costs(task, task.remaining)[placement.amount :]
        seconds, nbytes, added = 0.0, 0, 0
        for stage_s, stage_bytes in following:
            if seconds + stage_s > self.free_latency_s or nbytes + stage_bytes > self.free_memory:
                break
            seconds += stage_s
            nbytes += stage_bytes
            added += 1
        placement.amount += added
        placement.latency_s += seconds
        placement.memory_bytes += nbytes
        self.latency_s += seconds
        self.used_bytes += nbytes
        return added

    def add(self, task: Task, amount: int) -> Placement:
        if task.kind is TaskKind.FINETUNE:
            stages = self._stage_costs(task, amount)
            placement = Placement(task, amount, sum(s for s, _ in stages), sum(b for _, b in stages))
            self.finetune.append(placement)
        else:
            seconds, nbytes, blocks, fresh = self._inference_cost(task, amount)
            placement = Placement(task, amount, seconds, nbytes, blocks, fresh)
            self.inference.append(placement)
            self._seq_ids.add(task.seq.seq_id)  # type: ignore[union-attr]
            self.tokens += amount
            self.blocks += blocks
            self.fresh += fresh
            self.forward_s += seconds
        self.latency_s += placement.latency_s
        self.used_bytes += placement.memory_bytes
        return placement
