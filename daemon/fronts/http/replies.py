"""The HTTP gateway's replies: OpenAI response objects and server-sent-event chunks built from the
daemon's generate results, the feed of streamed tokens, and JSON responses.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

from starlette.responses import Response

from daemon import VERSION

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class TokenFeed:
    """Tokens of streamed generations, handed from the engine's deliveries to the response
    (a list and an event: no task or queue getter per token)."""

    def __init__(self) -> None:
        self.items: list[tuple[int, str, dict[str, Any] | None]] = []
        self.ready = asyncio.Event()

    def sink(self, offset: int) -> Callable[..., None]:
        """The token callback of the generation whose choices start at `offset`."""
        def put(index: int, text: str, token_id: int | None = None, extra: dict[str, Any] | None = None) -> None:
            self.items.append((offset + index, text, extra))
            self.ready.set()

        return put

    def take(self) -> list[tuple[int, str, dict[str, Any] | None]]:
        items, self.items = self.items, []
        self.ready.clear()
        return items


class Reply:
    """Builds OpenAI response objects from the daemon's generate results (one per prompt; the
    choices of prompt p are numbered p * n + candidate)."""

    def __init__(self, kind: str, model: str, n: int, tools: bool = False) -> None:
        self.kind = kind  # "chat" or "text"
        self.model = model
        self.n = n
        self.tools = tools
        self.created = int(time.time())
        self.id = ""  # the interaction id: known once the generation finished
        self.echo: list[Any] | None = None  # streamed completions: prompts to send first
        self._started: set[int] = set()
        self._calls: dict[int, int] = {}  # choice -> tool calls streamed so far
        self._offsets: dict[int, int] = {}  # choice -> characters streamed (legacy text_offset)

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": f"mace-edge-{VERSION}", "choices": choices, **extra}

    def opening(self) -> Iterator[dict[str, Any]]:
        """Completions with echo: the prompts' text first."""
        for p, prompt in enumerate(self.echo or ()):
            for c in range(self.n):
                yield self._chunk([{"index": p * self.n + c, "text": prompt, "finish_reason": None, "logprobs": None}])

    def delta(self, index: int, text: str, extra: dict[str, Any] | None) -> dict[str, Any]:
        logprobs = (extra or {}).get("logprobs")
        if self.kind == "text":
            choice = {"index": index, "text": text, "finish_reason": None,
                      "logprobs": self._legacy_logprobs(index, logprobs) if logprobs else None}
            return self._chunk([choice])
        thought = (extra or {}).get("reasoning")
        delta: dict[str, Any] = ({"content": text} if text or not ((extra or {}).get("tool_calls") or thought)
                                 else {})
        if thought:  # vLLM's and llama.cpp's name for the thinking, beside `content`
            delta["reasoning_content"] = thought
        if index not in self._started:
            self._started.add(index)
            delta = {"role": "assistant", **delta}
        calls = (extra or {}).get("tool_calls")
        if calls:
            first = self._calls.get(index, 0)
            self._calls[index] = first + len(calls)
            delta["tool_calls"] = [{"index": first + k, **call} for k, call in enumerate(calls)]
        choice = {"index": index, "delta": delta, "finish_reason": None,
                  "logprobs": {"content": [_chat_logprob(x) for x in logprobs]} if logprobs else None}
        return self._chunk([choice])

    def _choices(self, results: list[dict[str, Any]]) -> Iterator[tuple[int, dict[str, Any], dict[str, Any]]]:
        for p, result in enumerate(results):
            for c in result["candidates"]:
                yield p * self.n + c["index"], c, result

    def finals(self, results: list[dict[str, Any]], include_usage: bool) -> Iterator[dict[str, Any]]:
        self.id = results[0]["interaction_id"]
        for index, c, result in self._choices(results):
            if self.kind == "text":
                choice = {"index": index, "text": "", "finish_reason": _finish(c), "logprobs": None}
            else:
                delta = {} if index in self._started else {"role": "assistant", "content": ""}
                choice = {"index": index, "delta": delta, "finish_reason": _finish(c), "logprobs": None}
            yield self._chunk([choice], mace=_extension(result))
        if include_usage:
            yield self._chunk([], usage=_usage(results))

    def whole(self, results: list[dict[str, Any]]) -> dict[str, Any]:
        self.id = results[0]["interaction_id"]
        choices = []
        for index, c, result in self._choices(results):
            logprobs = c.get("logprobs")
            if self.kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": c["text"]}
                if c.get("tool_calls"):
                    message = {"role": "assistant", "content": c["text"] or None, "tool_calls": c["tool_calls"]}
                if c.get("reasoning") is not None:
                    message["reasoning_content"] = c["reasoning"]
                choices.append({"index": index, "message": message, "finish_reason": _finish(c),
                                "logprobs": {"content": [_chat_logprob(x) for x in logprobs]} if logprobs is not None
                                else None})
            else:
                text = result.get("prompt_text", "") + c["text"]
                self._offsets[index] = len(result.get("prompt_text", ""))
                choices.append({"index": index, "text": text, "finish_reason": _finish(c),
                                "logprobs": self._legacy_logprobs(index, logprobs) if logprobs is not None else None})
        ext = _extension(results[0])
        if len(results) > 1:
            ext["interaction_ids"] = [r["interaction_id"] for r in results]
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "system_fingerprint": f"mace-edge-{VERSION}", "choices": choices,
                "usage": _usage(results), "mace": ext}

    def _legacy_logprobs(self, index: int, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        """/v1/completions' older shape: parallel lists, top alternatives as {token: logprob}."""
        tokens, offsets = [], []
        offset = self._offsets.get(index, 0)
        for x in logprobs:
            token = _token_text(x["bytes"])
            tokens.append(token)
            offsets.append(offset)
            offset += len(token)
        self._offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": [x["logprob"] for x in logprobs],
                "top_logprobs": [{_token_text(b): v for _, v, b in x["top"]} for x in logprobs],
                "text_offset": offsets}


def _token_text(raw: bytes) -> str:
    return bytes(raw).decode("utf-8", errors="replace")


def _chat_logprob(x: dict[str, Any]) -> dict[str, Any]:
    """One token's entry of chat's `logprobs.content`: text, log-probability, UTF-8 bytes."""
    return {"token": _token_text(x["bytes"]), "logprob": x["logprob"], "bytes": list(bytes(x["bytes"])),
            "top_logprobs": [{"token": _token_text(b), "logprob": v, "bytes": list(bytes(b))} for _, v, b in x["top"]]}


def _finish(candidate: dict[str, Any]) -> str:
    reason = candidate.get("finish_reason")
    return reason if reason in ("length", "tool_calls") else "stop"


def _usage(results: list[dict[str, Any]]) -> dict[str, Any]:
    prompt = sum(r["usage"]["prompt_tokens"] for r in results)
    completion = sum(r["usage"]["completion_tokens"] for r in results)
    cached = sum(r["usage"].get("cached_prompt_tokens", 0) for r in results)
    written = sum(r["usage"].get("cache_write_tokens", 0) for r in results)
    reasoning = sum(r["usage"].get("reasoning_tokens", 0) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
            "completion_tokens_details": {"reasoning_tokens": reasoning}}


def _extension(result: dict[str, Any]) -> dict[str, Any]:
    """What the daemon adds: the adapter that served, whether feedback can refer to this id."""
    ext = {"interaction_id": result["interaction_id"], "adapter": result["adapter"],
           "recorded": result["recorded"], "timing": result.get("timing", {})}
    if result.get("record_note"):
        ext["record_note"] = result["record_note"]
    return ext


def adapter_header(result: dict[str, Any]) -> dict[str, str]:
    return {"X-Mace-Adapter": result["adapter"] or "base"}


def json_response(content: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    body = json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode()
    return Response(body, status, headers, media_type="application/json")


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

