"""The OpenAI-compatible HTTP gateway's handlers: `/v1/models`, `/v1/chat/completions`,
`/v1/completions` (whole or streamed), `/v1/embeddings`, the preference-feedback extension, user
rights, `/health` and Prometheus `/metrics`.

Only a mapping. Every request becomes the same validated `GenerateArgs`/`FeedbackArgs` the
ZeroMQ server builds (`daemon.wire.parse_request`) and goes to the same `Service` methods, so
admission control, typed errors, per-user adapters, interaction recording and feedback storage
are the SDK's. Completion ids are the daemon's interaction ids. docs/gateway.md describes it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import re
import struct
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from daemon.config import DaemonConfig
from daemon.fronts.http.errors import GatewayError, as_sent
from daemon.fronts.http.models import (
    ChatRequest,
    CompletionRequest,
    ConsentRequest,
    EmbeddingRequest,
    FeedbackRequest,
    Sampling,
)
from daemon.fronts.http.replies import (
    SSE_HEADERS,
    Reply,
    TokenFeed,
    adapter_header,
    json_response,
    sse,
)
from daemon.inference_gate import check_sequences
from daemon.metrics import CONTENT_TYPE
from daemon.principals import DEFAULT_APP, Principal
from daemon.service import GenerateCall, Service
from daemon.wire import AdaptersListArgs, GenerateArgs, ProtocolError, parse_request

log = logging.getLogger(__name__)

# What the OpenAI API defaults to where the native protocol differs (it samples at 1.0).
OPENAI_DEFAULT_TEMPERATURE = 1.0
MODEL_ALIAS = "default"
MAX_PROMPTS = 64  # prompts in one /v1/completions request
_TYPE_NAME = re.compile(r"(str|int|float|bool|none|list|dict|literal|function-\w+)(\[.*\])?", re.IGNORECASE)


class Gateway:
    """The handlers over one Service (daemon.fronts.http.app routes them)."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.in_flight = 0
        self.requests = 0
        self.errors: dict[str, int] = {}

    @property
    def config(self) -> DaemonConfig:
        return self.service.config  # SIGHUP swaps it (API keys are reloadable)

    def summary(self) -> dict[str, Any]:
        return {"requests": self.requests, "generates_in_flight": self.in_flight,
                "errors": dict(self.errors)}

    # -- errors and auth ------------------------------------------------------------------------

    def answering_errors(self, handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        """Every failure becomes an OpenAI-shaped error reply with its status."""
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                return self._error(GatewayError.from_exc(exc))

        return endpoint

    def _error(self, error: GatewayError) -> Response:
        self.errors[error.code] = self.errors.get(error.code, 0) + 1
        return error.response()

    async def on_http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            return self._error(GatewayError("method_not_allowed",
                                            f"{request.method} is not allowed on {request.url.path}"))
        return self._error(GatewayError("not_found", f"no route {request.method} {request.url.path}; "
                                        "see docs/gateway.md"))

    def _authorize(self, request: Request) -> Principal:
        """The request's principal, from its API key (docs/security.md); kept on the request.
        With no key configured anywhere, every caller is the default app."""
        identities = self.service.identities
        if not identities.api_keys:
            who = Principal("app", DEFAULT_APP, "HTTP without API keys")
        else:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            found = identities.for_api_key(token.strip())
            if scheme.lower() != "bearer" or found is None:
                raise GatewayError("invalid_api_key", "missing or invalid API key: send "
                                   "'Authorization: Bearer KEY' with a key from http.api_keys or [[apps]]")
            who = found
        request.state.principal = who
        return who

    async def _read(self, request: Request, model: type[BaseModel]) -> Any:
        self._authorize(request)
        self.requests += 1
        limit = self.config.server.max_message_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise GatewayError("too_large", f"request body of {declared} bytes exceeds the limit of {limit}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise GatewayError("too_large", f"request body exceeds the limit of {limit} bytes")
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise GatewayError("bad_request", f"the body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise GatewayError("bad_request", "the body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            # The field as the client named it: pydantic adds the union member it tried
            # ("stop.str", "prompt.list[int]"), which is no field of the request.
            loc = ".".join(str(p) for p in first["loc"] if not _TYPE_NAME.fullmatch(str(p)))
            raise GatewayError("bad_request", f"{loc or 'body'}: {first['msg']}"
                               + (f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""),
                               param=loc or None) from None

    # -- health and metrics ---------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        health = self.service.health()
        return json_response(health, 200 if health["ok"] else 503)

    async def metrics(self, request: Request) -> Response:
        self._authorize(request)
        who = self._authorize(request)
        status = await self.service.status(who)
        adapters: list[dict[str, Any]] = []
        if self.service.state == "serving":
            with contextlib.suppress(Exception):  # a view: never fail the scrape over it
                listing = await asyncio.wait_for(self.service.users.adapters_list(AdaptersListArgs(), who), 2.0)
                adapters = listing["adapters"]
        return Response(self.service.metrics.render(status, adapters), media_type=CONTENT_TYPE)

    # -- models ---------------------------------------------------------------------------------

    def _model_card(self) -> dict[str, Any]:
        started = time.time() - (time.monotonic() - self.service.started_at)
        return {"id": self.service.model_name, "object": "model", "created": int(started),
                "owned_by": "mace-edge"}

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        data = [self._model_card()] if self.service.model_name else []
        return json_response({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        self._authorize(request)
        self._check_model(request.path_params["model"])
        return json_response(self._model_card())

    def _check_model(self, name: str) -> None:
        served = self.service.model_name
        if not served:  # still loading: the generate answers not_ready
            return
        if name not in (served, MODEL_ALIAS):
            raise GatewayError("model_not_found", f"model {name!r} is not served here; this daemon "
                               f"serves {served!r} (per-user adapters are chosen by `user`, not by "
                               "model)", param="model")

    # -- generation -----------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        body: ChatRequest = await self._read(request, ChatRequest)
        messages = []
        for i, m in enumerate(body.messages):
            if m.role == "function":
                raise GatewayError("bad_request", f"messages.{i}: 'function' messages are the legacy "
                                   "function-calling API; send tool messages (role 'tool')",
                                   param=f"messages.{i}.role")
            if isinstance(m.content, list):
                parts = []
                for j, part in enumerate(m.content):
                    if part.type != "text" or part.text is None:
                        raise GatewayError("bad_request", f"messages.{i}.content.{j}: only text parts "
                                           f"are supported; got {part.type!r}",
                                           param=f"messages.{i}.content")
                    parts.append(part.text)
                content: str | None = "\n".join(parts)
            else:
                content = m.content
            message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                       "content": content if content is not None or m.tool_calls else ""}
            if m.role == "assistant" and m.tool_calls:
                message["tool_calls"] = m.tool_calls
            if m.role == "tool":
                message.update({k: v for k, v in (("tool_call_id", m.tool_call_id), ("name", m.name)) if v})
            messages.append(message)
        last = body.messages[-1] if body.messages else None
        continue_final = body.continue_final_message
        if continue_final is None:  # a final assistant message is a prefill, unless told otherwise
            continue_final = (last is not None and last.role == "assistant" and not last.tool_calls
                              and body.add_generation_prompt is not True)
        if body.top_logprobs is not None and not body.logprobs:
            raise GatewayError("bad_request", "top_logprobs needs logprobs: true", param="top_logprobs")
        extra = {"messages": messages, "tools": None if body.tools == [] else body.tools,
                 "tool_choice": body.tool_choice, "thinking": _thinking_switch(body),
                 "continue_final_message": continue_final or None, "response_format": body.response_format,
                 "logprobs": (0 if body.top_logprobs is None else body.top_logprobs) if body.logprobs else None}
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        names = {"max_tokens": "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
                 "logprobs": "top_logprobs", "prompt": "messages"}
        return await self._generate(request, body, "chat", [extra], max_tokens, names)

    async def completions(self, request: Request) -> Response:
        body: CompletionRequest = await self._read(request, CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts: list[Any] = [prompt]
        else:
            prompts = list(prompt)
        if not prompts or len(prompts) > MAX_PROMPTS:
            raise GatewayError("bad_request", f"prompt: give 1-{MAX_PROMPTS} prompts", param="prompt")
        if body.echo and body.logprobs is not None:
            raise GatewayError("bad_request", "echo with logprobs: the log-probabilities of prompt tokens are "
                               "not computed by this server", param="echo")
        if body.echo and body.stream and not all(isinstance(p, str) for p in prompts):
            raise GatewayError("bad_request", "echo of token-id prompts is not streamed; send text prompts "
                               "or stream=false", param="echo")
        extras = [{"prompt": p, "logprobs": body.logprobs, "echo": body.echo or None,
                   "response_format": body.response_format} for p in prompts]
        return await self._generate(request, body, "text", extras, body.max_tokens, {})

    async def embeddings(self, request: Request) -> Response:
        body: EmbeddingRequest = await self._read(request, EmbeddingRequest)
        self._check_model(body.model)
        if body.dimensions is not None:
            raise GatewayError("bad_request", "dimensions: this server returns the model's hidden size only",
                               param="dimensions")
        args = self._parse({"op": "embed", "input": body.input}, {"input": "input"})
        result = await self.service.embed(args)
        data = []
        for i, vector in enumerate(result["embeddings"]):
            value: Any = vector
            if body.encoding_format == "base64":
                value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": value})
        tokens = result["usage"]["prompt_tokens"]
        return json_response({"object": "list", "data": data, "model": result["model"],
                      "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def _parse(self, message: dict[str, Any], names: dict[str, str]) -> Any:
        """The protocol's validation of one request; its errors name the field as the client
        sent it (`max_completion_tokens`, not `max_tokens`)."""
        try:
            return parse_request({"v": 1, "id": "http", **{k: v for k, v in message.items() if v is not None}}).args
        except ProtocolError as exc:
            raise as_sent(GatewayError.from_exc(exc), names) from None

    async def _generate(self, request: Request, body: Sampling, kind: str, prompts: list[dict[str, Any]],
                        max_tokens: int | None, names: dict[str, str]) -> Response:
        bad = body.unsupported()
        if bad:
            raise GatewayError("bad_request", f"not supported by this server: {', '.join(bad)}", param=bad[0])
        self._check_model(body.model)
        seed = body.seed
        if type(seed) is int and seed < 0:  # any other type is the schema's to refuse
            if seed != -1:
                raise GatewayError("bad_request", "seed: an integer >= 0, or -1 for a random seed", param="seed")
            seed = None
        temperature = body.temperature if body.temperature is not None else OPENAI_DEFAULT_TEMPERATURE
        common = {"op": "generate", "max_tokens": max_tokens, "temperature": temperature, "top_p": body.top_p,
                  "n": body.n, "stop": body.stop, "seed": seed, "user": body.user, "top_k": body.top_k,
                  "ignore_eos": body.ignore_eos, "adapter": body.adapter, "record": body.record,
                  "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
                  "logit_bias": body.logit_bias, "speculation": body.speculation}
        all_args: list[GenerateArgs] = [self._parse({**common, **extra}, names) for extra in prompts]
        check_sequences(sum(a.n for a in all_args), self.config.limits)  # before any is queued
        limit = self.config.server.max_inflight
        if self.in_flight + len(all_args) > limit:
            raise GatewayError("busy", f"too many HTTP generations in flight (at most {limit}); retry "
                               "shortly", retry_after_s=0.5)
        reply = Reply(kind, self.service.model_name or body.model, all_args[0].n,
                       tools=bool(all_args[0].tools) and all_args[0].tool_choice != "none")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            if all_args[0].echo:
                reply.echo = [p["prompt"] for p in prompts]
            try:
                return await self._stream(request, all_args, reply, include_usage)
            except Exception as exc:
                raise as_sent(GatewayError.from_exc(exc), names) from None
        self.in_flight += len(all_args)
        try:
            calls = [GenerateCall(None, api="http", client=_http_client(request),
                                  principal=request.state.principal) for _ in all_args]
            work = asyncio.gather(*(self.service.generate(a, c) for a, c in zip(all_args, calls, strict=True)))
            results = await self._until_done_or_gone(request, calls, work)
        except Exception as exc:  # the engine's refusals (a schema that does not compile) name fields too
            raise as_sent(GatewayError.from_exc(exc), names) from None
        finally:
            self.in_flight -= len(all_args)
        return json_response(reply.whole(results), headers=adapter_header(results[0]))

    async def _until_done_or_gone(self, request: Request, calls: list[GenerateCall], work: Any) -> Any:
        """Run `work`; if the client disconnects first, cancel its generations (as for ZeroMQ
        clients that go away) and let them unwind."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not task.done():
            for call in calls:
                self.service.cancel(call, "client_gone")
        return await task

    async def _stream(self, request: Request, all_args: list[GenerateArgs], reply: Reply,
                      include_usage: bool) -> Response:
        """Hold the response until the first token (or an error) so that admission refusals and
        bad requests still get their HTTP status; then stream server-sent events. Several
        prompts stream together, their choices numbered prompt by prompt."""
        feed = TokenFeed()
        n = all_args[0].n
        calls, tasks = [], []
        for p, args in enumerate(all_args):
            call = GenerateCall(feed.sink(p * n), api="http", client=_http_client(request),
                                principal=request.state.principal)
            self.in_flight += 1
            task = asyncio.ensure_future(self.service.generate(args, call))
            task.add_done_callback(self._generation_ended)
            task.add_done_callback(lambda _: feed.ready.set())
            calls.append(call)
            tasks.append(task)
        gone = await first_item_or_gone(request, feed)
        if not feed.items:
            if gone and not all(t.done() for t in tasks):  # the client went away while waiting
                for call in calls:
                    self.service.cancel(call, "client_gone")
                await asyncio.wait(tasks)
            failed = next((t for t in tasks if t.done() and t.exception() is not None), None)
            if failed is not None:  # before any token: the error gets its HTTP status
                for call in calls:
                    self.service.cancel(call, "cancelled")
                await failed
        reply.id = calls[0].engine_id or ""  # the interaction id, set once the engine took the request
        return StreamingResponse(self._events(tasks, calls, feed, reply, include_usage),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    async def _events(self, tasks: list[asyncio.Future[dict[str, Any]]], calls: list[GenerateCall],
                      feed: TokenFeed, reply: Reply, include_usage: bool) -> AsyncIterator[bytes]:
        try:
            for chunk in reply.opening():
                yield sse(chunk)
            while True:
                items = feed.take()
                if items:
                    # Everything that arrived meanwhile goes out in one write.
                    yield b"".join(sse(reply.delta(index, text, extra)) for index, text, extra in items)
                    continue
                if all(t.done() for t in tasks):
                    break
                await feed.ready.wait()  # set by the next tokens or by the end of a generation
            failed = next((t.exception() for t in tasks if t.exception() is not None), None)
            if failed is not None:
                # Headers are gone: the error travels as an event (the openai client raises it).
                yield sse(GatewayError.from_exc(failed).body())
                return
            results = [t.result() for t in tasks]
            yield b"".join(sse(chunk) for chunk in reply.finals(results, include_usage))
            yield b"data: [DONE]\n\n"
        finally:
            if not all(t.done() for t in tasks):  # the client disconnected mid-stream
                for call in calls:
                    self.service.cancel(call, "client_gone")

    def _generation_ended(self, task: asyncio.Future[Any]) -> None:
        self.in_flight -= 1
        if not task.cancelled():
            task.exception()  # retrieved here; the stream reports it

    # -- feedback and user rights ---------------------------------------------------------------

    async def feedback(self, request: Request) -> Response:
        body: FeedbackRequest = await self._read(request, FeedbackRequest)
        fields = body.model_dump(exclude={"id", "user"}, exclude_none=True)
        args = parse_request({"v": 1, "id": "http", "op": "feedback", "user": body.user,
                              "interaction_id": body.id, "feedback": fields}).args
        ack = await self.service.users.feedback(args, request.state.principal)
        return json_response({"object": "feedback", "id": ack["feedback_id"], "completion_id": body.id,
                      "user": body.user, "pair_ids": ack["pair_ids"], "unpaired_ids": ack["unpaired_ids"],
                      "durable": ack["durable"]})

    def _user_args(self, request: Request, op: str, **extra: Any) -> Any:
        """The op's arguments; `?app=NAME` names another app's user (the operator's right)."""
        app = request.query_params.get("app")
        return parse_request({"v": 1, "id": "http", "op": op, "user": request.path_params["user"],
                              **({"app": app} if app is not None else {}), **extra}).args

    async def consent(self, request: Request) -> Response:
        body: ConsentRequest = await self._read(request, ConsentRequest)
        granted = True if body.granted is None and body.fleet is None else body.granted
        fields = {k: v for k, v in (("granted", granted), ("fleet", body.fleet)) if v is not None}
        args = self._user_args(request, "users.consent", **fields)
        return json_response(await self.service.users.consent(args, request.state.principal))

    async def export(self, request: Request) -> Response:
        who = self._authorize(request)
        return json_response(await self.service.users.export(self._user_args(request, "users.export"), who))

    async def forget(self, request: Request) -> Response:
        who = self._authorize(request)
        return json_response(await self.service.users.forget(self._user_args(request, "users.forget"), who))

    async def adapters(self, request: Request) -> Response:
        who = self._authorize(request)
        args = self._user_args(request, "adapters.list")
        return json_response({"object": "list", "data": (await self.service.users.adapters_list(args, who))["adapters"]})


# OpenAI's reasoning_effort values: "none" and "minimal" ask for no thinking, the others for some.
_EFFORT_THINKS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True}


def _thinking_switch(body: ChatRequest) -> bool | None:
    """The request's thinking switch: chat_template_kwargs' enable_thinking (or Granite's name,
    thinking: either drives the model's switch), else reasoning_effort; None leaves the model's
    default (docs/thinking.md)."""
    kwargs = body.chat_template_kwargs or {}
    unknown = sorted(set(kwargs) - {"enable_thinking", "thinking"})
    if unknown:
        raise GatewayError("bad_request", f"chat_template_kwargs: only 'enable_thinking' or 'thinking' is "
                           f"supported; got {', '.join(map(repr, unknown))}", param="chat_template_kwargs")
    if kwargs:
        if any(not isinstance(v, bool) for v in kwargs.values()) or len(set(kwargs.values())) > 1:
            raise GatewayError("bad_request", "chat_template_kwargs: enable_thinking or thinking, true or false",
                               param="chat_template_kwargs")
        return next(iter(kwargs.values()))
    if body.reasoning_effort is None:
        return None
    if body.reasoning_effort not in _EFFORT_THINKS:
        raise GatewayError("bad_request", "reasoning_effort: one of " + ", ".join(_EFFORT_THINKS),
                           param="reasoning_effort")
    return _EFFORT_THINKS[body.reasoning_effort]


async def first_item_or_gone(request: Request, feed: TokenFeed) -> bool:
    """Wait for a stream's first item (or its generations' end: they set `feed.ready` too) or the
    client hanging up, whichever comes first; True if the client went away."""
    first = asyncio.ensure_future(feed.ready.wait())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({first, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        first.cancel()
    return gone.done()  # read before the cancellations take effect: done only if it had returned


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body has been read, so `receive` only reports that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _http_client(request: Request) -> tuple[str, str, str]:
    """Who an HTTP request comes from, for admission's per-client fairness: its API key (only a
    digest is kept) and its host."""
    key = request.headers.get("authorization", "")
    digest = hashlib.sha256(key.encode()).hexdigest()[:16] if key else ""
    return ("http", digest, request.client.host if request.client else "")
