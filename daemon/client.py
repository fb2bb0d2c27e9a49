"""Client SDK for `maced`: `Client` (blocking) and `AsyncClient` (asyncio), with token streams,
timeouts, reconnects and safe retries of idempotent operations.

Imports only zmq, msgpack and the standard library (never torch), so any app can use it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from daemon.endpoints import default_client_endpoint
from daemon.protocol import IDEMPOTENT_OPS, PROTOCOL_VERSION, ProtocolError, decode, encode
from daemon.wire_tensors import tensors_from_wire, tensors_to_wire

__all__ = ["AsyncClient", "Candidate", "Client", "ClientError", "DaemonUnavailable",
           "GenerateResult", "RemoteError", "Token", "TokenStream", "AsyncTokenStream", "tensors_from_wire",
           "tensors_to_wire"]

# The daemon did nothing with a request refused for these reasons: resending is always safe.
_RETRY_ANY = frozenset({"busy", "not_ready"})


class ClientError(Exception):
    """Base of everything the SDK raises."""


class DaemonUnavailable(ClientError):
    """No answer: the daemon is not running, not reachable, or did not reply within the timeout."""


class RemoteError(ClientError):
    """The daemon answered with a typed error (`code`, see docs/protocol.md)."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None,
                 details: dict[str, Any] | None = None, param: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.details = details or {}
        self.param = param  # the request field at fault, for bad_request


@dataclass(frozen=True)
class Token:
    """A piece of streamed text of candidate `index`; `logprobs` (when asked for) of the piece's
    tokens, `tool_calls` that completed in it (when tools were offered)."""

    index: int
    text: str
    token_id: int | None = None
    logprobs: list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Candidate:
    index: int
    text: str  # with tools offered: the content, without the calls
    finish_reason: str | None  # "stop", "length", "tool_calls", ...
    completion_tokens: int
    logprobs: list[dict[str, Any]] | None = None  # {token_id, logprob, bytes, top: [[id, logprob, bytes]]}
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's shape: {id, type, function: {name, arguments}}


@dataclass(frozen=True)
class GenerateResult:
    """A finished generate. Give `interaction_id` back with the user's feedback."""

    interaction_id: str
    candidates: list[Candidate]
    model: str = ""
    adapter: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    timing: dict[str, float] = field(default_factory=dict)
    recorded: bool = False
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def text(self) -> str:
        return self.candidates[0].text if self.candidates else ""

    @classmethod
    def from_reply(cls, result: dict[str, Any]) -> GenerateResult:
        return cls(
            interaction_id=result.get("interaction_id", ""),
            candidates=[Candidate(c["index"], c["text"], c.get("finish_reason"), c.get("completion_tokens", 0),
                                  c.get("logprobs"), c.get("tool_calls"))
                        for c in result.get("candidates", [])],
            model=result.get("model", ""), adapter=result.get("adapter"),
            usage=result.get("usage", {}), timing=result.get("timing", {}),
            recorded=bool(result.get("recorded")), raw=result)


def _generate_fields(prompt: str | None, messages: list[dict[str, str]] | None,
                     params: dict[str, Any]) -> dict[str, Any]:
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt= or messages=")
    fields = {"prompt": prompt} if prompt is not None else {"messages": messages}
    fields.update({k: v for k, v in params.items() if v is not None})
    return fields


def _feedback_fields(user: str, interaction_id: str, kind: str, values: dict[str, Any]) -> dict[str, Any]:
    return {"user": user, "interaction_id": interaction_id, "feedback": {"kind": kind, **values}}


def _final(message: dict[str, Any]) -> dict[str, Any]:
    """The result of a final reply, or the RemoteError it carries."""
    if message.get("type") == "error":
        error = message.get("error") or {}
        raise RemoteError(str(error.get("code", "internal")), str(error.get("message", "")),
                          error.get("retry_after_s"), error.get("details"), error.get("param"))
    return message.get("result") or {}


def _token(message: dict[str, Any]) -> Token:
    return Token(int(message.get("index", 0)), str(message.get("text", "")), message.get("token_id"),
                 message.get("logprobs"), message.get("tool_calls"))


class _Ids:
    def __init__(self) -> None:
        self._prefix = secrets.token_hex(4)
        self._counter = itertools.count(1)

    def next(self) -> str:
        return f"{self._prefix}-{next(self._counter)}"


def _configure(sock: zmq.Socket, connect_timeout_s: float, curve_server_key: bytes | None,
               curve_client_keys: tuple[bytes, bytes] | None) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    # Queue nothing for a daemon that is not connected: a send then fails after the timeout
    # instead of silently waiting for a daemon that may never come.
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.SNDTIMEO, int(connect_timeout_s * 1000))
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
    if curve_server_key is not None:
        if curve_client_keys is None:
            curve_client_keys = zmq.curve_keypair()
        sock.curve_serverkey = curve_server_key
        sock.curve_publickey, sock.curve_secretkey = curve_client_keys


class _Retrying:
    """The retry rule shared by both clients."""

    def __init__(self, retries: int) -> None:
        self.retries = retries

    def attempts(self, op: str) -> int:
        return 1 + self.retries

    @staticmethod
    def may_resend(op: str, error: Exception) -> bool:
        if isinstance(error, RemoteError):
            return error.code in _RETRY_ANY
        return op in IDEMPOTENT_OPS  # no answer: only safe when doing it twice changes nothing

    @staticmethod
    def settled_by_retry(op: str, attempt: int, error: RemoteError) -> dict[str, Any] | None:
        # A resent feedback that the daemon already stored: the first send did succeed.
        if attempt > 0 and op == "feedback" and error.code == "duplicate_feedback":
            return {"duplicate": True, "durable": True}
        return None


# -- blocking client ------------------------------------------------------------------------------


class Client:
    """Blocking client. One socket; use one Client per thread.

    `timeout_s` bounds the wait for each reply (for a stream: between two messages);
    idempotent operations are resent up to `retries` times on a fresh connection.
    """

    def __init__(self, endpoint: str | None = None, *, timeout_s: float = 120.0,
                 connect_timeout_s: float = 5.0, retries: int = 2,
                 curve_server_key: bytes | None = None,
                 curve_client_keys: tuple[bytes, bytes] | None = None,
                 context: zmq.Context | None = None) -> None:
        self.endpoint = endpoint or default_client_endpoint()
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._retry = _Retrying(retries)
        self._curve = (curve_server_key, curve_client_keys)
        self._context = context or zmq.Context.instance()
        self._ids = _Ids()
        self._mailbox: dict[str, deque[dict[str, Any]]] = {}
        self._sock: zmq.Socket | None = None
        self._connect()

    def _connect(self) -> None:
        sock = self._context.socket(zmq.DEALER)
        _configure(sock, self.connect_timeout_s, *self._curve)
        sock.connect(self.endpoint)
        self._sock = sock

    def reconnect(self) -> None:
        """Drop the connection (and every reply still owed on it) and open a fresh one."""
        if self._sock is not None:
            self._sock.close(linger=0)
        self._mailbox.clear()
        self._connect()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -----------------------------------------------------------------------------

    def _send(self, request_id: str, op: str, fields: dict[str, Any], expect_reply: bool = True) -> None:
        assert self._sock is not None, "client is closed"
        if expect_reply:
            self._mailbox[request_id] = deque()
        try:
            self._sock.send(encode({"v": PROTOCOL_VERSION, "id": request_id, "op": op, **fields}))
        except zmq.Again:
            self._mailbox.pop(request_id, None)
            raise DaemonUnavailable(f"cannot reach the daemon at {self.endpoint} (is maced running?)") from None

    def _next_message(self, request_id: str, timeout_s: float) -> dict[str, Any]:
        """The next message for `request_id`, filing messages for other requests in the mailbox."""
        assert self._sock is not None, "client is closed"
        box = self._mailbox.get(request_id)
        if box:
            return box.popleft()
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._sock.poll(int(remaining * 1000) + 1):
                raise DaemonUnavailable(f"no reply from the daemon at {self.endpoint} within {timeout_s:g} s")
            try:
                message = decode(self._sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                continue
            except ProtocolError:
                continue  # not from a daemon we understand; keep waiting for ours
            target = message.get("id")
            if target == request_id:
                return message
            if isinstance(target, str) and target in self._mailbox:
                self._mailbox[target].append(message)

    def _final_for(self, request_id: str, timeout_s: float) -> dict[str, Any]:
        try:
            while True:
                message = self._next_message(request_id, timeout_s)
                if message.get("type") != "token":
                    return _final(message)
        finally:
            self._mailbox.pop(request_id, None)

    def request(self, op: str, fields: dict[str, Any] | None = None, *, timeout_s: float | None = None,
                **more: Any) -> dict[str, Any]:
        """Send one operation (its fields as a dict and/or keywords) and return its result;
        resends when that is safe. `timeout_s` bounds the wait for the reply."""
        fields = {**(fields or {}), **more}
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        attempts = self._retry.attempts(op)
        for attempt in range(attempts):
            request_id = self._ids.next()
            try:
                self._send(request_id, op, fields)
                return self._final_for(request_id, timeout_s)
            except (DaemonUnavailable, RemoteError) as error:
                if isinstance(error, RemoteError):
                    settled = self._retry.settled_by_retry(op, attempt, error)
                    if settled is not None:
                        return settled
                if attempt + 1 >= attempts or not self._retry.may_resend(op, error):
                    if isinstance(error, DaemonUnavailable) and op == "generate":
                        self._cancel_quietly(request_id)
                    raise
                if isinstance(error, DaemonUnavailable):
                    self.reconnect()
                else:
                    time.sleep(min(error.retry_after_s or 0.2, 5.0))
        raise AssertionError("unreachable")

    def _cancel_quietly(self, target: str) -> None:
        """Best effort: stop the daemon's work on a request we no longer wait for."""
        try:
            self._send(self._ids.next(), "cancel", {"target": target}, expect_reply=False)
        except ClientError:
            pass

    # -- operations ---------------------------------------------------------------------------

    def generate(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                 timeout_s: float | None = None, **params: Any) -> GenerateResult:
        """Whole answer(s). `params`: max_tokens, temperature, top_k, top_p, seed, n, stop,
        stop_token_ids, ignore_eos, user, record, adapter, logprobs, presence_penalty,
        frequency_penalty, logit_bias, response_format, tools, tool_choice,
        continue_final_message (docs/protocol.md). The daemon stops the request itself once
        `timeout_s` has passed, since no one waits for it after that."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        fields = _generate_fields(prompt, messages, {"timeout_s": timeout_s, **params})
        return GenerateResult.from_reply(self.request("generate", fields, timeout_s=timeout_s + 1.0))

    def stream(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
               timeout_s: float | None = None, **params: Any) -> TokenStream:
        """Tokens as they are decoded: `for token in stream: ...`; then `stream.result`."""
        fields = _generate_fields(prompt, messages, params)
        fields["stream"] = True
        request_id = self._ids.next()
        self._send(request_id, "generate", fields)
        return TokenStream(self, request_id, self.timeout_s if timeout_s is None else timeout_s)

    def cancel(self, request_id: str) -> bool:
        return bool(self.request("cancel", target=request_id).get("cancelled"))

    def embed(self, texts: str | list[str] | list[int] | list[list[int]]) -> list[list[float]]:
        """Unit-length embeddings of texts (or token-id lists), one per input."""
        return self.request("embed", input=texts)["embeddings"]

    def feedback(self, user: str, interaction_id: str, kind: str, **values: Any) -> dict[str, Any]:
        """Durably stored when this returns. kind: choice (chosen=), thumbs (candidate=, up=),
        rating (candidate=, stars=), edit (candidate=, text=)."""
        return self.request("feedback", _feedback_fields(user, interaction_id, kind, values))

    def choose(self, user: str, interaction_id: str, chosen: int) -> dict[str, Any]:
        return self.feedback(user, interaction_id, "choice", chosen=chosen)

    def thumbs(self, user: str, interaction_id: str, up: bool, candidate: int = 0) -> dict[str, Any]:
        return self.feedback(user, interaction_id, "thumbs", candidate=candidate, up=up)

    def rate(self, user: str, interaction_id: str, stars: int, candidate: int = 0) -> dict[str, Any]:
        return self.feedback(user, interaction_id, "rating", candidate=candidate, stars=stars)

    def edit(self, user: str, interaction_id: str, text: str, candidate: int = 0) -> dict[str, Any]:
        return self.feedback(user, interaction_id, "edit", candidate=candidate, text=text)

    def status(self) -> dict[str, Any]:
        return self.request("status")

    def health(self, timeout_s: float | None = None) -> dict[str, Any]:
        return self.request("health", timeout_s=timeout_s)

    def adapters(self, user: str | None = None) -> list[dict[str, Any]]:
        return self.request("adapters.list", **({"user": user} if user else {}))["adapters"]

    def rollback(self, user: str, version: int) -> dict[str, Any]:
        return self.request("adapters.rollback", user=user, version=version)

    def fleet_publish(self, path: str) -> dict[str, Any]:
        """Publish the PEFT adapter folder at `path` (on the daemon's machine; made absolute here)
        as the fleet adapter's next version."""
        return self.request("fleet.publish", path=os.path.abspath(path))

    def fleet_rollback(self, version: int | None = None) -> dict[str, Any]:
        """Retire the newest fleet version, or every one newer than `version` (0: none)."""
        return self.request("fleet.rollback", **({} if version is None else {"version": version}))

    def fleet_status(self) -> dict[str, Any]:
        return self.request("fleet.status")

    def fleet_round(self, round: int, adapter: dict[str, Any], lora_config: dict[str, Any],
                    config: dict[str, Any] | None = None, *, timeout_s: float | None = None) -> dict[str, Any]:
        """One federated round on this device (docs/protocol.md): `adapter` maps PEFT tensor
        names to numpy arrays (the global fleet adapter), `lora_config` is {"r", "lora_alpha",
        "target_modules"}. The reply's `delta` maps the same names to float32 numpy arrays."""
        reply = self.request("fleet.round", timeout_s=timeout_s, round=round, adapter=tensors_to_wire(adapter),
                             lora_config=lora_config, **({"config": config} if config else {}))
        return {**reply, "delta": tensors_from_wire(reply.get("delta") or {})}

    def fleet_evaluate(self, adapter: dict[str, Any], lora_config: dict[str, Any],
                       config: dict[str, Any] | None = None, *, timeout_s: float | None = None) -> dict[str, Any]:
        """Held-out win rate and margin of a candidate fleet adapter on this device's pairs."""
        return self.request("fleet.evaluate", timeout_s=timeout_s, adapter=tensors_to_wire(adapter),
                            lora_config=lora_config, **({"config": config} if config else {}))

    def consent(self, user: str, granted: bool | None = True, fleet: bool | None = None) -> dict[str, Any]:
        """Set consent to feedback collection and/or to fleet training (None: leave it); the reply
        holds both as they now stand."""
        return self.request("users.consent", user=user, **_consents(granted, fleet))

    def export(self, user: str) -> dict[str, Any]:
        return self.request("users.export", user=user)["data"]

    def forget(self, user: str) -> dict[str, Any]:
        return self.request("users.forget", user=user)["erased"]


class TokenStream:
    """Iterator over a streamed generate's tokens; `result` is set once it is exhausted."""

    def __init__(self, client: Client, request_id: str, timeout_s: float) -> None:
        self.client = client
        self.request_id = request_id
        self.timeout_s = timeout_s
        self.result: GenerateResult | None = None
        self._done = False

    def __iter__(self) -> Iterator[Token]:
        try:
            while not self._done:
                message = self.client._next_message(self.request_id, self.timeout_s)
                if message.get("type") == "token":
                    yield _token(message)
                    continue
                self._done = True
                self.result = GenerateResult.from_reply(_final(message))
        finally:
            if not self._done:  # abandoned early (break, exception): stop the daemon's work too
                self._done = True
                self.client._cancel_quietly(self.request_id)
            self.client._mailbox.pop(self.request_id, None)

    def text(self) -> str:
        """Consume the stream; the whole text of candidate 0."""
        return "".join(t.text for t in self if t.index == 0)

    def cancel(self) -> bool:
        if self._done:
            return False
        return self.client.cancel(self.request_id)


# -- asyncio client -------------------------------------------------------------------------------


class AsyncClient:
    """asyncio client: many concurrent requests over one socket, demultiplexed by id."""

    def __init__(self, endpoint: str | None = None, *, timeout_s: float = 120.0,
                 connect_timeout_s: float = 5.0, retries: int = 2,
                 curve_server_key: bytes | None = None,
                 curve_client_keys: tuple[bytes, bytes] | None = None,
                 context: zmq.asyncio.Context | None = None) -> None:
        self.endpoint = endpoint or default_client_endpoint()
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._retry = _Retrying(retries)
        self._curve = (curve_server_key, curve_client_keys)
        self._context = context or zmq.asyncio.Context.instance()
        self._ids = _Ids()
        self._queues: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None

    def _connect(self) -> None:
        sock = self._context.socket(zmq.DEALER)
        _configure(sock, self.connect_timeout_s, *self._curve)
        sock.connect(self.endpoint)
        self._sock = sock
        self._reader = asyncio.get_running_loop().create_task(self._read(sock))

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frame = await sock.recv()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            try:
                message = decode(frame)
            except ProtocolError:
                continue
            target = message.get("id")
            queue = self._queues.get(target) if isinstance(target, str) else None
            if queue is not None:
                queue.put_nowait(message)

    async def reconnect(self) -> None:
        await self.close()
        for queue in self._queues.values():  # nothing more will arrive for these
            queue.put_nowait({"type": "_lost"})
        self._connect()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _send(self, request_id: str, op: str, fields: dict[str, Any],
                    expect_reply: bool = True) -> asyncio.Queue[dict[str, Any]]:
        if self._sock is None:
            self._connect()
        assert self._sock is not None
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        if expect_reply:
            self._queues[request_id] = queue
        try:
            await self._sock.send(encode({"v": PROTOCOL_VERSION, "id": request_id, "op": op, **fields}))
        except zmq.Again:
            self._queues.pop(request_id, None)
            raise DaemonUnavailable(f"cannot reach the daemon at {self.endpoint} (is maced running?)") from None
        return queue

    async def _next(self, queue: asyncio.Queue[dict[str, Any]], timeout_s: float) -> dict[str, Any]:
        try:
            message = await asyncio.wait_for(queue.get(), timeout_s)
        except asyncio.TimeoutError:
            raise DaemonUnavailable(f"no reply from the daemon at {self.endpoint} within {timeout_s:g} s") from None
        if message.get("type") == "_lost":
            raise DaemonUnavailable("the connection was reset while waiting for this reply")
        return message

    async def request(self, op: str, fields: dict[str, Any] | None = None, *,
                      timeout_s: float | None = None, **more: Any) -> dict[str, Any]:
        """See `Client.request`."""
        fields = {**(fields or {}), **more}
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        attempts = self._retry.attempts(op)
        for attempt in range(attempts):
            request_id = self._ids.next()
            try:
                queue = await self._send(request_id, op, fields)
                while True:
                    message = await self._next(queue, timeout_s)
                    if message.get("type") != "token":
                        return _final(message)
            except (DaemonUnavailable, RemoteError) as error:
                if isinstance(error, RemoteError):
                    settled = self._retry.settled_by_retry(op, attempt, error)
                    if settled is not None:
                        return settled
                if attempt + 1 >= attempts or not self._retry.may_resend(op, error):
                    raise
                if isinstance(error, DaemonUnavailable):
                    await self.reconnect()
                else:
                    await asyncio.sleep(min(error.retry_after_s or 0.2, 5.0))
            finally:
                self._queues.pop(request_id, None)
        raise AssertionError("unreachable")

    async def generate(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                       timeout_s: float | None = None, **params: Any) -> GenerateResult:
        """See `Client.generate`."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        fields = _generate_fields(prompt, messages, {"timeout_s": timeout_s, **params})
        return GenerateResult.from_reply(await self.request("generate", fields, timeout_s=timeout_s + 1.0))

    async def stream(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                     timeout_s: float | None = None, **params: Any) -> AsyncTokenStream:
        fields = _generate_fields(prompt, messages, params)
        fields["stream"] = True
        request_id = self._ids.next()
        queue = await self._send(request_id, "generate", fields)
        return AsyncTokenStream(self, request_id, queue, self.timeout_s if timeout_s is None else timeout_s)

    async def cancel(self, request_id: str) -> bool:
        return bool((await self.request("cancel", target=request_id)).get("cancelled"))

    async def embed(self, texts: str | list[str] | list[int] | list[list[int]]) -> list[list[float]]:
        """See `Client.embed`."""
        return (await self.request("embed", input=texts))["embeddings"]

    async def feedback(self, user: str, interaction_id: str, kind: str, **values: Any) -> dict[str, Any]:
        return await self.request("feedback", _feedback_fields(user, interaction_id, kind, values))

    async def choose(self, user: str, interaction_id: str, chosen: int) -> dict[str, Any]:
        return await self.feedback(user, interaction_id, "choice", chosen=chosen)

    async def status(self) -> dict[str, Any]:
        return await self.request("status")

    async def health(self, timeout_s: float | None = None) -> dict[str, Any]:
        return await self.request("health", timeout_s=timeout_s)

    async def adapters(self, user: str | None = None) -> list[dict[str, Any]]:
        return (await self.request("adapters.list", **({"user": user} if user else {})))["adapters"]

    async def consent(self, user: str, granted: bool | None = True, fleet: bool | None = None) -> dict[str, Any]:
        return await self.request("users.consent", user=user, **_consents(granted, fleet))

    async def fleet_publish(self, path: str) -> dict[str, Any]:
        return await self.request("fleet.publish", path=os.path.abspath(path))

    async def fleet_rollback(self, version: int | None = None) -> dict[str, Any]:
        return await self.request("fleet.rollback", **({} if version is None else {"version": version}))

    async def fleet_status(self) -> dict[str, Any]:
        return await self.request("fleet.status")

    async def fleet_round(self, round: int, adapter: dict[str, Any], lora_config: dict[str, Any],
                          config: dict[str, Any] | None = None, *, timeout_s: float | None = None) -> dict[str, Any]:
        """See `Client.fleet_round`."""
        reply = await self.request("fleet.round", timeout_s=timeout_s, round=round,
                                   adapter=tensors_to_wire(adapter), lora_config=lora_config,
                                   **({"config": config} if config else {}))
        return {**reply, "delta": tensors_from_wire(reply.get("delta") or {})}

    async def fleet_evaluate(self, adapter: dict[str, Any], lora_config: dict[str, Any],
                             config: dict[str, Any] | None = None, *,
                             timeout_s: float | None = None) -> dict[str, Any]:
        """See `Client.fleet_evaluate`."""
        return await self.request("fleet.evaluate", timeout_s=timeout_s, adapter=tensors_to_wire(adapter),
                                  lora_config=lora_config, **({"config": config} if config else {}))

    async def export(self, user: str) -> dict[str, Any]:
        return (await self.request("users.export", user=user))["data"]

    async def forget(self, user: str) -> dict[str, Any]:
        return (await self.request("users.forget", user=user))["erased"]


class AsyncTokenStream:
    """`async for token in stream: ...`; `result` is set once it is exhausted."""

    def __init__(self, client: AsyncClient, request_id: str, queue: asyncio.Queue[dict[str, Any]],
                 timeout_s: float) -> None:
        self.client = client
        self.request_id = request_id
        self.queue = queue
        self.timeout_s = timeout_s
        self.result: GenerateResult | None = None
        self._done = False

    def __aiter__(self) -> AsyncIterator[Token]:
        return self._tokens()

    async def _tokens(self) -> AsyncIterator[Token]:
        try:
            while not self._done:
                message = await self.client._next(self.queue, self.timeout_s)
                if message.get("type") == "token":
                    yield _token(message)
                    continue
                self._done = True
                self.result = GenerateResult.from_reply(_final(message))
        finally:
            self.client._queues.pop(self.request_id, None)
            if not self._done:
                self._done = True
                try:
                    await self.client._send(self.client._ids.next(), "cancel", {"target": self.request_id},
                                            expect_reply=False)
                except ClientError:
                    pass

    async def text(self) -> str:
        return "".join([t.text async for t in self if t.index == 0])

    async def cancel(self) -> bool:
        if self._done:
            return False
        return await self.client.cancel(self.request_id)


def _consents(granted: bool | None, fleet: bool | None) -> dict[str, bool]:
    """The fields of `users.consent`: only the consents being set, so old daemons (no `fleet`)
    keep answering calls that do not use it."""
    return {k: v for k, v in (("granted", granted), ("fleet", fleet)) if v is not None}

