"""Preference pairs as the trainer sees them: plain (prompt, chosen, rejected) records and their
token ids. Any object with those three attributes works (the feedback store's `PreferencePair`,
the dataset loaders' records), so training does not depend on the store.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from edge_runtime.chat import encode_prompt
from edge_runtime.errors import BadRequest
from edge_runtime.model.tokenizer import Tokenizer

ChatPrompt = Sequence[dict[str, Any]]


class PairLike(Protocol):
    prompt: str | ChatPrompt
    chosen: str
    rejected: str


@dataclass(frozen=True)
class PreferenceRecord:
    """`prompt` is the model input exactly as served (`RequestOutput.prompt`: chat prompts are
    already rendered through the template) or a list of chat messages, rendered here."""

    prompt: str | tuple[dict[str, Any], ...]
    chosen: str
    rejected: str
    pair_id: int | str | None = None


@dataclass(frozen=True)
class PairTokens:
    """A pair as ids: the shared prompt and the two completions (each ending with EOS unless
    truncated). Both completions are scored given the same prompt ids."""

    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]

    @property
    def key(self) -> bytes:
        """Content hash: the reference log-probs of a pair are cached under it."""
        h = hashlib.blake2b(digest_size=16)
        for part in (self.prompt, self.chosen, self.rejected):
            h.update(len(part).to_bytes(4, "little"))
            h.update(b"".join(t.to_bytes(4, "little") for t in part))
        return h.digest()

    @property
    def completion_length(self) -> int:
        return max(len(self.chosen), len(self.rejected))

    @property
    def num_rows(self) -> int:
        """Token rows one forward over the pair costs when the prompt is shared."""
        return len(self.prompt) + 2 * self.completion_length


def shared_suffix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many trailing ids `a` and `b` share."""
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def trim_shared_suffix(tokens: PairTokens) -> PairTokens:
    """The pair without the tail both completions end with, each keeping at least one id.

    An edit ("Indeed, " + the answer) shares all but its first tokens with the answer it fixes.
    Those shared tokens carry no preference, yet DPO raises them after the chosen opening and
    lowers them after the rejected one: the shared content's likelihood falls where the model
    has not learned the opening yet ("likelihood displacement", Razin et al. 2024), and answers
    drift to generic replies (issue #32). Cut, both terms see only where the user differed."""
    n = min(shared_suffix(tokens.chosen, tokens.rejected), min(len(tokens.chosen), len(tokens.rejected)) - 1)
    if n <= 0:
        return tokens
    return PairTokens(tokens.prompt, tokens.chosen[:-n], tokens.rejected[:-n])


def tokenize_pair(
    tokenizer: Tokenizer,
    pair: PairLike,
    max_prompt_tokens: int = 512,
    max_completion_tokens: int = 256,
    trim_suffix: bool = False,
) -> PairTokens:
    """Prompt through the engine's own `chat.encode_prompt` (what inference fed the model); each
    completion as its text's ids plus EOS, the token that ended the answer when it was served.
    Long prompts keep their tail (the question nearest the answer); long completions their head.
    `trim_suffix`: drop the tail both completions share (`trim_shared_suffix`)."""
    if not pair.chosen and not pair.rejected:
        raise BadRequest("a preference pair needs at least one non-empty completion")
    prompt = pair.prompt if isinstance(pair.prompt, str) else list(pair.prompt)
    _, prompt_ids = encode_prompt(tokenizer, prompt)
    prompt_ids = prompt_ids[-max_prompt_tokens:]
    eos = tokenizer.hf.eos_token_id
    if eos is None:
        raise BadRequest("the tokenizer has no EOS token; completions cannot be terminated")

    def completion(text: str) -> tuple[int, ...]:
        ids = tokenizer.hf.encode(text, add_special_tokens=False) + [int(eos)]
        return tuple(ids[:max_completion_tokens])

    tokens = PairTokens(tuple(prompt_ids), completion(pair.chosen), completion(pair.rejected))
    return trim_shared_suffix(tokens) if trim_suffix else tokens
