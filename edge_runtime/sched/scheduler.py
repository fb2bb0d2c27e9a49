"""Builds each iteration's bin: turns running and waiting sequences and queued fine-tune jobs into
tasks, lets the policy pack them within the latency budget, the ledger's free memory and the free
KV blocks, allocates blocks for what was packed, and afterwards records progress (computed
tokens, prefix-cache blocks, re-queue times). Sheds memory for the ledger when asked.
"""

from __future__ import annotations

import itertools
import math
import time
import weakref
from collections import deque
from typing import Any

from edge_runtime.errors import AdmissionRejected
from edge_runtime.kv.block_pool import BlockPool
from edge_runtime.memory import MemoryKind, MemoryLedger
from edge_runtime.sched.batch import Batch, ScheduledSeq, ScheduledStages
from edge_runtime.sched.bins import Bin, grid_piece
from edge_runtime.sched.cost_model import CostModel
from edge_runtime.sched.finetune import FineTuneJob, FineTuneQueue, must_finish
from edge_runtime.sched.kv_relief import PruneUnderPressure
from edge_runtime.sched.policy import Policy
from edge_runtime.sched.prefix import cache_salt, match_prefix, register_full_blocks, release_blocks
from edge_runtime.sched.slo import budget_ms, headroom_budget, slo_budgets
from edge_runtime.sched.task import Task, TaskKind
from edge_runtime.sequence import SeqStatus, Sequence
from edge_runtime.spec.drafter import Drafter

__all__ = ["Batch", "ScheduledSeq", "ScheduledStages", "Scheduler"]


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        policy: Policy,
        costs: CostModel,
        ledger: MemoryLedger,
        *,
        max_batched_tokens: int = 256, max_num_seqs: int = 32,
        latency_budget_s: float = math.inf, slo_tbt_s: float = math.inf,
        slo_ttft_factor: float = 5.0,
        max_latency_budget_s: float | None = None,
        headroom_margin: float = 0.85,
        rope_switch: int | None = None,
        kv_relief: PruneUnderPressure | None = None,
    ) -> None:
        self.pool = pool
        self.drafter = Drafter(0)  # decode rows' drafts (edge_runtime.spec): none unless the engine sets one
        self.prefix_tier: Any = None  # kv.prefix_tier.PrefixTier: the prefix cache's disk tier, set by the engine
        # kv.cache.KVCache.copy_rows, set by the engine only where rows are invariant: prefix reuse to the last token
        self.copy_rows: Any = None
        self.policy = policy
        self.costs = costs
        self.ledger = ledger
        self.max_batched_tokens = max_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.latency_budget_s = latency_budget_s
        self.slo_tbt_s = slo_tbt_s
        self.slo_ttft_factor = slo_ttft_factor
        # The longest an iteration may grow by spending the streams' accumulated TBT headroom
        # (policies with `uses_slo_headroom`); None = never beyond `latency_budget_s`.
        self.max_latency_budget_s = latency_budget_s if max_latency_budget_s is None else max_latency_budget_s
        self.headroom_margin = headroom_margin
        self.iteration_budget_s = latency_budget_s  # the budget the last schedule() packed to
        self._next_forward_s = 0.0  # the last planned forward: what the next token's forward may cost
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finetune = FineTuneQueue()
        self.finetune_paused: str | None = None  # why fine-tuning is held back (admission, user)
        self._last_token: dict[int, float] = {}  # seq_id -> when it last got a token
        self._trainers: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._shed_preempted: list[Sequence] = []
        self._now = 0.0
        self.num_preemptions = 0
        # LongRoPE's switch (ModelConfig.rope_switch): a sequence's keys/values are computed with
        # the short factors while it holds at most this many tokens, with the long ones after.
        self.rope_switch = rope_switch
        self.num_rope_recomputes = 0
        self.overhead_s = 0.0  # wall time of the last schedule() (the scheduler's own cost)
        # kv_prune_when = "pressure": pruning turned on for running streams before any is
        # preempted or fine-tuning is shed; the bytes it promised this iteration (freed after
        # the pruned streams' next step) may carry their decode rows meanwhile.
        self.kv_relief = kv_relief
        self._promised_bytes = 0
        ledger.register_shedder(MemoryKind.ACTIVATIONS, self._shed_activations)
        ledger.register_shedder(MemoryKind.PREFIX_CACHE, self._shed_prefix_cache)
        ledger.register_shedder(MemoryKind.KV, self._shed_sequences)
        if kv_relief is not None:
            ledger.register_relief(self._prune_for_memory)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_finetune(self, job: FineTuneJob) -> None:
        """Queue a job. A trainer seen for the first time brings its optimizer state into the
        ledger; room is made first (idle adapters, prefix cache: never another job's activations), and
        the job is refused if there is none."""
        trainer = job.work.trainer
        key = id(trainer)
        if trainer is not None and key not in self._trainers:
            need = int(getattr(trainer, "persistent_bytes", 0))
            if need > self.ledger.free and not self.ledger.reclaim(need, for_finetune=True).satisfied:
                raise AdmissionRejected(
                    f"no memory for another adapter's optimizer state ({need / 2**20:.1f} MiB): the budget is "
                    f"{self.ledger.budget / 2**20:.0f} MiB and {self.ledger.used / 2**20:.0f} MiB are in use",
                    retry_after_s=5.0, reason="memory")
            self._trainers[key] = trainer
            self.ledger.set(MemoryKind.OPTIMIZER, f"trainer-{key}", need)
        self.finetune.add(job)

    def forget_trainer(self, trainer: Any) -> None:
        """A trainer that will queue no more jobs (a finished fleet round's): its optimizer state
        leaves the ledger now, though finished jobs in the queue's history still refer to it."""
        key = id(trainer)
        if self._trainers.get(key) is trainer:
            del self._trainers[key]
            self.ledger.drop(MemoryKind.OPTIMIZER, f"trainer-{key}")

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
        self._last_token.pop(seq.seq_id, None)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def has_work(self) -> bool:
        if self.waiting or self.running:
            return True
        if not self.finetune_paused:
            return bool(self.finetune.jobs)
        return any(must_finish(job) for job in self.finetune.jobs.values())

    def blocks_needed(self, seq: Sequence, new_tokens: int) -> int:
        size = self.pool.block_size
        total = -(-(seq.num_slots + new_tokens) // size)
        return max(0, total - len(seq.block_table))

    def _release(self, seq: Sequence, keep_tail: bool = True) -> None:
        # A kept tail's salt: LongRoPE's switch recomputes with other factors, so none there.
        keep = keep_tail and self.copy_rows is not None and self.rope_switch is None
        release_blocks(seq, self.pool, cache_salt(seq, None) if keep else None)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.WAITING
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def token_appended(self, seq: Sequence) -> None:
        """A running sequence got its next token. The one that takes it past LongRoPE's switch
        makes every key/value it holds stale (computed with the short factors, which transformers
        then no longer uses for any position): the sequence is prefilled again, whole, with the
        long ones, as transformers' own generate() does at that point. Once per sequence."""
        if (self.rope_switch is not None and seq.num_tokens == self.rope_switch + 1
                and seq.status is SeqStatus.RUNNING and seq.num_computed > 0):
            self.running.remove(seq)
            self._release(seq, keep_tail=False)  # its full blocks stay in the prefix cache, under the short salt
            seq.status = SeqStatus.WAITING
            seq.preemptions += 1  # its prompt's cache hits were counted already
            self.num_rope_recomputes += 1
            self.waiting.appendleft(seq)

    def _ready(self, seq: Sequence) -> bool:
        # Sibling candidates wait for candidate 0's prompt so they reuse its cached blocks
        # instead of computing the same prompt n times.
        if seq.index == 0 or seq.num_computed > 0 or not self.pool.enable_prefix_cache:
            return True
        first = seq.request.seqs[0]
        return first.status is SeqStatus.FINISHED or first.num_computed >= first.num_prompt

    # -- memory ------------------------------------------------------------------------------

    def sync_memory(self) -> int:
        """Bring the ledger's KV, prefix-cache, activation and optimizer entries up to date;
        returns the number of free blocks that still cache a prefix."""
        pool, per_block, ledger = self.pool, self.costs.kv_block_bytes, self.ledger
        cached_free = self._cached_free()
        changes = [(MemoryKind.KV, "blocks", pool.num_used * per_block),
                   (MemoryKind.PREFIX_CACHE, "blocks", cached_free * per_block)]
        jobs = self.finetune.jobs
        # Retired or cancelled jobs drop out; the rest report what they hold now.
        changes += [(MemoryKind.ACTIVATIONS, key, 0) for key in ledger.entries(MemoryKind.ACTIVATIONS).keys() - jobs.keys()]
        changes += [(MemoryKind.ACTIVATIONS, job.job_id, job.work.held_bytes) for job in jobs.values()]
        known = {f"trainer-{key}": trainer for key, trainer in list(self._trainers.items())}
        changes += [(MemoryKind.OPTIMIZER, key, 0) for key in ledger.entries(MemoryKind.OPTIMIZER).keys() - known.keys()]
        changes += [(MemoryKind.OPTIMIZER, key, int(getattr(trainer, "persistent_bytes", 0)))
                    for key, trainer in known.items()]
        ledger.update(changes)
        return cached_free

    def _cached_free(self) -> int:
        """Free blocks that still hold a prefix: every cached block but those sequences hold.
        O(blocks held) where `BlockPool.num_cached_free` walks the whole free list, which costs
        more than the rest of an iteration's scheduling at thousands of blocks."""
        hash_of = self.pool.hash_of
        held = {b for s in self.running for b in s.block_table if hash_of[b] is not None}
        return len(self.pool.cached) - len(held)

    def _shed_activations(self, want: int) -> int:
        """Fine-tune jobs give back their held activations: first every `shed_first` job (a
        fleet round), dropped whole with its trainer's other queued jobs whether or not it holds
        any now; then the others, lowest priority first, which restart at their first forward.
        Only serving and budget drops shed them (fine-tune work reclaims with `for_finetune`). A
        job restarted `max_restarts` times is failed with the figures, not started over again."""
        freed = self.drop_shed_first("memory pressure")
        queue = self.finetune
        holding = [job for job in queue.holding() if not must_finish(job)]
        holding.sort(key=lambda job: self.policy.priority(self._job_task(job), self._now))
        for job in holding:
            if freed >= want:
                break
            freed += queue.abandon(job)
            self.ledger.drop(MemoryKind.ACTIVATIONS, job.job_id)
            queue.fail_if_stalled(job, self._now, self.ledger.snapshot())
        return freed

    def drop_shed_first(self, reason: str) -> int:
        """Retire every `shed_first` job (error "shed: <reason>"), giving back what it holds;
        one whose backward has begun runs on to its optimizer stage (a torn update would leak
        into the adapter) and is dropped on the next shed. Returns the bytes freed."""
        freed = 0
        for job in [j for j in self.finetune.jobs.values() if j.shed_first and not must_finish(j)]:
            if job.work.held_bytes:
                freed += self.finetune.abandon(job)
            self.ledger.drop(MemoryKind.ACTIVATIONS, job.job_id)
            self.finetune.retire(job, self._now, error=f"shed: {reason}")
        return freed

    def _shed_prefix_cache(self, want: int) -> int:
        per_block = self.costs.kv_block_bytes
        dropped = self.pool.evict_cached(-(-want // per_block))
        self.sync_memory()
        return dropped * per_block

    def _shed_sequences(self, want: int) -> int:
        """Preempt (to recompute later) the policy's victims until `want` bytes are free."""
        before = self.ledger.held()
        while self.running and before - self.ledger.held() < want:
            victim = self.policy.victim(self.running, self._now)
            self._preempt(victim)
            self._shed_preempted.append(victim)
            # Its full blocks stay cached (reusable on readmission) unless the bytes are needed.
            self.sync_memory()
            short = want - (before - self.ledger.held())
            if short > 0:
                self._shed_prefix_cache(short)
        return before - self.ledger.held()

    # -- one iteration ----------------------------------------------------------------------

    def _job_task(self, job: FineTuneJob) -> Task:
        return Task(TaskKind.FINETUNE, job.arrival, job.enqueued, job=job, remaining=self.finetune.stages_allowed(job))

    def _make_room_for_decodes(self) -> None:
        """Running streams need their next block (and a little activation memory) before the
        policy packs: take it from the pool, or shed in ledger order (fine-tune activations,
        adapters, prefix cache, then the policy's victims) until they have it."""
        per_token = self.costs.inference_bytes(1, True)
        self._prune_for_blocks()  # kv_prune_when = "pressure": before the pool runs dry
        while True:
            decodes = [s for s in self.running if not s.in_prefill]
            need = sum(self.blocks_needed(s, 1) for s in decodes)
            fresh = min(need, self.pool.num_free - self._cached_free())
            wanted = fresh * self.costs.kv_block_bytes + len(decodes) * per_token
            if need <= self.pool.num_free and wanted <= self.ledger.free:
                return
            progressed = False
            if wanted > self.ledger.free:
                # reclaim(x) frees until x more fits: the whole need, not what is missing of it.
                progressed = self.ledger.reclaim(wanted).freed_bytes > 0
            if self.running and self.blocks_short():
                if self._prune_for_blocks():
                    return  # the pruned streams give blocks back after this step; who needs one waits
                victim = self.policy.victim(self.running, self._now)
                self._preempt(victim)
                self._shed_preempted.append(victim)
                self.sync_memory()
                progressed = True
            if not progressed:
                return  # nothing left to shed: the bin holds what still fits

    def _prunable_now(self) -> list[Sequence]:
        """Running streams whose next decode step can run without a new block: only a step
        that runs can prune, and so give blocks back."""
        return [s for s in self.running if not s.in_prefill and self.blocks_needed(s, 1) == 0]

    def _prune_for_blocks(self) -> bool:
        """Turn pruning on for running streams (kv_relief.py) while the free blocks are fewer
        than the streams' next tokens need plus `compaction_headroom` (compaction copies a
        sequence's entries out of its prefix-cached blocks into fresh ones, so with none free it
        cannot give anything back). True when the blocks promised cover the real shortfall:
        nothing is preempted now; a stream that needs a block waits for the pruned ones' step to
        give some back (if nothing at all can run, `schedule` still preempts)."""
        if self.kv_relief is None:
            return False
        need = sum(self.blocks_needed(s, 1) for s in self.running if not s.in_prefill)
        short = need + self.kv_relief.compaction_headroom - self.pool.num_free
        if short <= 0:
            return True
        return self.kv_relief.relieve(self._prunable_now(), short) >= need - self.pool.num_free

    def _prune_for_memory(self, want: int) -> int:
        """The ledger's relief step, before it sheds fine-tune activations: the bytes promised by
        turning pruning on for running streams."""
        assert self.kv_relief is not None
        per_block = self.costs.kv_block_bytes
        promised = self.kv_relief.relieve(self._prunable_now(), -(-want // per_block)) * per_block
        # The bin may borrow what was wanted of it (those streams' decode rows), no more.
        self._promised_bytes = max(self._promised_bytes, min(promised, want))
        return promised

    def blocks_short(self) -> bool:
        """Whether the running streams' next tokens need more blocks than the pool has free."""
        return sum(self.blocks_needed(s, 1) for s in self.running if not s.in_prefill) > self.pool.num_free

    def _tasks(self) -> list[Task]:
        prefill, decode = TaskKind.PREFILL, TaskKind.DECODE
        last_token = self._last_token
        tasks = []
        for s in self.running:
            left = s.num_tokens - s.num_computed
            if left > 1:
                tasks.append(Task(prefill, s.arrival, s.arrival, seq=s, remaining=left, context=s.num_computed))
            else:
                tasks.append(Task(decode, s.arrival, last_token.get(s.seq_id, s.arrival), seq=s,
                                  remaining=1 + self.drafter.plan(s), context=s.num_computed))
        for s in self.waiting:
            if self._ready(s):
                tasks.append(Task(prefill, s.arrival, s.arrival, seq=s, remaining=s.num_tokens - s.num_computed,
                                  context=s.num_computed))
        runnable = self.finetune.runnable()
        if self.finetune_paused:
            # Paused (shed): only updates past their point of no return run on, to free what
            # they hold; the rest gave their activations back and wait.
            runnable = [job for job in runnable if must_finish(job)]
        else:
            # Room for passes: what fine-tune work may take (free, idle adapters, prefix cache).
            ledger = self.ledger
            room = ledger.free + ledger.held(MemoryKind.ADAPTERS) + ledger.held(MemoryKind.PREFIX_CACHE)
            runnable = self.finetune.admit_passes(runnable, room)
        tasks += [self._job_task(job) for job in runnable]
        return tasks

    def _make_room_for_finetune(self, tasks: list[Task]) -> bool:
        """The largest next stage of this iteration's fine-tune jobs, beside a full forward (its
        activations and fresh blocks), may take idle adapters' and prefix-cache memory (never
        another job's activations, never streams): else serving would always take it first."""
        need = max((task.job.stage_costs(1)[0].memory_bytes for task in tasks
                    if task.job is not None and task.job.stage_costs(1)), default=0)
        if need and (self.running or self.waiting):
            blocks = -(-self.max_batched_tokens // self.pool.block_size)
            need += self.costs.inference_bytes(self.max_batched_tokens, True) + blocks * self.costs.kv_block_bytes
        return need > self.ledger.free and self.ledger.reclaim(need, for_finetune=True).freed_bytes > 0

    def schedule(self, now: float) -> Batch:
        started = time.perf_counter()
        self._now = now
        self.ledger.release_reservation()
        self._shed_preempted = []
        self._promised_bytes = 0
        cached_free = self.sync_memory()
        self._make_room_for_decodes()
        if self._shed_preempted:
            cached_free = self.sync_memory()
        tasks = self._tasks()
        if self._make_room_for_finetune(tasks):
            cached_free = self._cached_free()
        budget = self.latency_budget_s if self.policy.uses_latency_budget else math.inf
        if self.policy.uses_slo_headroom:
            budget = self.headroom_budget(now, budget)
        self.iteration_budget_s = budget
        bin = Bin(
            self.costs,
            latency_budget_s=budget,
            memory_bytes=max(0, self.ledger.free + self._promised_bytes),
            free_blocks=self.pool.num_free,
            fresh_blocks=self.pool.num_free - cached_free,
            token_budget=self.max_batched_tokens,
            max_seqs=self.max_num_seqs,
            block_size=self.pool.block_size,
            slo_tbt_s=self.slo_tbt_s,
            slo_ttft_factor=self.slo_ttft_factor,
        )
        self.policy.pack(tasks, bin, now)
        items = self._admit(bin)
        stages = [ScheduledStages(p.task.job, p.amount) for p in bin.finetune if p.task.job is not None]
        if not items and not stages and self.running:
            # Nothing could move (blocks or memory held by partly prefilled prompts): give the
            # policy's victim's blocks back so the others can progress next iteration.
            victim = self.policy.victim(self.running, now)
            self._preempt(victim)
            self._shed_preempted.append(victim)
        self.sync_memory()
        transient = sum(self.costs.inference_bytes(i.num_tokens, i.samples) for i in items)
        transient += sum(p.memory_bytes for p in bin.finetune)
        self.ledger.reserve(transient)
        if items:
            self._next_forward_s = bin.forward_s
        batch = Batch(items, self._shed_preempted, stages, planned_forward_s=bin.forward_s,
                      planned_s=bin.latency_s, reserved_bytes=transient)
        self.overhead_s = time.perf_counter() - started
        return batch

    def headroom_budget(self, now: float, base: float) -> float:
        """This iteration's latency budget grown by the TBT headroom the streams have built up
        (edge_runtime.sched.slo.headroom_budget), between `base` and `max_latency_budget_s`."""
        return headroom_budget(itertools.chain(self.running, self.waiting), now, base, self.max_latency_budget_s,
                               self.slo_tbt_s, self.headroom_margin, self._next_forward_s, self.costs)

    def set_slo(self, slo_tbt_s: float, budget_fraction: float, max_fraction: float) -> None:
        """A new TBT SLO and the latency budgets derived from it (edge_runtime.sched.slo)."""
        self.slo_tbt_s = slo_tbt_s
        self.latency_budget_s, self.max_latency_budget_s = slo_budgets(slo_tbt_s, budget_fraction, max_fraction)
        self.iteration_budget_s = self.latency_budget_s

    def stats(self) -> dict[str, Any]:
        """The scheduler's part of `Engine.stats()`."""
        return {
            "policy": self.policy.name,
            "waiting": len(self.waiting),
            "running": len(self.running),
            "preemptions": self.num_preemptions,
            "rope_recomputes": self.num_rope_recomputes,
            # sequences kv_prune_when = "pressure" turned pruning on for
            "kv_prune_turned_on": self.kv_relief.turned_on if self.kv_relief else 0,
            "scheduler_overhead_ms": round(self.overhead_s * 1000, 4),
            "slo_tbt_ms": round(self.slo_tbt_s * 1000, 3),
            "iteration_budget_ms": budget_ms(self.latency_budget_s),
            # what the last iteration packed to (grows with the streams' TBT headroom under mace)
            "last_iteration_budget_ms": budget_ms(self.iteration_budget_s),
            "policy_params": self.policy.params, "speculation": self.drafter.stats(),
        }

    def _admit(self, bin: Bin) -> list[ScheduledSeq]:
        """Allocate blocks for the packed inference work (prefix-cache hits first)."""
        items: list[ScheduledSeq] = []
        for placement in bin.inference:
            seq = placement.task.seq
            assert seq is not None
            fresh = seq.status is SeqStatus.WAITING
            if fresh and not seq.block_table:
                match_prefix(seq, self.pool, cache_salt(seq, self.rope_switch), self.prefix_tier, placement.amount,
                             self.copy_rows)
                metrics = seq.request.metrics
                if metrics is not None and seq.index == 0 and seq.preemptions == 0:
                    metrics.cached_prompt_tokens = seq.num_computed
            n = min(placement.amount, seq.num_tokens - seq.num_computed)
            if fresh:  # a prefix hit moved its start: the chunk ends on the grid again (#31)
                n = grid_piece(seq.num_computed, n, seq.num_tokens, self.pool.block_size) or n
            draft = self.drafter.admit(seq, n, placement.amount)
            need = self.blocks_needed(seq, n + len(draft))
            if n <= 0 or need > self.pool.num_free:
                if fresh:
                    self._release(seq, keep_tail=False)  # give back matched prefix blocks; retry later
                continue
            for _ in range(need):
                seq.block_table.append(self.pool.allocate())
            if fresh:
                self.waiting.remove(seq)
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
            items.append(ScheduledSeq(seq, n + len(draft), draft))
        return items

    def commit(self, batch: Batch, now: float) -> None:
        """Both halves of an iteration's commit, for callers that ran the stages already."""
        self.commit_inference(batch, now)
        self.commit_finetune(batch)

    def commit_inference(self, batch: Batch, now: float) -> None:
        """After the forward: advance computed counts, register newly full blocks in the prefix
        cache, note when each stream got its token (its decode task's re-queue time)."""
        for item in batch.items:
            seq = item.seq
            seq.num_computed += item.num_tokens - len(item.draft)  # accepted drafts: at commit
            if item.samples:
                self._last_token[seq.seq_id] = now
            register_full_blocks(seq, self.pool, cache_salt(seq, self.rope_switch))

    def commit_finetune(self, batch: Batch) -> None:
        """After the fine-tune stages: release the iteration's memory reservation and record
        the activations the stages' jobs now hold."""
        self.ledger.release_reservation()
        for scheduled in batch.finetune:
            self.ledger.set(MemoryKind.ACTIVATIONS, scheduled.job.job_id, scheduled.job.work.held_bytes)
