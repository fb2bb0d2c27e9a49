"""`/v1/responses` replies: the `response` object built from the daemon's generate result, and
the typed server-sent events of a streamed one (`response.created` ... `response.completed`),
with the output items (`reasoning`, `message`, `function_call`) both carry.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

from daemon.fronts.http.errors import GatewayError


def usage(result: dict[str, Any]) -> dict[str, Any]:
    used = result["usage"]
    prompt, completion = used["prompt_tokens"], used["completion_tokens"]
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": used.get("cached_prompt_tokens", 0),
                                     "cache_write_tokens": used.get("cache_write_tokens", 0)},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": used.get("reasoning_tokens", 0)},
            "total_tokens": prompt + completion}


def extension(result: dict[str, Any]) -> dict[str, Any]:
    """What the daemon adds, as on chat: the adapter that served, whether feedback can refer
    to this id (the response id is the interaction id)."""
    ext = {"interaction_id": result["interaction_id"], "adapter": result["adapter"],
           "recorded": result["recorded"], "timing": result.get("timing", {})}
    if result.get("record_note"):
        ext["record_note"] = result["record_note"]
    return ext


def assistant_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The output items as one chat turn, for the next response's history."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if calls:
        return {"role": "assistant", "content": text or None, "tool_calls": calls}
    return {"role": "assistant", "content": text}


class ResponseReply:
    """Builds the `response` object and its stream's events for one request; `echo` holds the
    request fields a response repeats (instructions, tools, text format, sampling)."""

    def __init__(self, model: str, echo: dict[str, Any]) -> None:
        self.model = model
        self.echo = echo
        self.created_at = int(time.time())
        self.id = ""  # the interaction id, known once the engine took the request
        self.output: list[dict[str, Any]] = []
        self._sequence = 0
        self._open: int | None = None  # output index of the message item text streams into
        self._thinking: int | None = None  # output index of the reasoning item thinking streams into
        self._calls = 0

    # -- the response object --------------------------------------------------------------------

    def response(self, status: str, result: dict[str, Any] | None = None, output: list[dict[str, Any]] | None = None,
                 error: GatewayError | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": self.output if output is None else output,
            "error": response_error(error) if error else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            **self.echo, "usage": usage(result) if result else None}
        if result is not None:
            body["completed_at"] = int(time.time())
            body["mace"] = extension(result)
        return body

    def whole(self, result: dict[str, Any]) -> dict[str, Any]:
        self.id = result["interaction_id"]
        candidate = result["candidates"][0]
        status = _status(candidate)
        calls = candidate.get("tool_calls") or []
        if candidate.get("reasoning"):  # a thinking model's think block, before its answer
            cut = status if not candidate["text"] and not calls else "completed"
            self.output.append(self._reasoning(candidate["reasoning"], cut))
        if candidate["text"] or not calls:
            self.output.append(self._message(candidate["text"], status))
        self.output.extend(self._function_call(call) for call in calls)
        return self.response(status, result)

    def _message(self, text: str, status: str) -> dict[str, Any]:
        return {"id": f"msg_{self.id}_{len(self.output)}", "type": "message", "role": "assistant",
                "status": status, "content": [_text_part(text)] if status != "in_progress" else []}

    def _reasoning(self, text: str, status: str) -> dict[str, Any]:
        # The model's own thinking is the item's content (reasoning_text); no summary is written.
        return {"id": f"rs_{self.id}_{len(self.output)}", "type": "reasoning", "summary": [], "status": status,
                "content": [_reasoning_part(text)] if status != "in_progress" else []}

    def _function_call(self, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
        self._calls += 1
        function = call["function"]
        return {"id": f"fc_{self.id}_{self._calls}", "type": "function_call", "status": status,
                "call_id": call["id"], "name": function["name"],
                "arguments": function["arguments"] if status == "completed" else ""}

    # -- streamed events ------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def opening(self) -> Iterator[dict[str, Any]]:
        yield self._event("response.created", response=self.response("in_progress", output=[]))
        yield self._event("response.in_progress", response=self.response("in_progress", output=[]))

    def delta(self, text: str, extra: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
        thought = (extra or {}).get("reasoning")
        if thought:
            if self._thinking is None:
                yield from self._open_reasoning()
            assert self._thinking is not None
            item = self.output[self._thinking]
            item["content"][0]["text"] += thought
            yield self._event("response.reasoning_text.delta", item_id=item["id"], output_index=self._thinking,
                              content_index=0, delta=thought)
        if text:
            yield from self._close_reasoning("completed")
            if self._open is None:
                yield from self._open_message()
            assert self._open is not None
            item = self.output[self._open]
            item["content"][0]["text"] += text
            yield self._event("response.output_text.delta", item_id=item["id"], output_index=self._open,
                              content_index=0, delta=text, logprobs=[])
        for call in (extra or {}).get("tool_calls") or ():
            yield from self._close_reasoning("completed")
            yield from self._close_message("completed")
            yield from self._stream_call(call)

    def _open_message(self) -> Iterator[dict[str, Any]]:
        self._open = len(self.output)
        yield from self._open_item(self._message("", "in_progress"), _text_part)

    def _open_reasoning(self) -> Iterator[dict[str, Any]]:
        self._thinking = len(self.output)
        yield from self._open_item(self._reasoning("", "in_progress"), _reasoning_part)

    def _open_item(self, item: dict[str, Any], part: Callable[[str], dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """An item with one content part, added to the output and announced, the part empty."""
        index = len(self.output)
        yield self._event("response.output_item.added", output_index=index, item=dict(item, content=[]))
        item["content"].append(part(""))
        self.output.append(item)
        yield self._event("response.content_part.added", item_id=item["id"], output_index=index,
                          content_index=0, part=part(""))

    def _close_reasoning(self, status: str) -> Iterator[dict[str, Any]]:
        if self._thinking is None:
            return
        index, self._thinking = self._thinking, None
        yield from self._close_item(index, status, "response.reasoning_text.done", {})

    def _close_message(self, status: str) -> Iterator[dict[str, Any]]:
        if self._open is None:
            return
        index, self._open = self._open, None
        yield from self._close_item(index, status, "response.output_text.done", {"logprobs": []})

    def _close_item(self, index: int, status: str, text_done: str, extra: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The item's text done (`text_done`, with `extra`), its part done, then the item done."""
        item = self.output[index]
        part = item["content"][0]
        yield self._event(text_done, item_id=item["id"], output_index=index, content_index=0,
                          text=part["text"], **extra)
        yield self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                          part=dict(part))
        item["status"] = status
        yield self._event("response.output_item.done", output_index=index, item=json.loads(json.dumps(item)))

    def _stream_call(self, call: dict[str, Any]) -> Iterator[dict[str, Any]]:
        # A call arrives whole (edge_runtime.chat.CallStreamer): its arguments go out as one delta.
        index = len(self.output)
        item = self._function_call(call, "in_progress")
        yield self._event("response.output_item.added", output_index=index, item=dict(item))
        arguments = call["function"]["arguments"]
        yield self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                          delta=arguments)
        yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          name=item["name"], arguments=arguments)
        item.update(status="completed", arguments=arguments)
        self.output.append(item)
        yield self._event("response.output_item.done", output_index=index, item=dict(item))

    def finals(self, result: dict[str, Any]) -> Iterator[dict[str, Any]]:
        status = _status(result["candidates"][0])
        yield from self._close_reasoning(status)  # still open: the reply ended inside the thinking
        if all(item["type"] == "reasoning" for item in self.output):
            yield from self._open_message()  # an empty answer is still one (empty) message, as when whole
        yield from self._close_message(status)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        yield self._event(kind, response=self.response(status, result))

    def failed(self, error: GatewayError) -> Iterator[dict[str, Any]]:
        """Headers are gone: the error travels as an `error` event, then `response.failed`."""
        yield self._event("error", code=error.code, message=error.message, param=error.param)
        yield self._event("response.failed", response=self.response("failed", error=error))


def response_error(error: GatewayError) -> dict[str, Any]:
    """A failed response's `error`: its `code` is one of the few OpenAI's Responses API defines
    (clients validate it): a refused request is `invalid_prompt`, a busy daemon
    `rate_limit_exceeded`, anything else `server_error`; the daemon's own code is its `type`."""
    status = error.status
    code = "rate_limit_exceeded" if status == 429 else "invalid_prompt" if status in (400, 413, 422) else "server_error"
    return {"code": code, "message": error.message, "param": error.param, "type": error.code}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _status(candidate: dict[str, Any]) -> str:
    return "incomplete" if candidate.get("finish_reason") == "length" else "completed"


def sse_event(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()
