"""A request's way in: its prompt checked against the engine's limits and encoded (a forced tool
call becomes its constraint), its adapters pinned, and its candidate sequences built with their
own generator and grammar state. Holds no engine state and queues nothing.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from edge_runtime.chat import (
    ChatMessages,
    ChatPrompt,
    encode_prompt,
    forced_call_constraint,
    render,
    tool_style,
)
from edge_runtime.errors import BadRequest
from edge_runtime.ids import validate_user_id
from edge_runtime.lora.registry import FLEET, AdapterRef, AdapterRegistry
from edge_runtime.model.tokenizer import IncrementalDecoder, Tokenizer
from edge_runtime.reasoning import (
    CLOSE,
    OPEN,
    Phase,
    ReasoningSplitter,
    opening_phase,
    prompt_without_thinking,
    template_style,
)
from edge_runtime.sampling import SamplingParams
from edge_runtime.sequence import Request, Sequence, Thinking

# Text, chat messages, a chat with tools or a prefill (ChatPrompt), or token ids.
Prompt = str | ChatMessages | ChatPrompt | list[int]


@dataclass(frozen=True)
class PromptLimits:
    max_prompt_chars: int  # checked before encoding, so a huge text costs no tokenizer time
    max_context: int  # tokens a sequence may hold (model limit and KV cache size)
    vocab_size: int


def encode_request(prompt: Prompt, params: SamplingParams, tokenizer: Tokenizer,
                   limits: PromptLimits) -> tuple[str, list[int], SamplingParams]:
    """The prompt's text and token ids, and the parameters it runs with (a chat whose tools
    force a call gets that call's constraint); `BadRequest` for what exceeds `limits`."""
    if isinstance(prompt, str) and len(prompt) > limits.max_prompt_chars:
        raise BadRequest(f"prompt has {len(prompt)} characters; the limit is {limits.max_prompt_chars}",
                         param="prompt")
    if isinstance(prompt, ChatPrompt):
        forced = forced_call_constraint(prompt, tool_style(tokenizer))
        if forced is not None:
            if params.constraint is not None:
                raise BadRequest("a forced tool call and a response format cannot both shape one answer",
                                 param="response_format")
            params = dataclasses.replace(params, constraint=forced)
    text, ids = encode_prompt(tokenizer, prompt)
    if len(ids) >= limits.max_context:
        raise BadRequest(
            f"prompt has {len(ids)} tokens; this engine holds at most {limits.max_context - 1} "
            "prompt tokens per sequence (model limit and KV cache size)", param="prompt"
        )
    vocab = limits.vocab_size
    if any(t >= vocab for t, _ in params.logit_bias):
        raise BadRequest(f"logit_bias names a token id outside this model's vocabulary of {vocab}",
                         param="logit_bias")
    return text, ids, params


def reply_thinking(prompt: Prompt, text: str, tokenizer: Tokenizer, params: SamplingParams) -> Thinking | None:
    """How the replies to a rendered chat prompt think (None: they do not, or thinking is off).
    JSON answers and forced tool calls are constrained after the think block; a `regex` or
    `grammar` constraint shapes the whole reply, thinking included (docs/thinking.md)."""
    style = template_style(tokenizer.chat_template) if isinstance(prompt, ChatPrompt) else None
    if style is None:
        return None
    if not style.off_in_prompt and not (style.default_on if prompt.thinking is None else prompt.thinking):
        return None  # Granite: thinking off does not show in every prompt, but the request says so
    if prompt.continue_final:  # a prefill: inside the block if it opened one and did not close it
        # Granite's thinking system message names the tags itself: read the prefill alone.
        tail = text if style.off_in_prompt else str(prompt.messages[-1].get("content") or "")
        phase = Phase.THINKING if tail.rfind(OPEN) > tail.rfind(CLOSE) else None
        if phase is None and not style.off_in_prompt and OPEN not in tail:
            phase = Phase.BEFORE  # Granite: a prefill before any block may still open one
    else:
        phase = opening_phase(text)
    if phase is None:
        return None
    constraint = params.constraint
    after = constraint is not None and (constraint.kind in ("json", "json_schema")
                                        or forced_call_constraint(prompt, tool_style(tokenizer)) is not None)
    if style.off_in_prompt:
        answer_prompt = prompt_without_thinking(text, phase)
    else:  # the prompt the template writes with thinking off (Granite's other system message)
        answer_prompt = render(tokenizer.hf, dataclasses.replace(prompt, thinking=False))
    return Thinking(phase, after, answer_prompt, style.answer_tags)


def pin_adapters(adapters: AdapterRegistry, adapter: str | AdapterRef | None,
                 fleet: bool) -> tuple[AdapterRef | None, AdapterRef | None]:
    """Pin the user's adapter version (a user id: their newest; an `AdapterRef`: that one;
    None: none) and, with `fleet`, the fleet adapter's newest version beneath it. Both are
    released by whoever ends the request; neither stays pinned if pinning the other fails."""
    pinned = None
    if isinstance(adapter, AdapterRef):
        # A user's adapter only: the fleet's reserved name is not a user id.
        validate_user_id(adapter.user)
        pinned = adapters.pin(adapter)
    elif adapter is not None:
        pinned = adapters.acquire(validate_user_id(adapter))
    try:
        return pinned, adapters.acquire(FLEET) if fleet else None
    except BaseException:
        adapters.release(pinned)
        raise


def add_candidates(request: Request, matcher: Any, seq_ids: Iterator[int],
                   new_decoder: Callable[[], IncrementalDecoder],
                   start_pruning: Callable[[Sequence], None] | None) -> None:
    """The request's `params.n` candidate sequences, appended to `request.seqs`: each samples
    with its own seeded generator (seed + index when a seed is given), its own copy of the
    grammar's state (held back until the think block closes when it shapes only the answer) and
    its own thinking splitter; `start_pruning` turns decode KV pruning on from the start."""
    params = request.params
    for index in range(params.n):
        generator = None
        if not params.greedy:
            seed = params.seed + index if params.seed is not None else secrets.randbits(63)
            generator = torch.Generator().manual_seed(seed)
        seq = Sequence(next(seq_ids), request, index, list(request.prompt_ids), new_decoder(), generator)
        if start_pruning is not None:
            start_pruning(seq)
        thinking = request.thinking
        if thinking is not None:
            seq.reasoning = ReasoningSplitter(thinking.phase, thinking.answer_tags)
        if matcher is not None:
            own = matcher if index == 0 else matcher.deep_copy()
            if thinking is not None and thinking.grammar_after:
                seq.pending_matcher = own
            else:
                seq.matcher = own
        request.seqs.append(seq)


def encode_embedding_inputs(inputs: Seq[str | list[int]], tokenizer: Tokenizer, max_context: int) -> list[list[int]]:
    """Token ids of each text or token-id list to embed; `BadRequest` for an empty input, too
    many inputs, or one longer than the engine's context."""
    from edge_runtime.embeddings import MAX_INPUTS

    if not 1 <= len(inputs) <= MAX_INPUTS:
        raise BadRequest(f"give 1-{MAX_INPUTS} inputs to embed")
    encoded = []
    for i, item in enumerate(inputs):
        if isinstance(item, str) and not item:
            raise BadRequest(f"input {i} is empty")
        _, ids = encode_prompt(tokenizer, item)
        if len(ids) > max_context:
            raise BadRequest(f"input {i} has {len(ids)} tokens; this engine embeds at most {max_context}")
        encoded.append(ids)
    return encoded
