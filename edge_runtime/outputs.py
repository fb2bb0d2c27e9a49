"""What the engine hands back: per-token stream events and finished request outputs.

Plain records; no torch here so the daemon and SDK can share them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """A generated token's log-probability (`SamplingParams.logprobs`), with the most likely
    alternatives as (token id, log-probability, bytes); `bytes` is exactly what the token spells
    (it may be part of a UTF-8 character)."""

    token_id: int
    logprob: float
    bytes: bytes
    top: list[tuple[int, float, bytes]] = field(default_factory=list)


@dataclass
class TokenEvent:
    """One step of one candidate, delivered to a request's `on_token` callback.

    `text` is the newly decoded text since the previous event (may be "" while a multi-byte
    UTF-8 character is still incomplete). The last event of a candidate has `finished=True`
    and a `finish_reason` ("stop", "length", "abort", "error").
    """

    request_id: str
    index: int  # candidate index within the request (0..n-1)
    token_id: int | None
    text: str
    finished: bool = False
    finish_reason: str | None = None
    logprob: TokenLogprob | None = None  # of `token_id`, when the request asked for them
    reasoning: str = ""  # new thinking since the previous event (a thinking model's think block)


@dataclass
class CandidateOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per generated token that made text
    # A thinking model's think block, apart from `text` (the answer); None when the reply had no
    # thinking to split (a model without it, or thinking turned off).
    reasoning: str | None = None
    reasoning_tokens: int = 0  # tokens of `reasoning`, its tags included (usage's reasoning_tokens)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    cache_write_tokens: int = 0  # prompt tokens this request added to the prefix cache (full blocks)
    generated_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    candidates: list[CandidateOutput] = field(default_factory=list)
    finished: bool = False
    adapter: str | None = None  # adapter id (user) and version used, e.g. "alice@3"
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the engine failed this request alone (finish reason "error")
    # With thinking: what the answers follow once their thinking is dropped (the prompt followed
    # by an empty think block, edge_runtime.reasoning.prompt_without_thinking; Granite: the
    # prompt its template writes with thinking off); else None.
    answer_prompt: str | None = None

    @property
    def text(self) -> str:
        return self.candidates[0].text if self.candidates else ""

    @property
    def token_ids(self) -> list[int]:
        return self.candidates[0].token_ids if self.candidates else []
