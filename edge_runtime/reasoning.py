"""Thinking models: which chat templates have a thinking switch and how their models mark the
thinking (`<think>` ... `</think>`), where a reply starts (the prompt may open or close the
block), and the split of generated text into the thinking and the answer, token by token.
Knows nothing of sampling, grammars or the wire.
"""

from __future__ import annotations

import enum

OPEN, CLOSE = "<think>", "</think>"
# The template variable that turns thinking on or off: Qwen3's and SmolLM3's templates read
# `enable_thinking` (both default to thinking when it is undefined).
SWITCH = "enable_thinking"


class Phase(enum.Enum):
    BEFORE = "before"  # the model may open a think block, or answer straight away
    THINKING = "thinking"  # inside the block: text is thinking until the closing tag
    ANSWER = "answer"  # after the block (or it never opened): text is the answer


def template_thinks(template: str | None) -> bool:
    """Whether a chat template has the thinking switch and writes the `<think>` block."""
    return bool(template) and SWITCH in template and CLOSE in template  # type: ignore[operator]


def opening_phase(prompt_text: str) -> Phase | None:
    """Where the reply to a rendered prompt starts, for a template that thinks: None when the
    prompt already holds a closed, empty block (thinking turned off: Qwen3 and SmolLM3 write
    `<think>\\n\\n</think>` after the assistant's header), THINKING when the prompt opened the
    block itself (Qwen3-Thinking-2507 and DeepSeek-R1-style templates), BEFORE otherwise."""
    tail = prompt_text.rstrip()
    if tail.endswith(CLOSE):
        return None
    if tail.endswith(OPEN):
        return Phase.THINKING
    return Phase.BEFORE


def prompt_without_thinking(prompt_text: str, phase: Phase) -> str:
    """The prompt followed by an empty, closed think block: the text the answer follows once the
    thinking is dropped (what the templates write when thinking is off). Feedback pairs train
    on it, so the chosen and the rejected answer share one prompt whatever each one thought."""
    if phase is Phase.THINKING:
        return prompt_text + "\n" + CLOSE + "\n\n"
    return prompt_text + OPEN + "\n\n" + CLOSE + "\n\n"


class ReasoningSplitter:
    """Splits one reply's text, fed piece by piece as it is decoded, into (thinking, answer)
    pieces. A tag split across pieces is held back until it is whole or cannot be one; the
    newlines that frame the block (`<think>\\n ... \\n</think>\\n\\n`) belong to neither part.
    A reply cut inside the block (max_tokens) is all thinking and has an empty answer."""

    def __init__(self, phase: Phase = Phase.BEFORE) -> None:
        self.phase = phase
        self.held = ""  # text not yet given out: a partial tag, or newlines that may frame one
        self.trim_answer = False  # drop the newlines right after the closing tag
        self.trim_thinking = phase is Phase.THINKING  # drop the newlines right after the opening tag
        self.opened = phase is Phase.THINKING  # whether the reply had a think block

    @property
    def answering(self) -> bool:
        """True once the reply is past the think block (or answered without one)."""
        return self.phase is Phase.ANSWER

    def feed(self, text: str) -> tuple[str, str]:
        """(thinking, answer) that `text` completes."""
        self.held += text
        thinking, answer = [], []
        while self.held:
            if self.phase is Phase.BEFORE:
                start = self.held.lstrip()
                if start.startswith(OPEN):
                    self.held = start[len(OPEN):]
                    self.phase, self.trim_thinking, self.opened = Phase.THINKING, True, True
                elif OPEN.startswith(start):
                    break  # whitespace, or a part of the opening tag: wait for more
                else:
                    self.phase = Phase.ANSWER
            elif self.phase is Phase.THINKING:
                if self.trim_thinking:
                    self.held = self.held.lstrip("\n")
                    if not self.held:
                        break
                    self.trim_thinking = False
                end = self.held.find(CLOSE)
                if end >= 0:
                    thinking.append(self.held[:end].rstrip("\n"))
                    self.held = self.held[end + len(CLOSE):]
                    self.phase, self.trim_answer = Phase.ANSWER, True
                    continue
                # Hold what could start the closing tag, and newlines that may precede it.
                keep = _partial_suffix(self.held, CLOSE)
                body = self.held[: len(self.held) - keep]
                out = body.rstrip("\n")
                thinking.append(out)
                self.held = self.held[len(out):]
                break
            else:
                if self.trim_answer:
                    self.held = self.held.lstrip("\n")
                    if not self.held:
                        break
                    self.trim_answer = False
                answer.append(self.held)
                self.held = ""
        return "".join(thinking), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """What is still held, at the end of the reply: unfinished thinking stays thinking; text
        that was waiting to see whether it opens a block is answer."""
        held, self.held = self.held, ""
        if self.phase is Phase.THINKING:
            return held.rstrip("\n"), ""
        if self.phase is Phase.BEFORE:
            self.phase = Phase.ANSWER
            return "", held
        return "", held


def split_reasoning(text: str, phase: Phase = Phase.BEFORE) -> tuple[str, str]:
    """(thinking, answer) of a whole reply: the same split as streaming it."""
    splitter = ReasoningSplitter(phase)
    a, b = splitter.feed(text)
    c, d = splitter.finish()
    return a + c, b + d


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
