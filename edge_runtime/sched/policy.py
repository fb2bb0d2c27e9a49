"""Scheduling policies: which pending work goes into the next iteration's bin.

The scheduler turns sequences and fine-tune jobs into `Task`s (a decode step, a prefill chunk,
fine-tune stages) and hands them with the iteration's `Bin` (latency, memory, KV and token
capacity) to the policy's `pack`. Every policy, MACE and each baseline, fills that same slot.
Policies see costs and ages, never model code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from edge_runtime.sched.bins import Bin
from edge_runtime.sched.task import Task, TaskKind
from edge_runtime.sequence import Sequence


class Policy(ABC):
    """Orders tasks and packs the iteration's bin. `victim` picks whom to preempt under KV or
    memory pressure."""

    name: str = "policy"
    # Policies that drop the MACE latency budget (throughput-first baselines) set this False; the
    # scheduler then gives them an unbounded latency capacity.
    uses_latency_budget: bool = True
    # Policies that may spend the streams' accumulated TBT headroom (see
    # `Scheduler.headroom_budget`) get a latency budget that grows with it.
    uses_slo_headroom: bool = False

    def __init__(self, **params: Any) -> None:
        unknown = set(params) - set(self.defaults())
        if unknown:
            raise ValueError(f"unknown parameter(s) for policy {self.name!r}: {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(sorted(self.defaults())) or 'none'}")
        self.params = {**self.defaults(), **params}

    @classmethod
    def defaults(cls) -> dict[str, float]:
        return {}

    @abstractmethod
    def priority(self, task: Task, now: float) -> float:
        """Higher runs first."""

    def order(self, tasks: list[Task], now: float) -> list[Task]:
        return sorted(tasks, key=lambda t: self.priority(t, now), reverse=True)

    def pack(self, tasks: list[Task], bin: Bin, now: float) -> None:
        """Fill `bin` from `tasks`. Default: greedy in `order`, each task taking the largest
        piece that fits (a prefill chunk, a run of stages)."""
        for task in self.order(tasks, now):
            if bin.full:
                break
            amount = bin.largest_fit(task)
            if amount:
                bin.add(task, amount)

    def victim(self, running: list[Sequence], now: float) -> Sequence:
        """The running sequence to preempt when blocks or memory run out: by default the newest
        arrival, so work that has waited longest keeps its progress."""
        return max(running, key=lambda s: (s.arrival, s.seq_id))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **self.params}


class FCFSPolicy(Policy):
    """First come, first served, with running decodes ahead of new prefills (as in vLLM's
    default continuous batching): every running stream advances one token per iteration, and
    waiting prompts are admitted in arrival order as the token budget allows. A prompt that does
    not fit blocks those behind it. Fine-tune stages, which the original has no notion of, queue
    in arrival order with the prompts, one stage per job per iteration, with no latency budget."""

    name = "fcfs"
    uses_latency_budget = False

    def priority(self, task: Task, now: float) -> float:
        rank = 1.0 if task.kind is TaskKind.DECODE else 0.0
        # Earlier arrival = higher priority within a rank; arrival times are far below 1e9.
        return rank * 1e12 - task.arrival

    def pack(self, tasks: list[Task], bin: Bin, now: float) -> None:
        for task in self.order(tasks, now):
            if bin.full:
                break
            amount = bin.largest_fit(task, max_stages=1)
            if amount:
                bin.add(task, amount)
            elif task.kind is TaskKind.PREFILL:
                break  # strict arrival order
