"""The thinking/answer split (edge_runtime/reasoning.py) at its edges: tags split across pieces,
a block the prompt opened, thinking off (a closed empty block in the prompt), a reply cut inside
the thinking, Granite's `<response>` wrapper, and streaming that always adds up to the whole
split."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from edge_runtime.reasoning import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    ENABLE_THINKING,
    GRANITE,
    Phase,
    ReasoningSplitter,
    opening_phase,
    prompt_without_thinking,
    split_reasoning,
    template_style,
    template_thinks,
)

QWEN3_REPLY = "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello there!"


def streamed(text: str, cuts: list[int], phase: Phase = Phase.BEFORE,
             tags: tuple[str, str] | None = None) -> tuple[str, str]:
    splitter = ReasoningSplitter(phase, tags)
    thinking, answer = [], []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        t, s = splitter.feed(text[a:b])
        thinking.append(t)
        answer.append(s)
    t, s = splitter.finish()
    return "".join(thinking) + t, "".join(answer) + s


def test_a_qwen3_reply_splits_into_thinking_and_answer_without_the_framing_newlines() -> None:
    assert split_reasoning(QWEN3_REPLY) == ("The user greets me.\nI greet back.", "Hello there!")


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
def test_tags_split_across_pieces_of_any_size_give_the_same_split(size: int) -> None:
    cuts = list(range(size, len(QWEN3_REPLY), size))
    assert streamed(QWEN3_REPLY, cuts) == split_reasoning(QWEN3_REPLY)


def test_random_piecings_always_add_up_to_the_whole_split() -> None:
    rng = random.Random(7)
    texts = [QWEN3_REPLY, "<think>a</thi</think>b", "  <think>x\n\n\ny</think>z\n", "no block <think>here</think>",
             "<thi", "<think>\n\ncut inside", "\n\n</think>"]
    for text in texts:
        for phase in (Phase.BEFORE, Phase.THINKING):
            whole = split_reasoning(text, phase)
            for _ in range(40):
                cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(6, len(text) - 1))))
                assert streamed(text, cuts, phase) == whole, (text, cuts)


def test_nothing_of_a_tag_leaks_while_it_is_incomplete() -> None:
    splitter = ReasoningSplitter()
    assert splitter.feed("<thi") == ("", "")
    assert splitter.feed("nk>\nstep one") == ("step one", "")
    assert splitter.feed("\n</th") == ("", "")  # the newline may frame the closing tag
    assert splitter.feed("ink>") == ("", "")
    assert splitter.answering
    assert splitter.feed("\n\nAnswer") == ("", "Answer")
    assert splitter.finish() == ("", "")


def test_a_missing_opening_tag_when_the_prompt_opened_the_block() -> None:
    # Qwen3-Thinking-2507 and DeepSeek-R1 templates end the prompt with "<think>\n".
    assert opening_phase("<|im_start|>assistant\n<think>\n") is Phase.THINKING
    assert split_reasoning("I think.\n</think>\n\nDone.", Phase.THINKING) == ("I think.", "Done.")


def test_thinking_off_leaves_no_split_to_make() -> None:
    # Qwen3 (enable_thinking=False) closes an empty block after the assistant's header.
    assert opening_phase("<|im_start|>assistant\n<think>\n\n</think>\n\n") is None
    assert opening_phase("<|im_start|>assistant\n<think>\n\n</think>\n") is None  # SmolLM3
    assert opening_phase("<|im_start|>assistant\n") is Phase.BEFORE


def test_a_reply_cut_inside_the_thinking_is_all_thinking() -> None:
    assert split_reasoning("<think>\nstill going and goi") == ("still going and goi", "")
    assert split_reasoning("<think>\nhalf a tag </thi") == ("half a tag </thi", "")


def test_a_reply_without_a_block_is_all_answer() -> None:
    assert split_reasoning("Just an answer.") == ("", "Just an answer.")
    assert split_reasoning("\n\n") == ("", "\n\n")
    assert split_reasoning("<b>bold</b>") == ("", "<b>bold</b>")


def test_only_the_first_block_is_thinking() -> None:
    assert split_reasoning("<think>a</think>b <think>c</think>") == ("a", "b <think>c</think>")


def test_the_prompt_a_pair_trains_on_drops_the_thinking() -> None:
    assert prompt_without_thinking("P", Phase.BEFORE) == "P<think>\n\n</think>\n\n"
    assert prompt_without_thinking("P<think>\n", Phase.THINKING) == "P<think>\n\n</think>\n\n"


def test_templates_with_the_switch() -> None:
    assert template_thinks("{% if enable_thinking is false %}<think>\n\n</think>{% endif %}")
    assert not template_thinks("{{ messages }}")
    assert not template_thinks(None)


# Granite 3.3 (thinking=True): the thinking in <think>, then the answer in <response>.
GRANITE_TAGS = (ANSWER_OPEN, ANSWER_CLOSE)
GRANITE_REPLY = "<think>I'm\nthinking</think><response>Hello, world!\nWhat's up?</response>"


def test_a_granite_reply_gives_the_answer_without_its_response_wrapper() -> None:
    assert split_reasoning(GRANITE_REPLY, answer_tags=GRANITE_TAGS) == ("I'm\nthinking", "Hello, world!\nWhat's up?")
    framed = "<think>\nI'm thinking\n</think>\n\n<response>\nHello\n</response>\n"
    assert split_reasoning(framed, answer_tags=GRANITE_TAGS) == ("I'm thinking", "Hello")
    # No thinking before it, or no wrapper after it: the answer is still the answer.
    assert split_reasoning("<response>Hi</response>", answer_tags=GRANITE_TAGS) == ("", "Hi")
    assert split_reasoning("<think>a</think>Hi", answer_tags=GRANITE_TAGS) == ("a", "Hi")
    assert split_reasoning("Hi <response>x</response>", answer_tags=GRANITE_TAGS) == ("", "Hi <response>x</response>")
    # Without answer tags (Qwen3), the wrapper is answer text like any other.
    assert split_reasoning(GRANITE_REPLY)[1] == "<response>Hello, world!\nWhat's up?</response>"


def test_a_granite_reply_cut_inside_its_answer_keeps_what_was_written() -> None:
    assert split_reasoning("<think>a</think><response>half an ans", answer_tags=GRANITE_TAGS) == ("a", "half an ans")
    assert split_reasoning("<think>a</think><resp", answer_tags=GRANITE_TAGS) == ("a", "<resp")


def test_granite_tags_split_across_any_pieces_give_the_whole_split() -> None:
    rng = random.Random(11)
    texts = [GRANITE_REPLY, "<think>\nx\n</think>\n\n<response>\ny\n</response>\n", "<response>only</response>",
             "<think>a</think> <resp</response>", "<think>a</think><response>b</resp", "<thi", "\n<respon",
             "<think>a</think><response>b</response>c"]
    for text in texts:
        whole = split_reasoning(text, answer_tags=GRANITE_TAGS)
        for size in (1, 2, 3):
            assert streamed(text, list(range(size, len(text), size)), tags=GRANITE_TAGS) == whole, (text, size)
        for _ in range(40):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(6, len(text) - 1))))
            assert streamed(text, cuts, tags=GRANITE_TAGS) == whole, (text, cuts)


def test_nothing_of_the_response_tags_leaks_while_they_are_incomplete() -> None:
    splitter = ReasoningSplitter(answer_tags=GRANITE_TAGS)
    assert splitter.feed("<think>plan</think>") == ("plan", "")
    assert splitter.answering and splitter.feed("<resp") == ("", "")
    assert splitter.feed("onse>Hel") == ("", "Hel")
    assert splitter.feed("lo</resp") == ("", "lo")
    assert splitter.feed("onse>") == ("", "")
    assert splitter.finish() == ("", "")


def test_the_granite_template_is_known_by_its_switch() -> None:
    granite = (Path(__file__).parents[1] / "families" / "templates" / "granite3.jinja").read_text()
    assert template_style(granite) is GRANITE and GRANITE.switch == "thinking" and not GRANITE.default_on
    assert template_style("{% if enable_thinking is false %}<think>\n\n</think>{% endif %}") is ENABLE_THINKING
    # A template that only mentions the tags, with no switch, does not think.
    assert template_style("{%- if tools %}<think></think><response></response>{%- endif %}") is None


def _count(tokens: list[str], phase: Phase = Phase.BEFORE, answer_tags: tuple[str, str] | None = None) -> int:
    splitter = ReasoningSplitter(phase, answer_tags)
    for token in tokens:
        splitter.feed(token)
    splitter.finish()
    return splitter.thinking_tokens


@pytest.mark.parametrize(("tokens", "phase", "expected"), [
    (["<think>", "\n", "a", "b", "\n", "</think>", "\n\n", "ok"], Phase.BEFORE, 6),  # tags and framing in
    (["\n", "<th", "ink>", "x", "</th", "ink>", "y"], Phase.BEFORE, 6),  # tags split; whitespace before
    (["hi", "<think>", "x", "</think>"], Phase.BEFORE, 0),  # no block before the answer: all answer
    (["x", "y", "</think>", "z"], Phase.THINKING, 3),  # the prompt opened the block
    (["<think>", "x", "y"], Phase.BEFORE, 3),  # cut inside the block: all thinking
    (["\n", "a"], Phase.BEFORE, 0),
    (["<think>x</think>answer"], Phase.BEFORE, 1),  # one token holding the whole block counts once
])
def test_the_thinking_tokens_are_counted_as_they_are_fed(tokens: list[str], phase: Phase, expected: int) -> None:
    assert _count(tokens, phase) == expected


def test_granite_counts_the_block_not_the_answer_wrapper() -> None:
    tags = ("<response>", "</response>")
    assert _count(["<think>", "x", "</think>", "<resp", "onse>", "a", "</response>"], answer_tags=tags) == 3
    assert _count(["<response>", "a", "</response>"], answer_tags=tags) == 0
