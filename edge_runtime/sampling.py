"""Sampling parameters of a request and the per-row token choice: logit bias, presence and
frequency penalties and a grammar's mask shape the row, then greedy or temperature/top-k/top-p
picks the token, and the log-probabilities asked for are read off the shaped row.

Owns only how one next token is picked from logits; stopping on strings is the engine's job.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edge_runtime.constraints import Constraint
from edge_runtime.errors import BadRequest, MaceError

if TYPE_CHECKING:
    import torch

class SamplingError(MaceError):
    """A row's logits could not be sampled (not finite): the request fails, the engine goes on."""

    code = "internal"


@dataclass(frozen=True)
class SamplingParams:
    """How to continue a prompt. `temperature == 0` means greedy (argmax)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1  # candidates per prompt (e.g. two answers for the user to choose from)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Log-probabilities: None = none; k = the chosen token's and the k most likely.
    logprobs: int | None = None
    # OpenAI's penalties on tokens already generated (not the prompt's): each candidate token's
    # logit minus count * frequency_penalty, minus presence_penalty once it occurred.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), or a mapping
    constraint: Constraint | None = None  # structured output (constraints.py)
    # Prompt-lookup speculation (docs/speculative.md): "auto" = as the engine decides from the
    # request's acceptance, "on" = draft whenever a draft is found, "off" = never.
    speculation: str = "auto"

    def __post_init__(self) -> None:
        # Only what keeps the sampler itself sound is checked here: a request's bounds (the
        # protocol's ranges, n <= 16, 20 logprobs, |bias| <= 100 on 1024 tokens) are declared
        # and checked once where it enters the daemon (daemon/wire/schema.py); an in-process
        # caller may go past them as far as the arithmetic below stays defined.
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not _integer(self.max_tokens) or self.max_tokens < 1:  # no step would produce a token
            raise BadRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _number(self.temperature) or self.temperature < 0:  # logits are divided by it
            raise BadRequest(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _integer(self.top_k) or self.top_k < 0:
            raise BadRequest(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:  # 0 would keep no token at all
            raise BadRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _integer(self.n) or self.n < 1:
            raise BadRequest(f"n must be a positive integer, got {self.n!r}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):  # "" would stop at once
            raise BadRequest("stop strings must be non-empty strings")
        if self.seed is not None and not _integer(self.seed):
            raise BadRequest(f"seed must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (not _integer(self.logprobs) or self.logprobs < 0):
            raise BadRequest(f"logprobs must be an integer >= 0 or None, got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):  # NaN or inf would poison the row
            if not _number(getattr(self, name)):
                raise BadRequest(f"{name} must be a finite number, got {getattr(self, name)!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        try:
            pairs = tuple((int(t), float(b)) for t, b in bias)
        except (TypeError, ValueError):
            raise BadRequest("logit_bias must map token ids to numbers") from None
        # A negative id would index the row from its end; a non-finite bias poisons the row.
        if any(t < 0 or not math.isfinite(b) for t, b in pairs):
            raise BadRequest("logit_bias must map token ids >= 0 to finite numbers")
        object.__setattr__(self, "logit_bias", pairs)
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise BadRequest("constraint must be a Constraint")
        if self.speculation not in ("auto", "on", "off"):
            raise BadRequest(f"speculation must be 'auto', 'on' or 'off', got {self.speculation!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether `shape_logits` changes the row before the choice (bias or penalties; a
        grammar's mask is applied to the batch's rows together, `mask_rows`)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def mask_rows(logits: torch.Tensor, rows: list[int], allowed: torch.Tensor) -> torch.Tensor:
    """A float32 copy of a batch's logits [batch, vocab] with the tokens its grammars disallow at
    -inf; `allowed` (bool [len(rows), vocab]) is the mask of batch row `rows[i]`. The batch is
    masked together so that the engine's one argmax over all rows serves the constrained rows
    too: per row, the unpacked mask, the float32 copy and torch's argmax cost several times
    the grammars' own masks at 16 rows of a 49k vocabulary (tools/bench_structured.py)."""
    import torch

    shaped = logits.detach().to(torch.float32, copy=True)
    index = torch.tensor(rows, dtype=torch.long)
    shaped[index] = shaped[index].masked_fill(~allowed, float("-inf"))
    return shaped


def shape_logits(logits: torch.Tensor, params: SamplingParams, counts: Mapping[int, int] | None = None) -> torch.Tensor:
    """One row [vocab] in float32 as the choice sees it: plus the logit bias, minus the penalties
    for the tokens generated so far (`counts`: token id -> times). A grammar's mask comes first
    (`mask_rows`): a disallowed token stays at -inf, as bias and penalties are finite. Returns a
    new tensor; `logits` is untouched."""
    import torch

    row = logits.detach().to(torch.float32).clone()
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        row.index_add_(0, ids, torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32))
    if counts and (params.presence_penalty or params.frequency_penalty):
        ids = torch.tensor(list(counts), dtype=torch.long)
        times = torch.tensor(list(counts.values()), dtype=torch.float32)
        row.index_add_(0, ids, -(times * params.frequency_penalty + params.presence_penalty))
    return row


def choose(row: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token from a shaped row: argmax when greedy, else `sample_next`."""
    import torch

    if params.greedy:
        return int(torch.argmax(row))
    return sample_next(row, params, generator)


def token_logprobs(row: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log-probability under the shaped row's distribution (temperature 1,
    before top-k/top-p) and the k most likely tokens with theirs, best first; tokens a grammar
    or a -100 bias ruled out (probability 0) are not listed."""
    import torch

    logp = torch.log_softmax(row.to(torch.float64), dim=-1)
    top: list[tuple[int, float]] = []
    if k:
        values, ids = torch.topk(logp, min(k, logp.shape[-1]))
        top = [(int(i), float(v)) for i, v in zip(ids, values, strict=True) if math.isfinite(v)]
    return float(logp[token]), top


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from one row of logits [vocab].

    Safe for every value the protocol admits: the row is shifted so its best score is 0 and
    worked in float64 before it is divided by the temperature, so a temperature as small as the
    smallest positive double (5e-324) gives 0 for the best token and -inf or a finite negative
    number for the rest (never inf - inf or 0 / 0), and a `top_p` as small as 5e-324 is compared
    in float64 (in float32 it would round to 0 and drop every token), with tokens ranked by score. A row whose logits are not
    finite raises `SamplingError`: the model, not the request, is wrong, and the engine fails
    that request alone."""
    import torch

    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(sampling_probs(logits, params), 1, generator=generator))


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample_next` draws from (float64 [vocab]): temperature, then top-k and
    top-p; what speculative verification accepts drafts against (edge_runtime.spec.verify)."""
    import torch

    scores = logits.detach().to(torch.float64)
    best = scores.max()
    if not torch.isfinite(best) or torch.isnan(scores).any():
        raise SamplingError("the model's logits for this row are not finite numbers")
    scores = (scores - best) / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        # Rank by score, not by probability: scores a hair apart can round to equal
        # probabilities, and the nucleus must still start at the best token (ties: the first,
        # as argmax picks).
        sorted_scores, order = torch.sort(scores, descending=True, stable=True)
        sorted_probs = torch.softmax(sorted_scores, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays:
        # its preceding mass is exactly 0).
        drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter_(-1, order, sorted_scores)
    return torch.softmax(scores, dim=-1)
