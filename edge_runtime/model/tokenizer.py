"""Text <-> token ids for one model: encoding, end-of-sequence ids, and UTF-8-safe incremental
detokenisation for streaming. Knows nothing of chat: edge_runtime.chat renders a conversation to
text through the template this exposes, then encodes it here."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from edge_runtime.errors import BadRequest, ModelNotAvailable


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelNotAvailable(f"cannot load the tokenizer in {path}: {exc}") from exc
        self.eos_ids = self._eos_ids(Path(path))

    def _eos_ids(self, path: Path) -> frozenset[int]:
        ids: set[int] = set()
        if self.hf.eos_token_id is not None:
            ids.add(int(self.hf.eos_token_id))
        for name in ("generation_config.json", "config.json"):
            file = path / name
            if file.exists():
                value = json.loads(file.read_text()).get("eos_token_id")
                if isinstance(value, int):
                    ids.add(value)
                elif isinstance(value, list):
                    ids.update(int(v) for v in value)
        return frozenset(ids)

    def __len__(self) -> int:
        return len(self.hf)

    @property
    def chat_template(self) -> str | None:
        """The model's own chat template (edge_runtime.chat renders through it), or None."""
        template = getattr(self.hf, "chat_template", None)
        return template if isinstance(template, str) and template else None

    def encode(self, text: str, *, special_tokens: bool = True) -> list[int]:
        """The token ids of `text`; `special_tokens=False` for text a chat template already
        wrapped in every special token it wants."""
        return list(self.hf.encode(text, add_special_tokens=special_tokens))

    def checked_ids(self, ids: Sequence[int]) -> list[int]:
        """Token ids given directly, checked against the vocabulary."""
        ids = list(ids)
        if any(not 0 <= t < len(self.hf) for t in ids):
            raise BadRequest(f"prompt token ids must be in [0, {len(self.hf)})", param="prompt")
        return ids

    def text_of(self, ids: Sequence[int]) -> str:
        """The text ids spell, special tokens included (a prompt given as ids, shown as text)."""
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def stream_decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self)


class IncrementalDecoder:
    """Feeds one token at a time and returns the text it completes ("" while a multi-byte UTF-8
    character is still split across tokens), using the `tokenizers` streaming decoder."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = tokenizer.hf._tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)

    def step(self, token_id: int) -> str:
        piece = self._stream.step(self._backend, int(token_id))
        return piece or ""
