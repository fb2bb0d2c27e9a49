"""What the SDK hands back: its errors, streamed tokens, finished generations, and the readers that
turn the daemon's reply messages into them. No I/O; both clients share it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ClientError(Exception):
    """Base of everything the SDK raises."""


class DaemonUnavailable(ClientError):
    """No answer: the daemon is not running, not reachable, or did not reply within the timeout."""


class RemoteError(ClientError):
    """The daemon answered with a typed error (`code`, see docs/protocol.md)."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None,
                 details: dict[str, Any] | None = None, param: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.details = details or {}
        self.param = param  # the request field at fault, for bad_request


@dataclass(frozen=True)
class Token:
    """A piece of streamed text of candidate `index`; `logprobs` (when asked for) of the piece's
    tokens, `tool_calls` that completed in it (when tools were offered)."""

    index: int
    text: str
    token_id: int | None = None
    logprobs: list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning: str | None = None  # new thinking of a thinking model (then `text` is answer only)


@dataclass(frozen=True)
class Candidate:
    index: int
    text: str  # with tools offered: the content, without the calls
    finish_reason: str | None  # "stop", "length", "tool_calls", ...
    completion_tokens: int
    logprobs: list[dict[str, Any]] | None = None  # {token_id, logprob, bytes, top: [[id, logprob, bytes]]}
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's shape: {id, type, function: {name, arguments}}
    reasoning: str | None = None  # a thinking model's think block (None: no thinking was split off)


@dataclass(frozen=True)
class GenerateResult:
    """A finished generate. Give `interaction_id` back with the user's feedback."""

    interaction_id: str
    candidates: list[Candidate]
    model: str = ""
    adapter: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    timing: dict[str, float] = field(default_factory=dict)
    recorded: bool = False
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def text(self) -> str:
        return self.candidates[0].text if self.candidates else ""

    @property
    def reasoning(self) -> str | None:
        """The first candidate's thinking (None: no thinking was split off)."""
        return self.candidates[0].reasoning if self.candidates else None

    @classmethod
    def from_reply(cls, result: dict[str, Any]) -> GenerateResult:
        return cls(
            interaction_id=result.get("interaction_id", ""),
            candidates=[Candidate(c["index"], c["text"], c.get("finish_reason"), c.get("completion_tokens", 0),
                                  c.get("logprobs"), c.get("tool_calls"), c.get("reasoning"))
                        for c in result.get("candidates", [])],
            model=result.get("model", ""), adapter=result.get("adapter"),
            usage=result.get("usage", {}), timing=result.get("timing", {}),
            recorded=bool(result.get("recorded")), raw=result)


def read_final(message: dict[str, Any]) -> dict[str, Any]:
    """The result of a final reply, or the RemoteError it carries."""
    if message.get("type") == "error":
        error = message.get("error") or {}
        raise RemoteError(str(error.get("code", "internal")), str(error.get("message", "")),
                          error.get("retry_after_s"), error.get("details"), error.get("param"))
    return message.get("result") or {}


def read_token(message: dict[str, Any]) -> Token:
    return Token(int(message.get("index", 0)), str(message.get("text", "")), message.get("token_id"),
                 message.get("logprobs"), message.get("tool_calls"), message.get("reasoning"))
