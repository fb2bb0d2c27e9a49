"""Sampling parameters of a request and the per-row token choice (greedy, temperature, top-k, top-p).

Owns only how one next token is picked from logits; stopping on strings is the engine's job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise BadRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (0.0 <= float(self.temperature) <= 100.0):
            raise BadRequest(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise BadRequest(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise BadRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.n, int) or not (1 <= self.n <= 16):
            raise BadRequest(f"n must be an integer in [1, 16], got {self.n!r}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise BadRequest("stop strings must be non-empty strings")
        if self.seed is not None and not isinstance(self.seed, int):
            raise BadRequest(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
