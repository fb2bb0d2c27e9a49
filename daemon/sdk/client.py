"""The blocking client of `maced`: one DEALER socket, replies filed by request id, safe resends of
idempotent operations, and `TokenStream` for streamed generations. What each operation sends and
how its result reads is `daemon.sdk.ops`; this module only waits.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import zmq

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
        self._retry = Retrying(retries)
        self._curve = (curve_server_key, curve_client_keys)
        self._context = context or zmq.Context.instance()
        self._ids = Ids()
        self._mailbox: dict[str, deque[dict[str, Any]]] = {}
        self._sock: zmq.Socket | None = None
        self._connect()

    def _connect(self) -> None:
        sock = self._context.socket(zmq.DEALER)
        configure(sock, self.connect_timeout_s, *self._curve)
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
                    return read_final(message)
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

    def call(self, call: ops.Call) -> Any:
        """Send one operation of `daemon.sdk.ops` and read its result."""
        return call.read(self.request(call.op, call.fields, timeout_s=call.timeout_s))

    # -- operations (daemon.sdk.ops says what each sends) ---------------------------------------

    def generate(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                 timeout_s: float | None = None, **params: Any) -> GenerateResult:
        """Whole answer(s). `params`: max_tokens, temperature, top_k, top_p, seed, n, stop,
        stop_token_ids, ignore_eos, user, record, adapter, logprobs, presence_penalty,
        frequency_penalty, logit_bias, response_format, tools, tool_choice,
        continue_final_message, thinking, speculation (docs/protocol.md). The daemon stops the request itself once
        `timeout_s` has passed, since no one waits for it after that."""
        return self.call(ops.generate(prompt, messages, self.timeout_s if timeout_s is None else timeout_s, params))

    def stream(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
               timeout_s: float | None = None, **params: Any) -> TokenStream:
        """Tokens as they are decoded: `for token in stream: ...`; then `stream.result`."""
        request_id = self._ids.next()
        self._send(request_id, "generate", ops.stream_fields(prompt, messages, params))
        return TokenStream(self, request_id, self.timeout_s if timeout_s is None else timeout_s)

    def cancel(self, request_id: str) -> bool:
        return self.call(ops.cancel(request_id))

    def embed(self, texts: str | list[str] | list[int] | list[list[int]]) -> list[list[float]]:
        """Unit-length embeddings of texts (or token-id lists), one per input."""
        return self.call(ops.embed(texts))

    def feedback(self, user: str, interaction_id: str, kind: str, **values: Any) -> dict[str, Any]:
        """Durably stored when this returns. kind: choice (chosen=), thumbs (candidate=, up=),
        rating (candidate=, stars=), edit (candidate=, text=)."""
        return self.call(ops.feedback(user, interaction_id, kind, values))

    def choose(self, user: str, interaction_id: str, chosen: int) -> dict[str, Any]:
        return self.call(ops.choose(user, interaction_id, chosen))

    def thumbs(self, user: str, interaction_id: str, up: bool, candidate: int = 0) -> dict[str, Any]:
        return self.call(ops.thumbs(user, interaction_id, up, candidate))

    def rate(self, user: str, interaction_id: str, stars: int, candidate: int = 0) -> dict[str, Any]:
        return self.call(ops.rate(user, interaction_id, stars, candidate))

    def edit(self, user: str, interaction_id: str, text: str, candidate: int = 0) -> dict[str, Any]:
        return self.call(ops.edit(user, interaction_id, text, candidate))

    def status(self) -> dict[str, Any]:
        return self.call(ops.status())

    def health(self, timeout_s: float | None = None) -> dict[str, Any]:
        return self.call(ops.health(timeout_s))

    def adapters(self, user: str | None = None, app: str | None = None) -> list[dict[str, Any]]:
        """Adapter versions of `user` (None: all of the caller's users); `app`: the operator's
        view of another app's users (docs/security.md)."""
        return self.call(ops.adapters(user, app))

    def rollback(self, user: str, version: int, app: str | None = None) -> dict[str, Any]:
        return self.call(ops.rollback(user, version, app))

    def fleet_publish(self, path: str, operator_key: str | None = None, *, run_id: str | None = None,
                      round: int | None = None) -> dict[str, Any]:
        """Publish the PEFT adapter folder at `path` (on the daemon's machine, inside its
        fleet.publish_dir; made absolute here) as the fleet adapter's next version. The
        operator's: `operator_key` is the daemon's `<state>/fleet/operator.key`. With an
        aggregator's `run_id` and `round`, a round at or below that run's last published one is
        refused (a replay)."""
        return self.call(ops.fleet_publish(path, operator_key, run_id=run_id, round=round))

    def fleet_rollback(self, version: int | None = None, operator_key: str | None = None) -> dict[str, Any]:
        """Retire the newest fleet version, or every one newer than `version` (0: none); the operator's."""
        return self.call(ops.fleet_rollback(version, operator_key))

    def fleet_status(self) -> dict[str, Any]:
        return self.call(ops.fleet_status())

    def fleet_round(self, round: int, adapter: dict[str, Any], lora_config: dict[str, Any],
                    config: dict[str, Any] | None = None, *, timeout_s: float | None = None) -> dict[str, Any]:
        """One federated round on this device (docs/protocol.md): `adapter` maps PEFT tensor
        names to numpy arrays (the global fleet adapter), `lora_config` is {"r", "lora_alpha",
        "target_modules"}. The reply's `delta` maps the same names to float32 numpy arrays."""
        return self.call(ops.fleet_round(round, adapter, lora_config, config, timeout_s))

    def fleet_evaluate(self, adapter: dict[str, Any], lora_config: dict[str, Any],
                       config: dict[str, Any] | None = None, *, timeout_s: float | None = None) -> dict[str, Any]:
        """Held-out win rate and margin of a candidate fleet adapter on this device's pairs."""
        return self.call(ops.fleet_evaluate(adapter, lora_config, config, timeout_s))

    def consent(self, user: str, granted: bool | None = True, fleet: bool | None = None,
                app: str | None = None) -> dict[str, Any]:
        """Set consent to feedback collection and/or to fleet training (None: leave it); the reply
        holds both as they now stand."""
        return self.call(ops.consent(user, granted, fleet, app))

    def export(self, user: str, app: str | None = None) -> dict[str, Any]:
        return self.call(ops.export(user, app))

    def forget(self, user: str, app: str | None = None) -> dict[str, Any]:
        return self.call(ops.forget(user, app))


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
                    yield read_token(message)
                    continue
                self._done = True
                self.result = GenerateResult.from_reply(read_final(message))
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


