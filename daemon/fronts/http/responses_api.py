"""`POST /v1/responses` (OpenAI's Responses API: text in and out, whole or streamed, function
tools, `text.format` structured output, `previous_response_id`) and `GET`/`DELETE
/v1/responses/{id}`, as a mapping onto the chat path: the request becomes the same validated
chat `GenerateArgs` (daemon.wire) and goes to the same `Service.generate`, so principals,
limits, admission, per-user adapters, the constraint engine and tool-call parsing are chat's.
docs/gateway.md#responses-api describes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from daemon.fronts.http.errors import GatewayError, as_sent
from daemon.fronts.http.handlers import (
    _EFFORT_THINKS,
    OPENAI_DEFAULT_TEMPERATURE,
    Gateway,
    _http_client,
    first_item_or_gone,
)
from daemon.fronts.http.replies import SSE_HEADERS, TokenFeed, adapter_header, json_response
from daemon.fronts.http.responses_models import ResponsesRequest
from daemon.fronts.http.responses_replies import ResponseReply, assistant_turn, sse_event
from daemon.fronts.http.responses_store import ResponseStore
from daemon.inference_gate import check_sequences
from daemon.principals import Principal
from daemon.service import GenerateCall
from daemon.wire import GenerateArgs

# Protocol field -> the Responses request's own name, for error messages and `param`.
SENT_NAMES = {"max_tokens": "max_output_tokens", "prompt": "input", "messages": "input",
              "response_format": "text.format"}
_TEXT_PARTS = ("input_text", "output_text", "text")
# `reasoning.effort`: chat's reasoning_effort values, and the Responses API's two above "high".
EFFORT_THINKS = {**_EFFORT_THINKS, "xhigh": True, "max": True}


class ResponsesApi:
    """The Responses routes over the chat gateway's handlers and one in-memory store."""

    def __init__(self, gateway: Gateway, store: ResponseStore | None = None) -> None:
        self.gateway = gateway
        self.store = store or ResponseStore()
        # Erasing a user, over any transport, drops their stored responses too (erased.responses).
        gateway.service.users.erasers["responses"] = self.store.forget_user

    @property
    def service(self) -> Any:
        return self.gateway.service

    # -- routes ---------------------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        body: ResponsesRequest = await self.gateway._read(request, ResponsesRequest)
        bad = body.unsupported()
        if bad:
            raise GatewayError("bad_request", f"not supported by this server: {', '.join(bad)}", param=bad[0])
        self.gateway._check_model(body.model)
        who: Principal = request.state.principal
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        turns = input_messages(body.input, [])
        args = self._args(body, system + turns)  # every field judged once, before any is used
        if body.previous_response_id is not None:
            history = self._history(who, body, args.user)
            turns = history + input_messages(body.input, history)  # what a later response continues
            args = self._args(body, system + turns)
        check_sequences(args.n, self.gateway.config.limits)
        limit = self.gateway.config.server.max_inflight
        if self.gateway.in_flight + 1 > limit:
            raise GatewayError("busy", f"too many HTTP generations in flight (at most {limit}); retry shortly",
                               retry_after_s=0.5)
        reply = ResponseReply(self.service.model_name or body.model, _echo(body))
        keep = self._keeper(who, args, body, turns, reply)
        if body.stream:
            try:
                return await self._stream(request, args, reply, keep)
            except Exception as exc:
                raise as_sent(GatewayError.from_exc(exc), SENT_NAMES) from None
        call = GenerateCall(None, api="http", client=_http_client(request), principal=who)
        self.gateway.in_flight += 1
        try:
            result = await self.gateway._until_done_or_gone(request, [call], self.service.generate(args, call))
        except Exception as exc:  # the engine's refusals (a schema that does not compile) name fields too
            raise as_sent(GatewayError.from_exc(exc), SENT_NAMES) from None
        finally:
            self.gateway.in_flight -= 1
        response = reply.whole(result)
        keep(response)
        return json_response(response, headers=adapter_header(result))

    async def retrieve(self, request: Request) -> Response:
        who = self.gateway._authorize(request)
        return json_response(self._stored(who, request.path_params["response_id"]).response)

    async def delete(self, request: Request) -> Response:
        who = self.gateway._authorize(request)
        response_id = request.path_params["response_id"]
        self._stored(who, response_id)
        self.store.delete(who, response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True})

    # -- the request as chat --------------------------------------------------------------------

    def _stored(self, who: Principal, response_id: str, user: str | None = None, param: str | None = None) -> Any:
        entry = self.store.get(who, user, response_id)
        if entry is None:  # another principal's or user's answers alike: nothing says they exist
            raise GatewayError("unknown_request", f"no stored response {response_id!r} for this caller (responses "
                               "are kept in memory for an hour, per API key's app and user; see "
                               "docs/gateway.md#responses-api)", param=param)
        return entry

    def _history(self, who: Principal, body: ResponsesRequest, user: str | None) -> list[dict[str, Any]]:
        """The earlier turns `previous_response_id` names, for the same principal and `user`
        (the validated request's) only (their instructions are not carried over, as in OpenAI's API)."""
        user = self.service.users.stored(who, None, user) if user is not None else ""
        entry = self._stored(who, body.previous_response_id, user, "previous_response_id")
        return [dict(m) for m in entry.messages]

    def _args(self, body: ResponsesRequest, messages: list[dict[str, Any]]) -> GenerateArgs:
        seed = body.seed
        if type(seed) is int and seed < 0:  # any other type is the schema's to refuse
            if seed != -1:
                raise GatewayError("bad_request", "seed: an integer >= 0, or -1 for a random seed", param="seed")
            seed = None
        temperature = body.temperature if body.temperature is not None else OPENAI_DEFAULT_TEMPERATURE
        message = {"op": "generate", "messages": messages, "max_tokens": body.max_output_tokens,
                   "temperature": temperature, "top_p": body.top_p, "seed": seed, "stop": body.stop,
                   "user": body.user, "top_k": body.top_k, "ignore_eos": body.ignore_eos,
                   "adapter": body.adapter, "record": body.record, "speculation": body.speculation,
                   "tools": chat_tools(body.tools),
                   "tool_choice": chat_tool_choice(body.tool_choice),
                   "response_format": chat_response_format(body.text), "thinking": thinking_switch(body.reasoning)}
        return self.gateway._parse(message, SENT_NAMES)

    def _keeper(self, who: Principal, args: GenerateArgs, body: ResponsesRequest,
                turns: list[dict[str, Any]], reply: ResponseReply) -> Callable[[dict[str, Any]], None]:
        """What stores a finished response (`store`, true by default as in OpenAI's API): its
        turns without `instructions`, its output as the assistant's turn."""
        def keep(response: dict[str, Any]) -> None:
            if body.store is False:
                return
            user = self.service.users.stored(who, None, args.user) if args.user is not None else ""
            self.store.put(who, user, response["id"], turns + [assistant_turn(reply.output)], response)

        return keep

    # -- streaming ------------------------------------------------------------------------------

    async def _stream(self, request: Request, args: GenerateArgs, reply: ResponseReply,
                      keep: Callable[[dict[str, Any]], None]) -> Response:
        """As chat's stream: held until the first token or an error (so refusals keep their
        HTTP status), then typed events."""
        feed = TokenFeed()
        call = GenerateCall(feed.sink(0), api="http", client=_http_client(request),
                            principal=request.state.principal)
        self.gateway.in_flight += 1
        task = asyncio.ensure_future(self.service.generate(args, call))
        task.add_done_callback(self.gateway._generation_ended)
        task.add_done_callback(lambda _: feed.ready.set())
        gone = await first_item_or_gone(request, feed)
        if not feed.items:
            if gone and not task.done():  # the client went away while waiting
                self.service.cancel(call, "client_gone")
                await asyncio.wait({task})
            if task.done() and task.exception() is not None:  # before any token: its own HTTP status
                await task
        reply.id = call.engine_id or ""
        return StreamingResponse(self._events(task, call, feed, reply, keep), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    async def _events(self, task: asyncio.Future[dict[str, Any]], call: GenerateCall, feed: TokenFeed,
                      reply: ResponseReply, keep: Callable[[dict[str, Any]], None]) -> AsyncIterator[bytes]:
        try:
            yield b"".join(sse_event(e) for e in reply.opening())
            while True:
                items = feed.take()
                if items:
                    yield b"".join(sse_event(e) for _, text, extra in items for e in reply.delta(text, extra))
                    continue
                if task.done():
                    break
                await feed.ready.wait()
            failed = task.exception()
            if failed is not None:
                yield b"".join(sse_event(e) for e in reply.failed(as_sent(GatewayError.from_exc(failed), SENT_NAMES)))
                return
            result = task.result()
            reply.id = result["interaction_id"]
            events = list(reply.finals(result))
            keep(events[-1]["response"])
            yield b"".join(sse_event(e) for e in events)
        finally:
            if not task.done():  # the client disconnected mid-stream
                self.service.cancel(call, "client_gone")


# -- Responses shapes -> chat shapes (pure) -----------------------------------------------------

def input_messages(value: str | list[dict[str, Any]], history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat turns: a string is one user turn; items are messages, `function_call`s
    (assistant turns' tool calls) and `function_call_output`s (tool turns); `reasoning` items
    are dropped (thinking is not fed back, as chat templates drop it)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise GatewayError("bad_request", "input: a string or a non-empty list of items", param="input")
    names = {c["id"]: c["function"]["name"] for m in history for c in m.get("tool_calls") or ()}
    turns: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise GatewayError("bad_request", f"input.{i}.role: one of user, assistant, system, developer",
                                   param=f"input.{i}.role")
            turns.append({"role": "system" if role == "developer" else role,
                          "content": _text(item.get("content"), f"input.{i}.content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}}
            names[call["id"]] = call["function"]["name"]
            last = turns[-1] if turns else None
            if last is not None and last["role"] == "assistant":  # one turn: its text and its calls
                last.setdefault("tool_calls", []).append(call)
                last["content"] = last["content"] or None
            else:
                turns.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", i)
            turn = {"role": "tool", "tool_call_id": call_id,
                    "content": _text(item.get("output"), f"input.{i}.output")}
            if call_id in names:
                turn["name"] = names[call_id]
            turns.append(turn)
        elif kind == "reasoning":
            continue
        else:
            raise GatewayError("bad_request", f"input.{i}.type: {kind!r} items are not supported here; send "
                               "message, function_call, function_call_output (or reasoning, dropped)",
                               param=f"input.{i}.type")
    return turns


def thinking_switch(reasoning: dict[str, Any] | None) -> bool | None:
    """`reasoning.effort` as chat's `reasoning_effort` turns a thinking model's switch (None: the
    template's default). Thinking is never fed back to later turns: `reasoning.context` can only
    be the current turn's."""
    reasoning = reasoning or {}
    if reasoning.get("context") not in (None, "auto", "current_turn"):
        raise GatewayError("bad_request", "reasoning.context: only 'current_turn' (thinking is not carried to "
                           "later turns)", param="reasoning.context")
    effort = reasoning.get("effort")
    if effort is None:
        return None
    if not isinstance(effort, str) or effort not in EFFORT_THINKS:
        raise GatewayError("bad_request", "reasoning.effort: one of " + ", ".join(EFFORT_THINKS),
                           param="reasoning.effort")
    return EFFORT_THINKS[effort]


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise GatewayError("bad_request", f"input.{i}.{key}: a string", param=f"input.{i}.{key}")
    return value


def _text(content: Any, param: str) -> str:
    """A string, or text parts joined with newlines; images, files and audio are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise GatewayError("bad_request", f"{param}: a string or a list of text parts", param=param)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("refusal" if kind == "refusal" else "text") if isinstance(part, dict) else None
        if kind not in (*_TEXT_PARTS, "refusal") or not isinstance(text, str):
            raise GatewayError("bad_request", f"{param}.{j}: only text parts are supported; got {kind!r}",
                               param=f"{param}.{j}")
        parts.append(text)
    return "\n".join(parts)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's nested ones; built-in tools are refused."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise GatewayError("bad_request", f"tools.{i}.type: only function tools are supported; got "
                               f"{tool.get('type')!r}", param=f"tools.{i}.type")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise GatewayError("bad_request", "tool_choice: 'none', 'auto', 'required' or {'type': 'function', "
                       "'name': ...}", param="tool_choice")


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format`: Responses flattens `json_schema`'s fields."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise GatewayError("bad_request", "text.format: a map with 'type'", param="text.format")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return fmt


def _echo(body: ResponsesRequest) -> dict[str, Any]:
    """The request fields a response repeats."""
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "temperature": body.temperature if body.temperature is not None else OPENAI_DEFAULT_TEMPERATURE,
            "top_p": body.top_p if body.top_p is not None else 1.0, "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [], "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
            "store": body.store is not False, "truncation": "disabled", "user": body.user,
            "reasoning": body.reasoning, "background": False}
