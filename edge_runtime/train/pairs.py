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


def tokenize_pair(
    tokenizer: Tokenizer,
    pair: PairLike,
    max_prompt_tokens: int = 512,
    max_completion_tokens: int = 256,
) -> PairTokens:
    """Prompt through the engine's own `chat.encode_prompt` (what inference fed the model); each
    completion as its text's ids plus EOS, the token that ended the answer when it was served.
    Long prompts keep their tail (the question nearest the answer); long completions their head."""
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

    return PairTokens(tuple(prompt_ids), completion(pair.chosen), completion(pair.rejected))
