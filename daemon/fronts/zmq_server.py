"""The ZeroMQ front: ROUTER sockets (ipc and/or TCP, CURVE for TCP beyond loopback), frame
checks, dispatch to the service, and exactly one final reply per request.

Never trusts a frame: anything malformed gets a typed error when it has a reply address, and is
logged and dropped otherwise. Sends never block: a client that stops reading loses its requests.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from daemon.config import DaemonConfig
from daemon.principals import DEFAULT_APP, Principal, peer_uid
from daemon.service import GenerateCall, Service
from daemon.wire import (
    TENSOR_OPS,
    ProtocolError,
    Request,
    decode,
    encode,
    error_from,
    error_message,
    parse_request,
    reply_envelope,
    request_id_of,
    result_message,
    split_envelope,
    token_message,
)
from daemon.wire.endpoints import prepare_ipc_dir
from edge_runtime.errors import AdmissionRejected, MaceError

log = logging.getLogger(__name__)

ClientKey = tuple[int, bytes]  # (listener index, ZeroMQ routing id)
# Ops still answered while the daemon drains (they change nothing that shutdown must protect).
_DRAIN_OPS = frozenset({"status", "health", "cancel", "feedback", "users.consent", "users.export",
                        "adapters.list"})


@dataclass
class Listener:
    endpoint: str
    socket: zmq.asyncio.Socket
    ipc_path: str | None = None
    curve: bool = False


@dataclass(eq=False)
class InFlight:
    """One request between its arrival and its final reply."""

    client: ClientKey
    envelope: list[bytes]
    request: Request
    principal: Principal
    call: GenerateCall | None = None
    final_sent: bool = False
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class Server:
    def __init__(self, config: DaemonConfig, service: Service, context: zmq.asyncio.Context) -> None:
        self.config = config
        self.service = service
        self.context = context
        self.listeners: list[Listener] = []
        self.inflight: dict[tuple[ClientKey, Any], InFlight] = {}
        self.per_client: Counter[ClientKey] = Counter()
        self.stats: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self._auth: Any = None
        self._closing = False

    # -- sockets --------------------------------------------------------------------------------

    def bind(self) -> list[str]:
        """Bind every configured endpoint; returns them (TCP with the real port if it was 0)."""
        cfg = self.config
        if cfg.ipc_path is not None:
            path = cfg.ipc_path
            prepare_ipc_dir(path)
            if path.exists() or path.is_symlink():
                path.unlink()  # a stale socket from a crash; libzmq would fail or steal it
            sock = self._socket(curve=False)
            sock.bind(f"ipc://{path}")
            os.chmod(path, cfg.ipc_mode)
            self.listeners.append(Listener(f"ipc://{path}", sock, str(path)))
        if cfg.server.tcp:
            sock = self._socket(curve=cfg.curve_enabled)
            sock.bind(cfg.server.tcp)
            endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self.listeners.append(Listener(endpoint, sock, curve=cfg.curve_enabled))
        return [listener.endpoint for listener in self.listeners]

    def _socket(self, curve: bool) -> zmq.asyncio.Socket:
        s = self.config.server
        sock = self.context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable replies raise instead of vanishing
        sock.setsockopt(zmq.SNDHWM, s.send_hwm)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        # libzmq drops (and disconnects) a peer sending frames far beyond the limit, before they
        # are buffered whole; frames between the two limits get a `too_large` reply.
        limit = self.config.max_frame_bytes
        sock.setsockopt(zmq.MAXMSGSIZE, max(4 * limit, limit + (64 << 10)))
        sock.setsockopt(zmq.LINGER, 1000)
        if curve:
            public, secret = _load_server_keys(self.config.server.curve_secret_key)
            self._start_auth()
            sock.curve_secretkey = secret
            sock.curve_publickey = public
            sock.curve_server = True
        return sock

    def _start_auth(self) -> None:
        if self._auth is not None:
            return
        from zmq.auth.asyncio import AsyncioAuthenticator

        folder = Path(self.config.server.curve_authorized_keys).expanduser()
        if not folder.is_dir():
            # Like a missing server key: a daemon that would admit no one must not start.
            raise ValueError(f"server.curve_authorized_keys {folder} is not a folder of client public keys")
        if not any(folder.glob("*.key")):
            log.warning("server.curve_authorized_keys %s holds no client key (*.key): no client can connect "
                        "over TCP until one is added and the daemon restarted", folder)
        self._auth = AsyncioAuthenticator(self.context)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=self.config.server.curve_authorized_keys)

    async def serve(self) -> None:
        await asyncio.gather(*(self._receive(i, listener) for i, listener in enumerate(self.listeners)))

    async def close(self) -> None:
        """Answer whatever is still open, then close the sockets (lingering so replies go out)."""
        self._closing = True
        for item in list(self.inflight.values()):
            if item.task is not None and not item.task.done():
                item.task.cancel()
        await asyncio.sleep(0)
        for item in list(self.inflight.values()):
            self._final(item, error_message(item.request.id, "shutting_down", "the daemon stopped"))
        for listener in self.listeners:
            listener.socket.close(linger=1000)
            if listener.ipc_path:
                try:
                    os.unlink(listener.ipc_path)
                except FileNotFoundError:
                    pass
        if self._auth is not None:
            self._auth.stop()

    # -- receiving ------------------------------------------------------------------------------

    async def _receive(self, index: int, listener: Listener) -> None:
        sock = listener.socket
        while not self._closing:
            try:
                # Frames, not bytes: an oversized body is measured and refused without a copy.
                frames = await sock.recv_multipart(copy=False)
            except zmq.ZMQError as exc:
                if self._closing or exc.errno in (zmq.ENOTSOCK, zmq.ETERM):
                    return
                log.warning("receive failed on %s: %s", listener.endpoint, exc)
                continue
            except asyncio.CancelledError:
                return
            try:
                self._handle(index, frames)
            except Exception:  # a bug in handling one message must not stop the receive loop
                self.errors["internal"] += 1
                log.exception("handling a message failed")
            # A receive that finds a message already queued does not yield to the event loop;
            # without this, a flood from one client would starve replies to everyone else.
            await asyncio.sleep(0)

    def _handle(self, index: int, parts: list[zmq.Frame]) -> None:
        self.stats["received"] += 1
        limit = self.config.max_frame_bytes
        identity = parts[0].bytes if parts else b""
        client: ClientKey = (index, identity)
        # Measure before copying: an oversized body is refused without ever being copied.
        oversized = max((len(part) for part in parts[1:]), default=0)
        if oversized > limit:
            self._reject(client, reply_envelope([identity, *parts[1:]]), None, ProtocolError(
                "too_large", f"frame of {oversized} bytes exceeds the limit of {limit}"))
            return
        frames = [part.bytes for part in parts]
        try:
            envelope, body = split_envelope(frames)
        except ProtocolError as exc:
            self._reject(client, reply_envelope(frames), None, exc)
            return
        try:
            message = decode(body, limit)
        except ProtocolError as exc:
            self._reject(client, envelope, None, exc)
            return
        request_id = request_id_of(message)
        small = self.config.server.max_message_bytes
        if len(body) > small and message.get("op") not in TENSOR_OPS:
            self._reject(client, envelope, request_id, ProtocolError(
                "too_large", f"frame of {len(body)} bytes exceeds the limit of {small}"))
            return
        try:
            request = parse_request(message)
        except ProtocolError as exc:
            self._reject(client, envelope, request_id, exc)
            return
        key = (client, request.id)
        s = self.config.server
        if key in self.inflight:
            self._reject(client, envelope, request.id, ProtocolError(
                "duplicate_id", f"request id {request.id!r} is already in flight on this connection"))
            return
        if self.per_client[client] >= s.max_inflight_per_client or len(self.inflight) >= s.max_inflight:
            self._reject(client, envelope, request.id, ProtocolError(
                "busy", f"too many requests in flight (at most {s.max_inflight_per_client} per client, "
                f"{s.max_inflight} in all); wait for replies", retry_after_s=0.5))
            return
        if self.service.state == "draining" and request.op not in _DRAIN_OPS:
            self._reject(client, envelope, request.id, ProtocolError(
                "shutting_down", "the daemon is shutting down and admits no new work"))
            return
        item = InFlight(client, envelope, request, self._principal(self.listeners[index], parts[-1]))
        self.inflight[key] = item
        self.per_client[client] += 1
        item.task = asyncio.create_task(self._run(item), name=f"{request.op}:{request.id}")

    def _principal(self, listener: Listener, frame: zmq.Frame) -> Principal:
        """Who sent a message, from what libzmq knows of its connection (never from the
        message): an ipc peer's uid (SO_PEERCRED), a CURVE client's public key (the ZAP
        handler's User-Id); a TCP client without CURVE is the default app."""
        identities = self.service.identities
        if listener.ipc_path is not None:
            uid = peer_uid(_metadata(frame, "Peer-Address"))
            if uid is None:  # libzmq built without SO_PEERCRED: no one is the operator
                return Principal("app", DEFAULT_APP, "ipc peer of unknown uid")
            return identities.for_uid(uid)
        if listener.curve:
            return identities.for_curve_key(_metadata(frame, "User-Id"))
        return Principal("app", DEFAULT_APP, "TCP without CURVE")

    def _reject(self, client: ClientKey, envelope: list[bytes], request_id: Any, exc: ProtocolError) -> None:
        self.errors[exc.code] += 1
        if not client[1]:
            log.debug("dropping a frame without a reply address: %s", exc.message)
            return
        self._send(client, envelope, error_from(request_id, exc))

    # -- running --------------------------------------------------------------------------------

    async def _run(self, item: InFlight) -> None:
        request = item.request
        try:
            result = await self._dispatch(item)
        except ProtocolError as exc:
            reply = error_from(request.id, exc)
        except AdmissionRejected as exc:
            reply = error_message(request.id, exc.code, str(exc), retry_after_s=exc.retry_after_s)
        except MaceError as exc:
            reply = error_message(request.id, exc.code, str(exc), param=getattr(exc, "param", None))
        except asyncio.CancelledError:
            reply = error_message(request.id, "shutting_down", "the daemon stopped before answering")
            self._final(item, reply)
            raise
        except Exception as exc:
            log.exception("op %s failed", request.op)
            reply = error_message(request.id, "internal", f"{type(exc).__name__}: {exc}")
        else:
            reply = result_message(request.id, result)
        self._final(item, reply)

    async def _dispatch(self, item: InFlight) -> dict[str, Any]:
        request, service, args = item.request, self.service, item.request.args
        op = request.op
        if op == "generate":
            on_token = None
            if args.stream:
                def on_token(index: int, text: str, token_id: int | None, extra: dict | None = None) -> None:
                    if not item.final_sent:
                        self._send(item.client, item.envelope, token_message(request.id, index, text, token_id, extra))
            item.call = GenerateCall(on_token, client=item.client, principal=item.principal)
            return await service.generate(args, item.call)
        if op == "cancel":
            target = self.inflight.get((item.client, args.target))
            if target is None or target.call is None:
                return {"cancelled": False, "target": args.target}
            service.cancel(target.call, "cancelled")
            return {"cancelled": True, "target": args.target}
        if op == "status":
            status = await service.status(item.principal)
            status["daemon"]["endpoints"] = [listener.endpoint for listener in self.listeners]
            status["server"] = self.summary()
            return status
        if op == "health":
            return service.health()
        if op == "embed":
            return await service.embed(args)
        users = service.users
        handlers = {
            "feedback": users.feedback, "users.consent": users.consent, "users.export": users.export,
            "users.forget": users.forget, "adapters.list": users.adapters_list,
            "adapters.rollback": users.adapters_rollback, "fleet.publish": service.fleet_publish,
            "fleet.rollback": service.fleet_rollback, "fleet.status": service.fleet_status,
            "fleet.round": service.fleet_round, "fleet.evaluate": service.fleet_evaluate,
        }
        return await handlers[op](args, item.principal)

    def summary(self) -> dict[str, Any]:
        return {"requests_in_flight": len(self.inflight), "clients": len(self.per_client),
                "messages": dict(self.stats), "errors": dict(self.errors)}

    def _final(self, item: InFlight, reply: dict[str, Any]) -> None:
        """Send the one final reply of a request and forget it (later attempts do nothing)."""
        if item.final_sent:
            return
        item.final_sent = True
        key = (item.client, item.request.id)
        if self.inflight.get(key) is item:
            del self.inflight[key]
            self.per_client[item.client] -= 1
            if self.per_client[item.client] <= 0:
                del self.per_client[item.client]
        if reply.get("type") == "error":
            self.errors[reply["error"]["code"]] += 1
        self._send(item.client, item.envelope, reply)

    def _send(self, client: ClientKey, envelope: list[bytes], message: dict[str, Any]) -> None:
        if self._closing and not self.listeners:
            return
        listener = self.listeners[client[0]]
        try:
            frame = encode(message)
        except (TypeError, ValueError, OverflowError) as exc:
            log.error("reply to %s could not be encoded (%s); sending an internal error", message.get("id"), exc)
            frame = encode(error_message(message.get("id"), "internal", "the reply could not be encoded"))
        try:
            future = listener.socket.send_multipart([*envelope, frame], flags=zmq.DONTWAIT, copy=False)
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
        except zmq.Again:
            self._drop_client(client, "is not reading its replies (send queue full)")
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                self._drop_client(client, "disconnected")
            elif exc.errno != zmq.ENOTSOCK:
                log.warning("send failed: %s", exc)
        else:
            self.stats["sent"] += 1

    def _drop_client(self, client: ClientKey, why: str) -> None:
        """A client that is gone or not reading: stop its generations (no one will read them)."""
        self.stats["clients_dropped"] += 1
        items = [i for (c, _), i in self.inflight.items() if c == client]
        if items:
            log.info("client %s %s; cancelling its %d request(s)", client[1].hex(), why, len(items))
        for item in items:
            if item.call is not None:
                self.service.cancel(item.call, "client_gone")


def _metadata(frame: zmq.Frame, name: str) -> str:
    """A connection property libzmq attached to a received frame, or "" when it has none."""
    try:
        value = frame.get(name)
    except zmq.ZMQError:
        return ""
    return value if isinstance(value, str) else ""


def _load_server_keys(path: str) -> tuple[bytes, bytes]:
    import zmq.auth

    public, secret = zmq.auth.load_certificate(path)
    if not secret:
        raise ValueError(f"{path} holds no secret key; give the server's .key_secret certificate")
    return public, secret
