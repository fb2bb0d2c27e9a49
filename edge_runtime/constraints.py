"""Structured output: a grammar per sequence (any JSON, a JSON schema, a regex, a Lark grammar)
that masks the tokens it cannot continue with, compiled and tracked by llguidance.

Owns the grammar side only: which tokens may come next and whether the text is complete. The
sampler applies the mask; the engine feeds each chosen token back (`consume`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edge_runtime.errors import BadRequest

if TYPE_CHECKING:
    import torch

    from edge_runtime.model.tokenizer import Tokenizer

KINDS = ("json", "json_schema", "regex", "lark")
MAX_GRAMMAR_CHARS = 1 << 18  # 256 KiB of schema, regex or grammar text
PARAM = "response_format"  # the request field a constraint comes from, named in its errors
# Whitespace between JSON tokens: what compact and pretty-printed JSON use (one space or tab, one
# line break indented by at most 32 columns). llguidance's default allows any run of it, and a
# small model can then spend every remaining token on blank lines.
JSON_WHITESPACE = r"[ \t]?(\r?\n[ \t]{0,32})?"


@dataclass(frozen=True)
class Constraint:
    """What a sequence's text must match: `json` (any JSON value that is an object, OpenAI's
    JSON mode), `json_schema` (`value`: the schema as JSON text), `regex` (`value`: a pattern
    the whole output matches) or `lark` (`value`: a Lark grammar, llguidance's dialect)."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise BadRequest(f"constraint kind must be one of {', '.join(KINDS)}; got {self.kind!r}", param=PARAM)
        if not isinstance(self.value, str) or len(self.value) > MAX_GRAMMAR_CHARS:
            raise BadRequest(f"a {self.kind} constraint must be a string of at most {MAX_GRAMMAR_CHARS} characters",
                             param=PARAM)
        if self.kind != "json" and not self.value.strip():
            what = {"json_schema": "schema", "regex": "pattern"}.get(self.kind, "grammar")
            raise BadRequest(f"a {self.kind} constraint needs its {what}", param=PARAM)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Constraint:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    def grammar(self) -> str:
        """The llguidance grammar text."""
        from llguidance import LLMatcher

        options = {"whitespace_pattern": JSON_WHITESPACE}
        if self.kind == "json":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except ValueError as exc:
                raise BadRequest(f"the JSON schema is not valid JSON: {exc}", param=PARAM) from None
            if not isinstance(schema, (dict, bool)):
                raise BadRequest("a JSON schema must be an object (or true/false)", param=PARAM)
            try:
                return LLMatcher.grammar_from_json_schema(schema, overrides=options)
            except ValueError as exc:
                raise BadRequest(f"the JSON schema cannot be compiled: {exc}", param=PARAM) from None
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)
        return LLMatcher.grammar_from_lark(self.value)


class GrammarCompiler:
    """One per engine: the tokenizer in llguidance's form (built on first use, ~1 s), matchers
    for new sequences, and the masks of a step's constrained rows computed together."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll: Any = None
        self._executor: Any = None

    @property
    def ll_tokenizer(self) -> Any:
        if self._ll is None:
            import llguidance
            import llguidance.hf

            self._ll = llguidance.hf.from_tokenizer(self.tokenizer.hf, n_vocab=self.vocab_size,
                                                    eos_token=sorted(self.tokenizer.eos_ids))
            self._executor = llguidance.LLExecutor()
        return self._ll

    def matcher(self, constraint: Constraint) -> Any:
        """A fresh matcher at the start of the text; BadRequest naming the fault if the grammar
        does not compile."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.ll_tokenizer, constraint.grammar(), log_level=0)
        if matcher.is_error():
            raise BadRequest(f"the {constraint.kind} constraint does not compile: {matcher.get_error()}",
                             param=PARAM)
        return matcher

    def masks(self, matchers: list[Any]) -> torch.Tensor:
        """Allowed-token bitmasks [len(matchers), ceil(vocab / 32)] (bit set = allowed), one row
        per matcher, computed in parallel."""
        import llguidance.torch as lt

        self.ll_tokenizer  # noqa: B018 - builds the executor with the tokenizer
        mask = lt.allocate_token_bitmask(len(matchers), self.vocab_size)
        lt.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], mask)
        return mask

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for (byte-level BPE, SentencePiece byte fallback and
        special tokens alike)."""
        return self.ll_tokenizer.decode_bytes([int(token_id)])


def unpack_masks(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed bitmask rows [n, ceil(vocab / 32)] int32 -> bool [n, vocab] (True = allowed), all
    rows in one numpy call: token t is bit t % 32 of word t // 32, so the words' little-endian
    bytes unpacked little bit first are the tokens in order."""
    import numpy as np
    import torch

    words = np.ascontiguousarray(packed.numpy(), dtype="<i4")
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_)[:, :vocab_size])
