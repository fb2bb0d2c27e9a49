"""Unpaired feedback as the trainer sees it (one answer judged desirable or undesirable: a lone
thumb, a rating), tokenized into the two rows a staged task runs (its KTO objective:
train/objectives.py).

An unpaired example runs through the same windows as a pair: its own answer in the first
completion row and, in the second, a *mismatched* answer (another of the user's recent answers,
scored under this prompt). The second row gives, in the same forward, one sample of the KL
reference point z0 (TRL pairs each prompt with the previous example's answer in its batch the
same way); its gradient seed is zero because z0 is detached. So the scheduler sees the same
stage kinds and costs as for a DPO pair, and the staged gradients equal full autograd.

z0 for an example: max(0, mean of the mismatched log-ratios of the user's last
`kto_kl_window` trained examples and its own), each measured by its example's own forward
stages (TRL: the mean over the batch). Detached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from edge_runtime.chat import encode_prompt
from edge_runtime.errors import BadRequest
from edge_runtime.model.tokenizer import Tokenizer
from edge_runtime.train.pairs import PairTokens


class UnpairedLike(Protocol):
    prompt: Any  # str (rendered) or chat messages
    completion: str
    desirable: bool


@dataclass(frozen=True)
class UnpairedRecord:
    """One answer and the user's verdict on it. `prompt` as in `PreferenceRecord`."""

    prompt: str | tuple[dict[str, Any], ...]
    completion: str
    desirable: bool
    example_id: int | str | None = None


@dataclass(frozen=True)
class UnpairedTokens:
    """`tokens.chosen` is the judged answer, `tokens.rejected` the mismatched answer whose log-ratio
    samples z0 (just EOS, and no sample, when the user has no other answer yet)."""

    tokens: PairTokens
    desirable: bool
    has_kl: bool


def tokenize_unpaired(
    tokenizer: Tokenizer,
    example: UnpairedLike,
    recent: Sequence[tuple[int, ...]] = (),
    max_prompt_tokens: int = 512,
    max_completion_tokens: int = 256,
) -> UnpairedTokens:
    """Prompt ids as `tokenize_pair` makes them; the answer as its ids plus EOS (truncated); the
    mismatched answer: the newest of `recent` (the user's recent answers, as ids) that differs."""
    if not isinstance(example.desirable, bool):
        raise BadRequest(f"an unpaired example needs desirable true or false; got {example.desirable!r}")
    if not example.completion:
        raise BadRequest("an unpaired example needs a non-empty answer")
    eos = tokenizer.hf.eos_token_id
    if eos is None:
        raise BadRequest("the tokenizer has no EOS token; completions cannot be terminated")
    prompt = example.prompt if isinstance(example.prompt, str) else list(example.prompt)
    _, prompt_ids = encode_prompt(tokenizer, prompt)
    completion = tuple((tokenizer.hf.encode(example.completion, add_special_tokens=False) + [int(eos)])
                       [:max_completion_tokens])
    kl_completion = mismatched_completion(recent, completion)
    has_kl = kl_completion is not None
    other = kl_completion if kl_completion is not None else (int(eos),)
    return UnpairedTokens(PairTokens(tuple(prompt_ids[-max_prompt_tokens:]), completion, other),
                          example.desirable, has_kl)


def mismatched_completion(recent: Sequence[tuple[int, ...]], own: tuple[int, ...]) -> tuple[int, ...] | None:
    """The newest of the user's recent answers that is not this one (TRL: the previous example's)."""
    for completion in reversed(recent):
        if completion != own:
            return completion
    return None
