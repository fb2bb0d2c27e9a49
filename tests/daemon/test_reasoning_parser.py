"""The thinking/answer split (edge_runtime/reasoning.py) at its edges: tags split across pieces,
a block the prompt opened, thinking off (a closed empty block in the prompt), a reply cut inside
the thinking, and streaming that always adds up to the whole split."""

from __future__ import annotations

import random

import pytest

from edge_runtime.reasoning import (
    Phase,
    ReasoningSplitter,
    opening_phase,
    prompt_without_thinking,
    split_reasoning,
    template_thinks,
)

QWEN3_REPLY = "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello there!"


def streamed(text: str, cuts: list[int], phase: Phase = Phase.BEFORE) -> tuple[str, str]:
    splitter = ReasoningSplitter(phase)
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
