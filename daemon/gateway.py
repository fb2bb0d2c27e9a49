"""The OpenAI-compatible HTTP gateway: `/v1/models`, `/v1/chat/completions`, `/v1/completions`
(whole or streamed as server-sent events), a preference-feedback extension, user rights,
`/health` and Prometheus `/metrics`, served by uvicorn on the daemon's own event loop.

Only a mapping. Every request becomes the same validated `GenerateArgs`/`FeedbackArgs` the
ZeroMQ server builds (`daemon.protocol.parse_request`) and goes to the same `Service` methods, so
admission control, typed errors, per-user adapters, interaction recording and feedback storage
are the SDK's. Completion ids are the daemon's interaction ids. docs/gateway.md describes it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import math
import re
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Literal

import uvicorn
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.applications import Starlette
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from daemon.config import DaemonConfig
from daemon.metrics import CONTENT_TYPE
from daemon.protocol import GenerateArgs, ProtocolError, parse_request
from daemon.service import VERSION, GenerateCall, Service
from edge_runtime.errors import MaceError

log = logging.getLogger(__name__)

# Daemon error code -> HTTP status. The body carries the code itself in `error.code`.
STATUS = {
    "bad_request": 400, "bad_message": 400, "unsupported_version": 400, "unknown_op": 400,
    "too_large": 413, "duplicate_id": 409, "busy": 429, "admission_rejected": 429,
    "not_ready": 503, "shutting_down": 503, "store_unavailable": 503, "model_unavailable": 503,
    "cancelled": 499, "timeout": 504, "unknown_request": 404, "unknown_user": 404,
    "adapter_unavailable": 404, "model_not_found": 404, "not_found": 404, "consent_required": 403,
    "duplicate_feedback": 409, "duplicate_request": 409, "not_supported": 501, "internal": 500,
    "invalid_api_key": 401, "method_not_allowed": 405,
}
# HTTP status -> OpenAI's error `type`.
ERROR_TYPE = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
    413: "invalid_request_error", 429: "rate_limit_error", 499: "cancelled_error",
    500: "server_error", 501: "not_supported_error", 503: "service_unavailable_error",
    504: "timeout_error",
}
# What the OpenAI API defaults to where the native protocol differs (it samples at 1.0).
OPENAI_DEFAULT_TEMPERATURE = 1.0
MODEL_ALIAS = "default"
MAX_PROMPTS = 64  # prompts in one /v1/completions request
# Pages served from this machine (any port) may call the gateway from a browser.
LOOPBACK_ORIGIN = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?"
_TYPE_NAME = re.compile(r"(str|int|float|bool|none|list|dict|literal|function-\w+)(\[.*\])?", re.IGNORECASE)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _AppUser(Convertor[str]):
    """A path segment that is an app's `user` string: any characters, '/' and line breaks too
    (Starlette's `path` stops at a line break; the protocol refuses one with a 400)."""

    regex = r"[\s\S]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("app_user", _AppUser())


class GatewayError(Exception):
    """An error reply in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, code: str, message: str, *, param: str | None = None,
                 retry_after_s: float | None = None, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.details = details

    @property
    def status(self) -> int:
        return STATUS.get(self.code, 500)

    @classmethod
    def from_exc(cls, exc: BaseException) -> GatewayError:
        if isinstance(exc, GatewayError):
            return exc
        if isinstance(exc, ProtocolError):
            return cls(exc.code, exc.message, param=exc.param, retry_after_s=exc.retry_after_s,
                       details=exc.details)
        if isinstance(exc, MaceError):  # the engine's BadRequest names its field too
            return cls(exc.code, str(exc), param=getattr(exc, "param", None),
                       retry_after_s=getattr(exc, "retry_after_s", None))
        log.error("HTTP request failed", exc_info=exc)
        return cls("internal", f"{type(exc).__name__}: {exc}")

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"message": self.message, "type": ERROR_TYPE.get(self.status, "server_error"),
                                 "param": self.param, "code": self.code}
        if self.retry_after_s is not None:
            error["retry_after_s"] = self.retry_after_s
        if self.details:
            error["details"] = self.details
        return {"error": error}

    def response(self) -> Response:
        headers: dict[str, str] = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
            headers["Retry-After-Ms"] = str(max(1, round(self.retry_after_s * 1000)))
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return _json(self.body(), self.status, headers)


# -- request bodies (shape only; values are checked by daemon.protocol, as for the SDK) ----------


class _Body(BaseModel):
    # Fields other servers add are ignored; OpenAI fields we cannot honour are refused by name.
    model_config = ConfigDict(extra="ignore")


class _Part(_Body):
    type: str
    text: str | None = None


class _Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[_Part] | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class _StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str
    max_tokens: int | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None  # -1: a fresh random seed (llama.cpp's clients send it)
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    user: str | None = None  # any string up to 256 characters (protocol.internal_user)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions (send them with the client's extra_body).
    top_k: int | None = None
    ignore_eos: bool | None = None
    adapter: str | int | None = None  # "latest" (default with `user`), "base", or a version
    record: bool | None = None  # store the interaction for feedback (default: when `user` consented)

    def unsupported(self) -> list[str]:
        """Known OpenAI parameters set to something this daemon cannot do."""
        return []


class ChatRequest(_Sampling):
    messages: list[_Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # accepted: a forced call is one call; auto may give several
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    # vLLM's prefill switches: by default a final assistant message is continued (as llama.cpp's
    # server does); continue_final_message=false or add_generation_prompt=true close it instead.
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None

    def unsupported(self) -> list[str]:
        # The legacy function-calling fields: `tools` and `tool_choice` replace them.
        return [n for n in ("functions", "function_call") if getattr(self, n) not in (None, [], "none")]


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None
    response_format: dict[str, Any] | None = None  # extension: as for chat

    def unsupported(self) -> list[str]:
        bad = ["suffix"] if self.suffix else []
        if self.best_of not in (None, 1) and self.best_of != (self.n or 1):
            bad.append("best_of")
        return bad


class EmbeddingRequest(_Body):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None


class FeedbackRequest(_Body):
    model_config = ConfigDict(extra="forbid")
    id: str  # the completion id (= the daemon's interaction id)
    user: str
    kind: str  # choice, thumbs, rating or edit
    chosen: int | None = None
    candidate: int | None = None
    up: bool | None = None
    stars: int | None = None
    text: str | None = None


class ConsentRequest(_Body):
    granted: bool | None = None  # absent (and no `fleet`): grant, as before `fleet` existed
    fleet: bool | None = None


# -- the app ------------------------------------------------------------------------------------


class Gateway:
    """The ASGI app and its handlers over one Service."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.in_flight = 0
        self.requests = 0
        self.errors: dict[str, int] = {}
        routes = [
            ("/health", self.health, "GET"),
            ("/metrics", self.metrics, "GET"),
            ("/v1/models", self.models, "GET"),
            ("/v1/models/{model:path}", self.model, "GET"),
            ("/v1/chat/completions", self.chat_completions, "POST"),
            ("/v1/completions", self.completions, "POST"),
            ("/v1/embeddings", self.embeddings, "POST"),
            ("/v1/feedback", self.feedback, "POST"),
            # `user` is the app's own string, which may hold a '/' (sent as %2F, which routing
            # sees decoded) or anything else: matched whole, before the route's fixed end, so
            # that the protocol (not a 404) judges it.
            ("/v1/users/{user:app_user}/consent", self.consent, "POST"),
            ("/v1/users/{user:app_user}/export", self.export, "GET"),
            ("/v1/users/{user:app_user}/adapters", self.adapters, "GET"),
            ("/v1/users/{user:app_user}", self.forget, "DELETE"),
        ]
        origins = [o.strip() for o in service.config.http.cors_origins.split(",") if o.strip()]
        self.app = Starlette(
            routes=[Route(path, self._answering_errors(fn), methods=[method]) for path, fn, method in routes],
            exception_handlers={HTTPException: self._on_http_error},
            # Browser apps: preflights are answered before routing and without a key (browsers
            # send none on them); the real request still needs one.
            middleware=[Middleware(CORSMiddleware, allow_origins=origins, allow_origin_regex=LOOPBACK_ORIGIN,
                                   allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                                   allow_headers=["Authorization", "Content-Type", "OpenAI-Organization",
                                                  "OpenAI-Project", "X-Stainless-Lang", "X-Stainless-Package-Version",
                                                  "X-Stainless-OS", "X-Stainless-Arch", "X-Stainless-Runtime",
                                                  "X-Stainless-Runtime-Version", "X-Stainless-Retry-Count",
                                                  "X-Stainless-Timeout"],
                                   expose_headers=["X-Mace-Adapter", "Retry-After", "Retry-After-Ms"],
                                   max_age=600)])

    @property
    def config(self) -> DaemonConfig:
        return self.service.config  # SIGHUP swaps it (API keys are reloadable)

    def summary(self) -> dict[str, Any]:
        return {"requests": self.requests, "generates_in_flight": self.in_flight,
                "errors": dict(self.errors)}

    # -- errors and auth ------------------------------------------------------------------------

    def _answering_errors(self, handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
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

    async def _on_http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            return self._error(GatewayError("method_not_allowed",
                                            f"{request.method} is not allowed on {request.url.path}"))
        return self._error(GatewayError("not_found", f"no route {request.method} {request.url.path}; "
                                        "see docs/gateway.md"))

    def _authorize(self, request: Request) -> None:
        keys = self.config.http_api_keys
        if not keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token.strip()
        # Compare against every key, each in constant time, so timing reveals nothing.
        ok = False
        for key in keys:
            ok |= hmac.compare_digest(token.encode(), key.encode())
        if scheme.lower() != "bearer" or not ok:
            raise GatewayError("invalid_api_key", "missing or invalid API key: send "
                               "'Authorization: Bearer KEY' with a key from http.api_keys")

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
        return _json(health, 200 if health["ok"] else 503)

    async def metrics(self, request: Request) -> Response:
        self._authorize(request)
        status = await self.service.status()
        adapters: list[dict[str, Any]] = []
        if self.service.state == "serving":
            with contextlib.suppress(Exception):  # a view: never fail the scrape over it
                adapters = await asyncio.wait_for(self.service.fine_tuner.adapters(None), 2.0)
        return Response(self.service.metrics.render(status, adapters), media_type=CONTENT_TYPE)

    # -- models ---------------------------------------------------------------------------------

    def _model_card(self) -> dict[str, Any]:
        started = time.time() - (time.monotonic() - self.service.started_at)
        return {"id": self.service.model_name, "object": "model", "created": int(started),
                "owned_by": "mace-edge"}

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        data = [self._model_card()] if self.service.model_name else []
        return _json({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        self._authorize(request)
        self._check_model(request.path_params["model"])
        return _json(self._model_card())

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
        extra = {"messages": messages, "tools": body.tools or None, "tool_choice": body.tool_choice,
                 "continue_final_message": continue_final or None, "response_format": body.response_format,
                 "logprobs": (body.top_logprobs or 0) if body.logprobs else None}
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
        return _json({"object": "list", "data": data, "model": result["model"],
                      "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def _parse(self, message: dict[str, Any], names: dict[str, str]) -> Any:
        """The protocol's validation of one request; its errors name the field as the client
        sent it (`max_completion_tokens`, not `max_tokens`)."""
        try:
            return parse_request({"v": 1, "id": "http", **{k: v for k, v in message.items() if v is not None}}).args
        except ProtocolError as exc:
            raise _as_sent(GatewayError.from_exc(exc), names) from None

    async def _generate(self, request: Request, body: _Sampling, kind: str, prompts: list[dict[str, Any]],
                        max_tokens: int | None, names: dict[str, str]) -> Response:
        bad = body.unsupported()
        if bad:
            raise GatewayError("bad_request", f"not supported by this server: {', '.join(bad)}", param=bad[0])
        self._check_model(body.model)
        seed = body.seed
        if seed is not None and seed < 0:
            if seed != -1:
                raise GatewayError("bad_request", "seed: an integer >= 0, or -1 for a random seed", param="seed")
            seed = None
        temperature = body.temperature if body.temperature is not None else OPENAI_DEFAULT_TEMPERATURE
        common = {"op": "generate", "max_tokens": max_tokens, "temperature": temperature, "top_p": body.top_p,
                  "n": body.n, "stop": body.stop, "seed": seed, "user": body.user, "top_k": body.top_k,
                  "ignore_eos": body.ignore_eos, "adapter": body.adapter, "record": body.record,
                  "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
                  "logit_bias": body.logit_bias}
        all_args: list[GenerateArgs] = [self._parse({**common, **extra}, names) for extra in prompts]
        limit = self.config.server.max_inflight
        if self.in_flight + len(all_args) > limit:
            raise GatewayError("busy", f"too many HTTP generations in flight (at most {limit}); retry "
                               "shortly", retry_after_s=0.5)
        reply = _Reply(kind, self.service.model_name or body.model, all_args[0].n,
                       tools=bool(all_args[0].tools) and all_args[0].tool_choice != "none")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            if all_args[0].echo:
                reply.echo = [p["prompt"] for p in prompts]
            try:
                return await self._stream(request, all_args, reply, include_usage)
            except Exception as exc:
                raise _as_sent(GatewayError.from_exc(exc), names) from None
        self.in_flight += len(all_args)
        try:
            calls = [GenerateCall(None, api="http", client=_http_client(request)) for _ in all_args]
            work = asyncio.gather(*(self.service.generate(a, c) for a, c in zip(all_args, calls, strict=True)))
            results = await self._until_done_or_gone(request, calls, work)
        except Exception as exc:  # the engine's refusals (a schema that does not compile) name fields too
            raise _as_sent(GatewayError.from_exc(exc), names) from None
        finally:
            self.in_flight -= len(all_args)
        return _json(reply.whole(results), headers=_adapter_header(results[0]))

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

    async def _stream(self, request: Request, all_args: list[GenerateArgs], reply: _Reply,
                      include_usage: bool) -> Response:
        """Hold the response until the first token (or an error) so that admission refusals and
        bad requests still get their HTTP status; then stream server-sent events. Several
        prompts stream together, their choices numbered prompt by prompt."""
        feed = _TokenFeed()
        n = all_args[0].n
        calls, tasks = [], []
        for p, args in enumerate(all_args):
            call = GenerateCall(feed.sink(p * n), api="http", client=_http_client(request))
            self.in_flight += 1
            task = asyncio.ensure_future(self.service.generate(args, call))
            task.add_done_callback(self._generation_ended)
            task.add_done_callback(lambda _: feed.ready.set())
            calls.append(call)
            tasks.append(task)
        first = asyncio.ensure_future(feed.ready.wait())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({first, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            first.cancel()
        if not feed.items:
            if gone.done() and not all(t.done() for t in tasks):  # the client went away while waiting
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
                                 media_type="text/event-stream", headers=_SSE_HEADERS)

    async def _events(self, tasks: list[asyncio.Future[dict[str, Any]]], calls: list[GenerateCall],
                      feed: _TokenFeed, reply: _Reply, include_usage: bool) -> AsyncIterator[bytes]:
        try:
            for chunk in reply.opening():
                yield _sse(chunk)
            while True:
                items = feed.take()
                if items:
                    # Everything that arrived meanwhile goes out in one write.
                    yield b"".join(_sse(reply.delta(index, text, extra)) for index, text, extra in items)
                    continue
                if all(t.done() for t in tasks):
                    break
                await feed.ready.wait()  # set by the next tokens or by the end of a generation
            failed = next((t.exception() for t in tasks if t.exception() is not None), None)
            if failed is not None:
                # Headers are gone: the error travels as an event (the openai client raises it).
                yield _sse(GatewayError.from_exc(failed).body())
                return
            results = [t.result() for t in tasks]
            yield b"".join(_sse(chunk) for chunk in reply.finals(results, include_usage))
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
        ack = await self.service.feedback(args)
        return _json({"object": "feedback", "id": ack["feedback_id"], "completion_id": body.id,
                      "user": body.user, "pair_ids": ack["pair_ids"], "unpaired_ids": ack["unpaired_ids"],
                      "durable": ack["durable"]})

    def _user_args(self, request: Request, op: str, **extra: Any) -> Any:
        return parse_request({"v": 1, "id": "http", "op": op, "user": request.path_params["user"],
                              **extra}).args

    async def consent(self, request: Request) -> Response:
        body: ConsentRequest = await self._read(request, ConsentRequest)
        granted = True if body.granted is None and body.fleet is None else body.granted
        fields = {k: v for k, v in (("granted", granted), ("fleet", body.fleet)) if v is not None}
        return _json(await self.service.users_consent(self._user_args(request, "users.consent", **fields)))

    async def export(self, request: Request) -> Response:
        self._authorize(request)
        return _json(await self.service.users_export(self._user_args(request, "users.export")))

    async def forget(self, request: Request) -> Response:
        self._authorize(request)
        return _json(await self.service.users_forget(self._user_args(request, "users.forget")))

    async def adapters(self, request: Request) -> Response:
        self._authorize(request)
        args = self._user_args(request, "adapters.list")
        return _json({"object": "list", "data": (await self.service.adapters_list(args))["adapters"]})


class _TokenFeed:
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


class _Reply:
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
        delta: dict[str, Any] = {"content": text} if text or not (extra or {}).get("tool_calls") else {}
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


def _as_sent(error: GatewayError, names: dict[str, str]) -> GatewayError:
    """The error with its field named as the client sent it (`max_completion_tokens` where the
    protocol says `max_tokens`, `messages` where it says `prompt`), in `param` and the message."""
    sent = names.get(error.param or "")
    if sent:
        error.message = error.message.replace(f"'{error.param}'", f"'{sent}'")
        error.param = sent
    return error


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
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _extension(result: dict[str, Any]) -> dict[str, Any]:
    """What the daemon adds: the adapter that served, whether feedback can refer to this id."""
    ext = {"interaction_id": result["interaction_id"], "adapter": result["adapter"],
           "recorded": result["recorded"], "timing": result.get("timing", {})}
    if result.get("record_note"):
        ext["record_note"] = result["record_note"]
    return ext


def _adapter_header(result: dict[str, Any]) -> dict[str, str]:
    return {"X-Mace-Adapter": result["adapter"] or "base"}


def _json(content: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    body = json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode()
    return Response(body, status, headers, media_type="application/json")


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body has been read, so `receive` only reports that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- serving ------------------------------------------------------------------------------------


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # maced owns SIGTERM/SIGINT (drain) and SIGHUP (reload); uvicorn must not take them.
        yield

    def install_signal_handlers(self) -> None:  # the same hook in uvicorn < 0.29
        return None


class HttpGateway:
    """Binds the HTTP socket up front (errors surface before the model loads), then serves the
    app with uvicorn on the running event loop until `close()`."""

    def __init__(self, config: DaemonConfig, service: Service,
                 app_factory: Callable[[Service], Gateway] = Gateway) -> None:
        self.config = config
        self.gateway = app_factory(service)
        self.socket: socket.socket | None = None
        self.endpoint = ""
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task[None] | None = None

    def summary(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "auth": bool(self.gateway.config.http_api_keys),
                **self.gateway.summary()}

    def bind(self) -> str:
        address = self.config.http_address
        assert address is not None
        host, port = address
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, sockaddr = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(2048)
        except OSError:
            sock.close()
            raise
        self.socket = sock
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        self.endpoint = f"http://{shown}:{bound_port}"
        return self.endpoint

    def start(self) -> None:
        assert self.socket is not None
        config = uvicorn.Config(
            self.gateway.app, http="h11", ws="none", lifespan="off", log_config=None,
            log_level="warning", access_log=False, server_header=False, proxy_headers=False,
            timeout_graceful_shutdown=2, timeout_keep_alive=5)
        self._server = _Uvicorn(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[self.socket]), name="http")

    async def close(self, timeout_s: float = 3.0) -> None:
        """Stop accepting, let open responses end (they were already cancelled by the drain),
        then force the rest."""
        if self._server is None or self._task is None:
            if self.socket is not None:
                self.socket.close()
            return
        self._server.should_exit = True
        done, _ = await asyncio.wait({self._task}, timeout=timeout_s)
        if not done:
            self._server.force_exit = True
            self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task


def _http_client(request: Request) -> tuple[str, str, str]:
    """Who an HTTP request comes from, for admission's per-client fairness: its API key (only a
    digest is kept) and its host."""
    key = request.headers.get("authorization", "")
    digest = hashlib.sha256(key.encode()).hexdigest()[:16] if key else ""
    return ("http", digest, request.client.host if request.client else "")
