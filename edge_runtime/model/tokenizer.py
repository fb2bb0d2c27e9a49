"""Text <-> token ids for one model: prompts, chat messages through the model's own chat
template, end-of-sequence ids, and UTF-8-safe incremental detokenisation for streaming."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from edge_runtime.chat import ChatPrompt, ToolStyle, render, template_tool_style
from edge_runtime.errors import BadRequest, ModelNotAvailable

ChatMessages = Sequence[dict[str, Any]]


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

    def render_chat(self, messages: ChatMessages) -> str:
        if not messages:
            raise BadRequest("chat messages must not be empty")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise BadRequest("each chat message must be a dict with string 'role' and 'content'")
        if not getattr(self.hf, "chat_template", None):
            raise BadRequest("this model has no chat template; send a plain prompt instead")
        return self.hf.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)

    @property
    def tool_style(self) -> ToolStyle:
        """How this model writes a tool call (chat.template_tool_style)."""
        template = getattr(self.hf, "chat_template", None)
        return template_tool_style(template if isinstance(template, str) else None)[1]

    def encode_prompt(self, prompt: str | ChatMessages | ChatPrompt | Sequence[int]) -> tuple[str, list[int]]:
        """Returns the prompt text (chat rendered through the template) and its token ids. A
        list of ints is taken as the token ids themselves (checked against the vocabulary)."""
        if isinstance(prompt, str):
            text = prompt
            ids = self.hf.encode(text)
        elif isinstance(prompt, ChatPrompt):
            text = render(self.hf, prompt)
            ids = self.hf.encode(text, add_special_tokens=False)
        elif isinstance(prompt, (list, tuple)) and prompt and all(type(t) is int for t in prompt):
            ids = list(prompt)
            if any(not 0 <= t < len(self.hf) for t in ids):
                raise BadRequest(f"prompt token ids must be in [0, {len(self.hf)})", param="prompt")
            text = self.hf.decode(ids, skip_special_tokens=False)
        elif isinstance(prompt, (list, tuple)):
            text = self.render_chat(prompt)
            # The template already placed every special token it wants.
            ids = self.hf.encode(text, add_special_tokens=False)
        else:
            raise BadRequest(f"prompt must be a string, chat messages or token ids, got {type(prompt).__name__}")
        if not ids:
            raise BadRequest("prompt is empty")
        return text, list(ids)

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
