"""Scheduling policies: which pending work goes into the next iteration's bin.

The scheduler turns sequences into `Task`s (a decode step, a prefill chunk) and asks the
policy for an ordering; the scheduler then fills the bin in that order within its token and KV
budgets. Policies see costs and ages, never model code.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass

from edge_runtime.sequence import Sequence


class TaskKind(enum.Enum):
    DECODE = "decode"
    PREFILL = "prefill"


@dataclass(eq=False)
class Task:
    kind: TaskKind
    seq: Sequence
    arrival: float  # when the owning request arrived

    @property
    def remaining_tokens(self) -> int:
        return self.seq.num_tokens - self.seq.num_computed


class Policy(ABC):
    """Orders tasks; the first ones get the bin. `victim` picks whom to preempt under KV pressure."""

    name: str = "policy"

    @abstractmethod
    def priority(self, task: Task, now: float) -> float:
        """Higher runs first."""

    def order(self, tasks: list[Task], now: float) -> list[Task]:
        return sorted(tasks, key=lambda t: self.priority(t, now), reverse=True)

    def victim(self, running: list[Sequence], now: float) -> Sequence:
        """The running sequence to preempt when blocks run out: by default the newest arrival,
        so work that has waited longest keeps its progress."""
        return max(running, key=lambda s: (s.arrival, s.seq_id))

    def stop_at_first_misfit(self) -> bool:
        """Whether a prefill that does not fit blocks those behind it (strict arrival order)."""
        return True


class FCFSPolicy(Policy):
    """First come, first served, with running decodes ahead of new prefills (as in vLLM's
    default continuous batching): every running stream advances one token per iteration, and
    waiting prompts are admitted in arrival order as the token budget allows."""

    name = "fcfs"

    def priority(self, task: Task, now: float) -> float:
        rank = 1.0 if task.kind is TaskKind.DECODE else 0.0
        # Earlier arrival = higher priority within a rank; arrival times are far below 1e9.
        return rank * 1e12 - task.arrival


POLICIES: dict[str, type[Policy]] = {"fcfs": FCFSPolicy}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
