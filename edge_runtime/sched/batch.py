"""What one iteration runs: the forward's items (decode steps and prefill chunks, in the order the
backend feeds them) and the fine-tune stages that run right after it on the engine thread.
Plain records shared by the scheduler, the engine and the backends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from edge_runtime.sequence import Sequence

if TYPE_CHECKING:
    from edge_runtime.sched.finetune import FineTuneJob


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # new tokens fed this iteration (a decode row's drafts included)
    # Speculative tokens fed after a decode row's own (edge_runtime.spec): each of its rows
    # yields logits, so the model's choice after every draft token is checked in one forward.
    draft: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so its last row yields a token."""
        return self.seq.num_computed + self.num_tokens - len(self.draft) == self.seq.num_tokens

    @property
    def num_logits(self) -> int:
        """Rows of logits this item yields: its last row's, plus one per draft token."""
        return 1 + len(self.draft) if self.samples else 0

    def tokens(self) -> list[int]:
        """The token ids fed: the sequence's next ones, then the draft."""
        start = self.seq.num_computed
        fed = self.seq.token_ids[start : start + self.num_tokens - len(self.draft)]
        return fed + list(self.draft) if self.draft else fed


@dataclass
class ScheduledStages:
    job: FineTuneJob
    num_stages: int  # consecutive stages of the job to run this iteration


@dataclass
class Batch:
    items: list[ScheduledSeq]
    preempted: list[Sequence]
    finetune: list[ScheduledStages] = field(default_factory=list)
    planned_forward_s: float = 0.0  # the cost model's estimate of the forward
    planned_s: float = 0.0  # ... of the whole iteration, fine-tune stages included
    reserved_bytes: int = 0  # transient memory reserved in the ledger for this iteration

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)

    @property
    def empty(self) -> bool:
        return not self.items and not self.finetune
