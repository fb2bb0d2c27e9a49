"""One generate in flight, as the fronts and the engine thread see it: the token callback, the
split of streamed text into content and tool calls, its timings for the metrics, and the shape
of its candidates and result on the wire.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from daemon.metrics import DaemonMetrics
from daemon.principals import DEFAULT_APP, Principal
from daemon.wire import GenerateArgs, ProtocolError
from edge_runtime.chat import ChatPrompt, parse_calls
from edge_runtime.constraints import Constraint
from edge_runtime.outputs import RequestOutput, TokenEvent
from edge_runtime.sampling import SamplingParams


def logprob_record(lp: Any) -> dict[str, Any]:
    """A generated token's log-probability on the wire: the token, its log-probability, its
    bytes, and the alternatives as [token id, log-probability, bytes]."""
    return {"token_id": lp.token_id, "logprob": lp.logprob, "bytes": lp.bytes,
            "top": [[t, v, b] for t, v, b in lp.top]}
# (candidate index, new text, last token id, extra: `logprobs` of the piece's tokens,
# `tool_calls` completed in it and `reasoning` (new thinking), or None)
TokenCallback = Callable[[int, str, "int | None", "dict[str, Any] | None"], None]
IN_PROCESS = Principal("app", DEFAULT_APP, "in-process")  # the front named no one: the default app
# Reasons a generate can end early, as (error code, message for the client).
ABORTS = {
    "cancelled": ("cancelled", "the request was cancelled by its client"),
    "timeout": ("timeout", "the request ran past its timeout_s"),
    "shutting_down": ("shutting_down", "the daemon is shutting down; the request was stopped"),
    "client_gone": ("cancelled", "the client disconnected"),
}


class GenerateCall:
    """One generate in flight: the front (ZeroMQ server or HTTP gateway) holds it to cancel it;
    the engine thread completes it. `api` names the front in the daemon's metrics."""

    def __init__(self, on_token: TokenCallback | None = None, api: str = "zmq", client: Any = None,
                 principal: Principal = IN_PROCESS) -> None:
        self.on_token = on_token
        self.api = api
        self.client = client  # who sent it (a connection or an API key): admission's fairness unit
        self.principal = principal  # whose users `user` names (docs/security.md)
        self.done: asyncio.Future[tuple[RequestOutput | None, str | None, BaseException | None]] = (
            asyncio.get_running_loop().create_future())
        self.engine_id: str | None = None
        self.cancel_reason: str | None = None
        self.arrived = time.monotonic()
        self.first_token_at: float | None = None
        self.metrics: DaemonMetrics | None = None  # set by Service.generate
        self._last_at: dict[int, float] = {}
        # Streamed with tools offered: per candidate, the text is split into content and calls
        # as it arrives (edge_runtime.chat.CallStreamer); what went out is kept for the result.
        self.streamers: dict[int, Any] = {}
        self.streamed_content: dict[int, list[str]] = {}
        self.streamed_calls: dict[int, list[Any]] = {}

    @property
    def cache_scope(self) -> str:
        """The prefix cache this call may share: its app's own (the default app's is everyone's
        from before apps existed), so a faster first token never tells one app another's prompt."""
        return "" if self.principal.app == DEFAULT_APP else self.principal.app

    def on_tokens(self, events: list[TokenEvent]) -> None:
        """One message per candidate per delivery: when the loop falls behind the engine, the
        tokens of several iterations travel together instead of as a backlog of messages."""
        if self.metrics is not None:
            self._observe(events)
        if self.on_token is None:
            return
        texts: dict[int, list[str]] = {}
        last_ids: dict[int, int | None] = {}
        logprobs: dict[int, list[dict[str, Any]]] = {}
        thoughts: dict[int, list[str]] = {}
        for event in events:
            if event.logprob is not None:
                logprobs.setdefault(event.index, []).append(logprob_record(event.logprob))
            if event.reasoning:
                thoughts.setdefault(event.index, []).append(event.reasoning)
                last_ids[event.index] = event.token_id
            if event.text:  # "" while a multi-byte character is incomplete: nothing to show yet
                texts.setdefault(event.index, []).append(event.text)
                last_ids[event.index] = event.token_id
        for index in sorted(set(texts) | set(logprobs) | set(thoughts)):
            extra: dict[str, Any] = {"logprobs": logprobs[index]} if index in logprobs else {}
            if index in thoughts:  # a thinking model's think block, apart from the answer
                extra["reasoning"] = "".join(thoughts[index])
            self._send(index, "".join(texts.get(index, ())), last_ids.get(index), extra)

    def _send(self, index: int, text: str, token_id: int | None, extra: dict[str, Any]) -> None:
        assert self.on_token is not None
        streamer = self.streamers.get(index)
        if streamer is not None:
            pieces = streamer.feed(text)
            text = "".join(v for kind, v in pieces if kind == "content")
            calls = [v for kind, v in pieces if kind == "call"]
            self.streamed_content.setdefault(index, []).append(text)
            if calls:
                self.streamed_calls.setdefault(index, []).extend(calls)
                extra["tool_calls"] = [c.as_openai() for c in calls]
        if text or extra:
            self.on_token(index, text, token_id, extra or None)

    def flush_streams(self) -> None:
        """Deliver what the call streamers still hold (a final `<tool_call>` block, a held-back
        tag prefix that turned out to be text) before the final reply."""
        for index, streamer in self.streamers.items():
            pieces = streamer.finish()
            text = "".join(v for kind, v in pieces if kind == "content")
            calls = [v for kind, v in pieces if kind == "call"]
            self.streamed_content.setdefault(index, []).append(text)
            self.streamed_calls.setdefault(index, []).extend(calls)
            if (text or calls) and self.on_token is not None:
                self.on_token(index, text, None, {"tool_calls": [c.as_openai() for c in calls]} if calls else None)

    def on_finished(self, output: RequestOutput | None, aborted: str | None,
                    error: BaseException | None) -> None:
        if not self.done.done():
            self.done.set_result((output, aborted, error))

    def _observe(self, events: list[TokenEvent]) -> None:
        """TTFT, inter-token gaps and the tokens/s window, as the event loop receives tokens."""
        assert self.metrics is not None
        counts: dict[int, int] = {}
        for event in events:
            if event.token_id is not None:
                counts[event.index] = counts.get(event.index, 0) + 1
        if not counts:
            return
        now = time.monotonic()
        metrics, api = self.metrics, self.api
        if self.first_token_at is None:
            self.first_token_at = now
            metrics.ttft.labels(api).observe(now - self.arrived)
        itl = metrics.itl.labels(api)
        for index, k in counts.items():
            last = self._last_at.get(index)
            self._last_at[index] = now
            if last is not None:  # a candidate's first delivery has no gap before it
                gap = (now - last) / k
                for _ in range(k):
                    itl.observe(gap)
        metrics.tokens_arrived(now, sum(counts.values()))


def candidate_record(c: Any, tools: tuple[dict[str, Any], ...], call: GenerateCall, tool_style: str) -> dict[str, Any]:
    """One answer of a generate result: its text, and with tools offered the content and the
    calls apart (exactly as they streamed, when they did)."""
    candidate: dict[str, Any] = {"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                                 "completion_tokens": len(c.token_ids)}
    if c.logprobs is not None:
        candidate["logprobs"] = [logprob_record(lp) for lp in c.logprobs]
    if c.reasoning is not None:  # the thinking, apart from `text` (the answer)
        candidate["reasoning"] = c.reasoning
        candidate["reasoning_tokens"] = c.reasoning_tokens
    if tools:
        if c.index in call.streamers:
            content = "".join(call.streamed_content.get(c.index, ()))
            calls = call.streamed_calls.get(c.index, [])
        else:
            content, calls = parse_calls(c.text, tools, tool_style)
        if calls:
            candidate["text"] = content
            candidate["tool_calls"] = [x.as_openai() for x in calls]
            if c.finish_reason == "stop":
                candidate["finish_reason"] = "tool_calls"
    return candidate


def generate_result(interaction_id: str, model: str, adapter: str | None, output: RequestOutput,
                    candidates: list[dict[str, Any]]) -> dict[str, Any]:
    """A finished generate's reply: its candidates, usage and timings (not yet recorded)."""
    metrics = output.metrics
    timing: dict[str, float] = {}
    if metrics is not None:
        if metrics.ttft_s is not None:
            timing["ttft_s"] = round(metrics.ttft_s, 6)
        if metrics.finish_time is not None:
            timing["total_s"] = round(metrics.finish_time - metrics.arrival_time, 6)
    result: dict[str, Any] = {
        "interaction_id": interaction_id,
        "model": model,
        "adapter": adapter,
        "candidates": candidates,
        "usage": {"prompt_tokens": len(output.prompt_token_ids),
                  "completion_tokens": sum(c["completion_tokens"] for c in candidates),
                  "cached_prompt_tokens": metrics.cached_prompt_tokens if metrics else 0,
                  "cache_write_tokens": metrics.cache_write_tokens if metrics else 0,
                  "reasoning_tokens": sum(c.get("reasoning_tokens", 0) for c in candidates)},
        "timing": timing,
        "recorded": False,
    }
    return result


def engine_request(args: GenerateArgs, max_prompt_chars: int, default_max_tokens: int) -> tuple[Any, SamplingParams]:
    """The engine's prompt (text, token ids, or a ChatPrompt) and SamplingParams for a generate."""
    limit = max_prompt_chars
    if isinstance(args.prompt, str):
        chars = len(args.prompt)
    elif args.is_chat:
        chars = sum(len(m["content"] or "") for m in args.prompt)  # type: ignore[index, union-attr]
    else:
        chars = 0  # token ids: the engine checks their count against its context
    if chars > limit:
        raise ProtocolError("bad_request", f"prompt has {chars} characters; the limit is {limit}", param="prompt")
    constraint = Constraint(*args.response_format) if args.response_format else None
    params = SamplingParams(**args.sampling_kwargs(default_max_tokens), constraint=constraint)
    prompt: Any = args.prompt
    if args.is_chat:
        prompt = ChatPrompt(tuple(args.prompt), args.tools, args.tool_choice,  # type: ignore[arg-type]
                            args.continue_final_message, args.thinking)
    return prompt, params
