"""The asyncio client of `maced`: many concurrent requests over one DEALER socket, demultiplexed
by id, and `AsyncTokenStream`. It offers the same operations as `Client` (daemon.sdk.ops builds
and reads every message; tests/daemon/test_sdk_parity.py checks the two agree).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from daemon.sdk import ops
from daemon.sdk.connection import Ids, Retrying, configure
from daemon.sdk.results import (
    ClientError,
    DaemonUnavailable,
    GenerateResult,
    RemoteError,
    Token,
    read_final,
    read_token,
)
from daemon.wire import PROTOCOL_VERSION, ProtocolError, decode, encode
from daemon.wire.endpoints import default_client_endpoint


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
        self._retry = Retrying(retries)
        self._curve = (curve_server_key, curve_client_keys)
        self._context = context or zmq.asyncio.Context.instance()
        self._ids = Ids()
        self._queues: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None

    def _connect(self) -> None:
        sock = self._context.socket(zmq.DEALER)
        configure(sock, self.connect_timeout_s, *self._curve)
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
                        return read_final(message)
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

    async def call(self, call: ops.Call) -> Any:
        """Send one operation of `daemon.sdk.ops` and read its result."""
        return call.read(await self.request(call.op, call.fields, timeout_s=call.timeout_s))

    # -- operations (daemon.sdk.ops says what each sends) ---------------------------------------

    async def generate(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                       timeout_s: float | None = None, **params: Any) -> GenerateResult:
        """Whole answer(s). `params`: max_tokens, temperature, top_k, top_p, seed, n, stop,
        stop_token_ids, ignore_eos, user, record, adapter, logprobs, presence_penalty,
        frequency_penalty, logit_bias, response_format, tools, tool_choice,
        continue_final_message, thinking (docs/protocol.md). The daemon stops the request itself once
        `timeout_s` has passed, since no one waits for it after that."""
        return await self.call(ops.generate(prompt, messages, self.timeout_s if timeout_s is None else timeout_s, params))

    async def stream(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                     timeout_s: float | None = None, **params: Any) -> AsyncTokenStream:
        """Tokens as they are decoded: `async for token in stream: ...`; then `stream.result`."""
        request_id = self._ids.next()
        queue = await self._send(request_id, "generate", ops.stream_fields(prompt, messages, params))
        return AsyncTokenStream(self, request_id, queue, self.timeout_s if timeout_s is None else timeout_s)

    async def cancel(self, request_id: str) -> bool:
        return await self.call(ops.cancel(request_id))

    async def embed(self, texts: str | list[str] | list[int] | list[list[int]]) -> list[list[float]]:
        """Unit-length embeddings of texts (or token-id lists), one per input."""
        return await self.call(ops.embed(texts))

    async def feedback(self, user: str, interaction_id: str, kind: str, **values: Any) -> dict[str, Any]:
        """Durably stored when this returns. kind: choice (chosen=), thumbs (candidate=, up=),
        rating (candidate=, stars=), edit (candidate=, text=)."""
        return await self.call(ops.feedback(user, interaction_id, kind, values))

    async def choose(self, user: str, interaction_id: str, chosen: int) -> dict[str, Any]:
        return await self.call(ops.choose(user, interaction_id, chosen))

    async def thumbs(self, user: str, interaction_id: str, up: bool, candidate: int = 0) -> dict[str, Any]:
        return await self.call(ops.thumbs(user, interaction_id, up, candidate))

    async def rate(self, user: str, interaction_id: str, stars: int, candidate: int = 0) -> dict[str, Any]:
        return await self.call(ops.rate(user, interaction_id, stars, candidate))

    async def edit(self, user: str, interaction_id: str, text: str, candidate: int = 0) -> dict[str, Any]:
        return await self.call(ops.edit(user, interaction_id, text, candidate))

    async def status(self) -> dict[str, Any]:
        return await self.call(ops.status())

    async def health(self, timeout_s: float | None = None) -> dict[str, Any]:
        return await self.call(ops.health(timeout_s))

    async def adapters(self, user: str | None = None, app: str | None = None) -> list[dict[str, Any]]:
        """Adapter versions of `user` (None: all of the caller's users); `app`: the operator's
        view of another app's users (docs/security.md)."""
        return await self.call(ops.adapters(user, app))

    async def rollback(self, user: str, version: int, app: str | None = None) -> dict[str, Any]:
        return await self.call(ops.rollback(user, version, app))

    async def fleet_publish(self, path: str, operator_key: str | None = None, *, run_id: str | None = None,
                      round: int | None = None) -> dict[str, Any]:
        """Publish the PEFT adapter folder at `path` (on the daemon's machine, inside its
        fleet.publish_dir; made absolute here) as the fleet adapter's next version. The
        operator's: `operator_key` is the daemon's `<state>/fleet/operator.key`. With an
        aggregator's `run_id` and `round`, a round at or below that run's last published one is
        refused (a replay)."""
        return await self.call(ops.fleet_publish(path, operator_key, run_id=run_id, round=round))

    async def fleet_rollback(self, version: int | None = None, operator_key: str | None = None) -> dict[str, Any]:
        """Retire the newest fleet version, or every one newer than `version` (0: none); the operator's."""
        return await self.call(ops.fleet_rollback(version, operator_key))

    async def fleet_status(self) -> dict[str, Any]:
        return await self.call(ops.fleet_status())

    async def fleet_round(self, round: int, adapter: dict[str, Any], lora_config: dict[str, Any],
                          config: dict[str, Any] | None = None, *, timeout_s: float | None = None) -> dict[str, Any]:
        """One federated round on this device (docs/protocol.md): `adapter` maps PEFT tensor
        names to numpy arrays (the global fleet adapter), `lora_config` is {"r", "lora_alpha",
        "target_modules"}. The reply's `delta` maps the same names to float32 numpy arrays."""
        return await self.call(ops.fleet_round(round, adapter, lora_config, config, timeout_s))

    async def fleet_evaluate(self, adapter: dict[str, Any], lora_config: dict[str, Any],
                             config: dict[str, Any] | None = None, *, timeout_s: float | None = None) -> dict[str, Any]:
        """Held-out win rate and margin of a candidate fleet adapter on this device's pairs."""
        return await self.call(ops.fleet_evaluate(adapter, lora_config, config, timeout_s))

    async def consent(self, user: str, granted: bool | None = True, fleet: bool | None = None,
                      app: str | None = None) -> dict[str, Any]:
        """Set consent to feedback collection and/or to fleet training (None: leave it); the reply
        holds both as they now stand."""
        return await self.call(ops.consent(user, granted, fleet, app))

    async def export(self, user: str, app: str | None = None) -> dict[str, Any]:
        return await self.call(ops.export(user, app))

    async def forget(self, user: str, app: str | None = None) -> dict[str, Any]:
        return await self.call(ops.forget(user, app))


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
                    yield read_token(message)
                    continue
                self._done = True
                self.result = GenerateResult.from_reply(read_final(message))
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
