"""Thinking models: which chat templates have a thinking switch and how their models mark the
thinking (`<think>` ... `</think>`, Granite's answer in `<response>` ... `</response>`), where a
reply starts (the prompt may open or close the block), and the split of generated text into the
thinking and the answer, token by token. Knows nothing of sampling, grammars or the wire.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<response>", "</response>"  # Granite 3.3 wraps its answer in these


@dataclass(frozen=True)
class ThinkingStyle:
    """How a family's chat template switches thinking and how its replies mark it."""

    switch: str  # the template variable that turns thinking on or off
    default_on: bool  # whether the template thinks when the switch is not passed
    answer_tags: tuple[str, str] | None = None  # a wrapper around the answer after the block

    @property
    def off_in_prompt(self) -> bool:
        """Whether thinking off shows in the prompt itself (an empty, closed block after the
        assistant's header), so that where a reply starts can be read off the rendered prompt."""
        return self.answer_tags is None


# Qwen3 and SmolLM3 read `enable_thinking` (both think when it is undefined) and write an empty,
# closed block when it is false. Granite 3.2/3.3 read `thinking` (off when undefined): it only
# changes the default system message, and the model then answers `<think>…</think>` followed by
# `<response>…</response>`.
ENABLE_THINKING = ThinkingStyle("enable_thinking", default_on=True)
GRANITE = ThinkingStyle("thinking", default_on=False, answer_tags=(ANSWER_OPEN, ANSWER_CLOSE))
_GRANITE_SWITCH = re.compile(r"\{%-?\s*(?:el)?if\s+thinking\s*-?%\}")


class Phase(enum.Enum):
    BEFORE = "before"  # the model may open a think block, or answer straight away
    THINKING = "thinking"  # inside the block: text is thinking until the closing tag
    ANSWER = "answer"  # after the block (or it never opened): text is the answer


def template_style(template: str | None) -> ThinkingStyle | None:
    """The thinking style of a chat template (None: it has no thinking switch)."""
    if not template or CLOSE not in template:
        return None
    if ENABLE_THINKING.switch in template:
        return ENABLE_THINKING
    if ANSWER_CLOSE in template and _GRANITE_SWITCH.search(template):
        return GRANITE
    return None


def template_thinks(template: str | None) -> bool:
    """Whether a chat template has a thinking switch and its model writes the `<think>` block."""
    return template_style(template) is not None


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
    With `answer_tags` (Granite's `<response>`, `</response>`), an answer that opens with the
    first tag is given out without the pair. A reply cut inside the block (max_tokens) is all
    thinking and has an empty answer.

    Fed one token's text at a time, it also counts the thinking's tokens (`thinking_tokens`, the
    usage's `reasoning_tokens`): each token that falls in the block, its opening and closing tags
    included, and whitespace tokens held before an opening tag."""

    def __init__(self, phase: Phase = Phase.BEFORE, answer_tags: tuple[str, str] | None = None) -> None:
        self.phase = phase
        self.answer_tags = answer_tags
        self.held = ""  # text not yet given out: a partial tag, or newlines that may frame one
        self.trim_answer = False  # drop the newlines right after the closing tag
        self.trim_thinking = phase is Phase.THINKING  # drop the newlines right after the opening tag
        # Whether a tag came before the answer (a think block, or the answer's wrapper): the
        # answer's first token is then the first after it.
        self.opened = phase is Phase.THINKING
        self.wrap = ""  # the answer's wrapper: "maybe" (it may open now), "inside" it, or "" (none)
        self.thinking_tokens = 0  # tokens fed that belong to the think block
        self._undecided = 0  # tokens fed while it was not yet known whether a block opens
        self._blocks = 0  # think blocks opened by what was fed (a prompt's own opening not counted)

    @property
    def answering(self) -> bool:
        """True once the reply is past the think block (or answered without one)."""
        return self.phase is Phase.ANSWER

    def feed(self, text: str) -> tuple[str, str]:
        """(thinking, answer) that `text` (one token's text, when counting) completes."""
        before, blocks = self.phase, self._blocks
        out = self._split(text)
        if Phase.THINKING in (before, self.phase) or self._blocks != blocks:
            self.thinking_tokens += 1 + self._undecided
            self._undecided = 0
        elif self.phase is Phase.BEFORE:
            self._undecided += 1
        else:
            self._undecided = 0
        return out

    def _split(self, text: str) -> tuple[str, str]:
        self.held += text
        thinking, answer = [], []
        while self.held:
            if self.phase is Phase.BEFORE:
                start = self.held.lstrip()
                wrapper = self.answer_tags[0] if self.answer_tags else None
                if start.startswith(OPEN):
                    self.held = start[len(OPEN):]
                    self.phase, self.trim_thinking, self.opened = Phase.THINKING, True, True
                    self._blocks += 1
                elif wrapper and start.startswith(wrapper):  # an answer with no thinking before it
                    self.held = start[len(wrapper):]
                    self.phase, self.wrap, self.trim_answer, self.opened = Phase.ANSWER, "inside", True, True
                elif OPEN.startswith(start) or (wrapper and wrapper.startswith(start)):
                    break  # whitespace, or a part of an opening tag: wait for more
                else:
                    self.phase = Phase.ANSWER
            elif self.phase is Phase.THINKING:
                if self.trim_thinking:
                    self.held = self.held.lstrip("\n")
                    if not self.held:
                        break
                    self.trim_thinking = False
                out, closed = self._until(CLOSE)
                thinking.append(out)
                if not closed:
                    break
                self.phase, self.trim_answer = Phase.ANSWER, True
                self.wrap = "maybe" if self.answer_tags else ""
            else:
                if self.trim_answer:
                    self.held = self.held.lstrip("\n")
                    if not self.held:
                        break
                    self.trim_answer = False
                if self.wrap == "maybe":
                    start, wrapper = self.held.lstrip(), self.answer_tags[0]  # type: ignore[index]
                    if start.startswith(wrapper):
                        self.held, self.wrap, self.trim_answer = start[len(wrapper):], "inside", True
                        continue
                    if wrapper.startswith(start):
                        break  # whitespace, or a part of the wrapper's tag: wait for more
                    self.wrap = ""
                if self.wrap == "inside":
                    out, closed = self._until(self.answer_tags[1])  # type: ignore[index]
                    answer.append(out)
                    if not closed:
                        break
                    self.wrap, self.trim_answer = "", True
                    continue
                answer.append(self.held)
                self.held = ""
        return "".join(thinking), "".join(answer)

    def _until(self, tag: str) -> tuple[str, bool]:
        """The held text up to `tag` and whether `tag` was there (then it is dropped). Without
        it, what could start the tag, and newlines that may precede it, stay held."""
        end = self.held.find(tag)
        if end >= 0:
            out = self.held[:end].rstrip("\n")
            self.held = self.held[end + len(tag):]
            return out, True
        keep = _partial_suffix(self.held, tag)
        out = self.held[: len(self.held) - keep].rstrip("\n")
        self.held = self.held[len(out):]
        return out, False

    def finish(self) -> tuple[str, str]:
        """What is still held, at the end of the reply: unfinished thinking stays thinking; text
        that was waiting to see whether it opens a block or the answer's wrapper is answer."""
        held, self.held = self.held, ""
        if self.phase is Phase.THINKING:
            return held.rstrip("\n"), ""
        if self.wrap == "inside":
            held = held.rstrip("\n")
        self.phase, self.wrap = Phase.ANSWER, ""
        return "", held


def split_reasoning(text: str, phase: Phase = Phase.BEFORE,
                    answer_tags: tuple[str, str] | None = None) -> tuple[str, str]:
    """(thinking, answer) of a whole reply: the same split as streaming it."""
    splitter = ReasoningSplitter(phase, answer_tags)
    a, b = splitter.feed(text)
    c, d = splitter.finish()
    return a + c, b + d


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
