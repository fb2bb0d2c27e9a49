"""Baseline co-serving policies, each in the same `Policy.pack` slot as MACE so all of them can be
replayed on one trace: periodic (Ekya), continuous (AdaInf), fifo (MACE/Bin), token-level
(FlexLLM) and apt (Apt-Serve). Each reproduces the scheduling rule its paper states, on our
stage-granular fine-tuning; nothing else of those systems.
"""

from __future__ import annotations

from edge_runtime.sched.bins import Bin
from edge_runtime.sched.policy import Policy
from edge_runtime.sched.task import Task, TaskKind


def _fcfs_key(task: Task) -> tuple[int, float]:
    # Running streams first (each advances one token per iteration), then arrival order.
    return (0 if task.kind is TaskKind.DECODE else 1, task.arrival)


def _pack_inference_fcfs(tasks: list[Task], bin: Bin, ignore_latency: bool = True) -> None:
    """vLLM-style continuous batching: every decode, then prompts in arrival order, chunked to
    the token budget; a prompt that does not fit blocks those behind it."""
    for task in sorted((t for t in tasks if t.is_inference), key=_fcfs_key):
        amount = bin.largest_fit(task, ignore_latency=ignore_latency)
        if amount:
            bin.add(task, amount)
        elif task.kind is TaskKind.PREFILL:
            break


class PeriodicPolicy(Policy):
    """Periodic retraining, after Ekya (Bhardwaj et al., "Ekya: Continuous Learning of Video
    Analytics Models on Edge Compute Servers", NSDI 2022), as the MACE paper's evaluation uses
    it: every `period_s` seconds inference is preempted and the fine-tune jobs queued at that
    moment run to completion, one job per iteration; inference requests queue up meanwhile
    (synchronous blocking). Between retraining windows: FCFS inference, no fine-tuning."""

    name = "periodic"
    uses_latency_budget = False

    @classmethod
    def defaults(cls) -> dict[str, float]:
        return {"period_s": 20.0}

    def __init__(self, **params: float) -> None:
        super().__init__(**params)
        self._next_window: float | None = None
        # When the open retraining window began: it runs every job queued by then. Jobs are
        # named by their arrival, not collected when the window opens, because a job waiting
        # behind another of the same adapter is not runnable (not among the tasks) until that
        # one finishes.
        self._window_start: float | None = None

    def priority(self, task: Task, now: float) -> float:
        return -task.arrival

    def pack(self, tasks: list[Task], bin: Bin, now: float) -> None:
        period = self.params["period_s"]
        if self._next_window is None:
            self._next_window = now + period
        jobs = sorted((t for t in tasks if t.kind is TaskKind.FINETUNE), key=lambda t: t.arrival)
        if self._window_start is None and now >= self._next_window:
            if jobs:
                self._window_start = now
            else:
                self._next_window = now + period
        if self._window_start is not None:
            pending = [t for t in jobs if t.arrival <= self._window_start]
            if pending:
                amount = bin.largest_fit(pending[0], ignore_latency=True)
                if amount:
                    bin.add(pending[0], amount)
                return  # inference waits for the retraining window
            self._window_start = None
            self._next_window = now + period
        _pack_inference_fcfs(tasks, bin)


class ContinuousPolicy(Policy):
    """Continuous retraining, after AdaInf (Shubha & Shen, "AdaInf: Data Drift Adaptive
    Scheduling for Accurate and SLO-guaranteed Multiple-Model Inference Serving at Edge
    Servers", SIGCOMM 2023), as the MACE paper's evaluation describes it: retraining jobs have
    the highest priority in a FIFO queue and delay inference until they complete. Each
    iteration runs the oldest fine-tune job to completion, then one FCFS inference forward."""

    name = "continuous"
    uses_latency_budget = False

    def priority(self, task: Task, now: float) -> float:
        rank = 2.0 if task.kind is TaskKind.FINETUNE else 1.0 if task.kind is TaskKind.DECODE else 0.0
        return rank * 1e12 - task.arrival

    def pack(self, tasks: list[Task], bin: Bin, now: float) -> None:
        jobs = sorted((t for t in tasks if t.kind is TaskKind.FINETUNE), key=lambda t: t.arrival)
        if jobs:
            amount = bin.largest_fit(jobs[0], ignore_latency=True)
            if amount:
                bin.add(jobs[0], amount)
        _pack_inference_fcfs(tasks, bin)


class FIFOPolicy(Policy):
    """MACE/Bin, the MACE paper's ablation (section 6.3): memory-aware batching disabled, fixed
    maximum batch sizes and FIFO queuing, no hybrid scheduling. The oldest task decides the
    iteration: a fine-tune iteration runs one stage of each of up to `ft_batch` jobs in arrival
    order; an inference iteration takes up to `batch_size` sequences in arrival order. Inference
    and fine-tuning never share an iteration."""

    name = "fifo"
    uses_latency_budget = False

    @classmethod
    def defaults(cls) -> dict[str, float]:
        return {"batch_size": 8, "ft_batch": 2}

    def priority(self, task: Task, now: float) -> float:
        return -task.arrival

    def pack(self, tasks: list[Task], bin: Bin, now: float) -> None:
        queue = self.order(tasks, now)
        if not queue:
            return
        if queue[0].kind is TaskKind.FINETUNE:
            room = int(self.params["ft_batch"])
            for task in (t for t in queue if t.kind is TaskKind.FINETUNE):
                if room == 0:
                    break
                if bin.largest_fit(task, max_stages=1, ignore_latency=True):
                    bin.add(task, 1)
                    room -= 1
            return
        room = int(self.params["batch_size"])
        for task in (t for t in queue if t.is_inference):
            if room == 0:
                break
            amount = bin.largest_fit(task, ignore_latency=True)
            if not amount:
                break  # FIFO: nothing overtakes
            bin.add(task, amount)
            room -= 1


class TokenLevelPolicy(Policy):
    """Token-level co-serving, after FlexLLM (Oliaro et al., "FlexLLM: Token-Level Co-Serving of
    LLM Inference and Finetuning with SLO Guarantees", NSDI 2026), section 6.2: inference is
    scheduled first (iteration-level batching with chunked prefill), then fine-tuning work fills
    what the latency budget leaves, s = argmax f(c, s) <= SLO, in FIFO order and best-effort
    (no ageing: under saturation fine-tuning waits). FlexLLM sizes token windows on the fly; we
    fit whole precomputed stages (`edge_runtime.train.staged`)."""

    name = "token-level"

    def priority(self, task: Task, now: float) -> float:
        rank = 2.0 if task.kind is TaskKind.DECODE else 1.0 if task.kind is TaskKind.PREFILL else 0.0
        return rank * 1e12 - task.arrival

    def pack(self, tasks: list[Task], bin: Bin, now: float) -> None:
        _pack_inference_fcfs(tasks, bin)
        for task in sorted((t for t in tasks if t.kind is TaskKind.FINETUNE), key=lambda t: t.arrival):
            if bin.full:
                break
            amount = bin.largest_fit(task)  # latency-checked: only what the budget leaves
            if amount:
                bin.add(task, amount)


class AptPolicy(Policy):
    """Pending-time knapsack, after Apt-Serve (Gao, Zhang, Shen, Chen, "Apt-Serve: Adaptive
    Request Scheduling on Hybrid Cache for Scalable LLM Inference Serving", SIGMOD 2025),
    section 4: each candidate's value is its pending time (since arrival if not started, since
    its last token otherwise); one whose pending time already broke its SLO is demoted to a
    near-zero value (SLO-aware fallback); the iteration serves the waiting or the running queue,
    whichever has more cumulative pending time; the greedy takes candidates by value per byte of
    memory until the memory budget is spent. Fine-tune stages join as candidates with their
    stage's memory and no SLO. The hybrid KV/hidden cache of Apt-Serve is not reproduced."""

    name = "apt"
    uses_latency_budget = False

    @classmethod
    def defaults(cls) -> dict[str, float]:
        return {"fallback_value": 1e-6}

    def priority(self, task: Task, now: float) -> float:
        return now - task.enqueued

    def pack(self, tasks: list[Task], bin: Bin, now: float) -> None:
        eps = self.params["fallback_value"]

        def value(task: Task) -> float:
            pending = max(now - task.enqueued, 1e-9)
            if task.kind is TaskKind.DECODE and pending > bin.slo_tbt_s:
                return eps
            if task.kind is TaskKind.PREFILL and task.context == 0:
                assert task.seq is not None
                slo = bin.slo_ttft_factor * bin.costs.unloaded_prefill_s(task.seq.num_prompt)
                if pending > slo:
                    return eps
            return pending

        waiting = [t for t in tasks if t.kind is TaskKind.PREFILL]
        running = [t for t in tasks if t.kind is TaskKind.DECODE]
        urgent = waiting if sum(now - t.enqueued for t in waiting) > sum(now - t.enqueued for t in running) else running
        candidates = urgent + [t for t in tasks if t.kind is TaskKind.FINETUNE]
        scored = []
        for task in candidates:
            _, nbytes = bin.cost(task)
            scored.append((value(task) / max(nbytes, 1), task))
        scored.sort(key=lambda vt: vt[0], reverse=True)
        for _, task in scored:
            if bin.free_memory <= 0:
                break
            amount = bin.largest_fit(task, max_stages=1, ignore_latency=True)
            if amount:
                bin.add(task, amount)

