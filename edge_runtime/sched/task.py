"""A unit of pending work as policies see it: a decode step, a prefill chunk or a fine-tune job's
stages, with its arrival and waiting time. The scheduler makes them; bins price them; policies
order them. A plain record.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from edge_runtime.sched.finetune import FineTuneJob
from edge_runtime.sequence import Sequence


class TaskKind(enum.Enum):
    DECODE = "decode"
    PREFILL = "prefill"
    FINETUNE = "finetune"


@dataclass(eq=False, slots=True)
class Task:
    kind: TaskKind
    arrival: float  # when the owning request (or preference pair) arrived: FIFO order
    enqueued: float  # when it last made progress or arrived: the waiting time that ages it
    seq: Sequence | None = None
    job: FineTuneJob | None = None
    remaining: int = 1  # tokens still to feed (inference) or stages still to run (fine-tune)
    context: int = 0  # tokens already in the KV cache (inference)

    @property
    def is_inference(self) -> bool:
        return self.kind is not TaskKind.FINETUNE

    @property
    def remaining_tokens(self) -> int:
        return self.remaining if self.is_inference else 0
