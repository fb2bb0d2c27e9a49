"""Requests and their sequences: one request (a prompt, its sampling parameters, its callback)
owns n sequences, one per candidate answer. A sequence is the unit the scheduler places in a
batch and the KV cache stores; it knows its tokens, its cache blocks and its output text."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from edge_runtime.lora.registry import ServedAdapter
from edge_runtime.model.tokenizer import IncrementalDecoder
from edge_runtime.outputs import (
    CandidateOutput,
    RequestMetrics,
    RequestOutput,
    TokenEvent,
    TokenLogprob,
)
from edge_runtime.reasoning import Phase
from edge_runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from edge_runtime.lora.registry import AdapterRef


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class Thinking:
    """How a request's replies think: where they start (edge_runtime.reasoning.Phase), and
    whether its grammar shapes only the answer (attached once the think block closes)."""

    phase: Phase
    grammar_after: bool = False
    answer_prompt: str = ""  # the prompt the answer follows once the thinking is dropped (feedback)
    answer_tags: tuple[str, str] | None = None  # a wrapper around the answer (Granite's <response>)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    adapter_key: str = ""  # "user@version" or "" for the base model (the output names it)
    lora_slot: int = -1  # row index into the engine's active adapters (-1 = base model)
    adapter: AdapterRef | None = None  # the version pinned at admission (None = base model)
    fleet: AdapterRef | None = None  # the fleet version pinned at admission, beneath `adapter`
    owner: str = ""  # the user the prompt belongs to (the prefix cache's disk tier erases by it)
    scope: str = ""  # who may share its prefix-cache blocks (the daemon: the app; "" everyone)
    on_token: Callable[[TokenEvent], None] | None = None
    seqs: list[Sequence] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    error: str | None = None  # why the engine failed this request alone, if it did
    thinking: Thinking | None = None  # a thinking model's reply, split into thinking and answer

    @property
    def finished(self) -> bool:
        return all(s.status is SeqStatus.FINISHED for s in self.seqs)

    @property
    def served(self) -> ServedAdapter | None:
        """The adapters this request's rows get (None: the base model alone)."""
        if self.adapter is None and self.fleet is None:
            return None
        return ServedAdapter(self.fleet, self.adapter)

    @property
    def cache_salt(self) -> str:
        """Separates this request's prefix-cache blocks from those of other adapter versions and
        other scopes: a prefix hit is faster, so a shared block would tell one app another's prompt."""
        served = self.served
        key = "" if served is None else served.key
        return f"{self.scope}|{key}" if self.scope else key

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_ids),
            candidates=[
                CandidateOutput(s.index, s.text, s.output_ids, s.finish_reason,
                                s.logprobs if self.params.logprobs is not None else None,
                                s.thought if s.reasoning is not None else None,
                                s.reasoning.thinking_tokens if s.reasoning is not None else 0)
                for s in self.seqs
            ],
            finished=self.finished,
            adapter=self.adapter_key or None,
            metrics=self.metrics,
            error=self.error,
            answer_prompt=self.thinking.answer_prompt if self.thinking else None,
        )


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request: Request
    index: int  # candidate index within the request
    token_ids: list[int]
    decoder: IncrementalDecoder
    generator: torch.Generator | None = None
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # leading tokens whose keys/values are in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of the full, registered blocks
    finish_reason: str | None = None
    text: str = ""  # output text so far (stop strings cut off)
    emitted: int = 0  # characters of `text` already streamed
    preemptions: int = 0
    matcher: Any = None  # the grammar's state (llguidance LLMatcher) when the request is constrained
    counts: dict[int, int] = field(default_factory=dict)  # generated token -> times (for penalties)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    kv_pruning: Any = None  # its decode KV pruning state (edge_runtime.kv.pruning.HeadPruning), if on
    kv_layout: Any = None  # where compaction packed its pruned KV (edge_runtime.kv.compaction), if it did
    reasoning: Any = None  # its ReasoningSplitter when the request thinks: `text` is then the answer
    thought: str = ""  # the thinking so far, apart from `text`
    pending_matcher: Any = None  # the grammar's state, waiting for the think block to close
    spec: Any = None  # its speculation state (edge_runtime.spec.SpecState), once a decode row asked

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def arrival(self) -> float:
        return self.request.arrival

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def num_slots(self) -> int:
        """Cache slots its computed tokens take: one each, fewer once compaction packed its KV."""
        return self.num_computed - (self.kv_layout.slots_saved if self.kv_layout is not None else 0)

    @property
    def in_prefill(self) -> bool:
        """True while more than the last token still has to go through the model."""
        return self.num_tokens - self.num_computed > 1
