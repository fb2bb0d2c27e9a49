"""The HTTP gateway's app and server: the routes over the handlers, CORS for browser apps, and uvicorn
serving them on the daemon's own event loop from a socket bound before the model loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route

from daemon.config import DaemonConfig
from daemon.fronts.http.connections import AcceptErrorFilter, ConnectionBook, GuardedH11
from daemon.fronts.http.guard import LOOPBACK_NAMES, BrowserGuard, origin_rule
from daemon.fronts.http.handlers import Gateway
from daemon.fronts.http.responses_api import ResponsesApi
from daemon.limits import http_connection_cap
from daemon.service import Service
from daemon.wire.endpoints import is_loopback

LISTEN_BACKLOG = 2048  # connections the kernel queues before maced accepts them
# Connections accepted per wake-up of the event loop: between two batches the loop reads the
# requests of those already accepted, so a flood of new sockets cannot push a working client's
# connection to the front of the eviction queue before its request is read.
ACCEPT_BATCH = 64
# Pages served from this machine (any port) may call the gateway from a browser.
LOOPBACK_ORIGIN = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?"


class _AppUser(Convertor[str]):
    """A path segment that is an app's `user` string: any characters, '/' and line breaks too
    (Starlette's `path` stops at a line break; the protocol refuses one with a 400)."""

    regex = r"[\s\S]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("app_user", _AppUser())


def build_app(gateway: Gateway) -> Starlette:
    """The ASGI app: every route answers errors in OpenAI's shape (Gateway.answering_errors)."""
    responses = ResponsesApi(gateway)
    routes = [
        ("/health", gateway.health, "GET"),
        ("/metrics", gateway.metrics, "GET"),
        ("/v1/models", gateway.models, "GET"),
        ("/v1/models/{model:path}", gateway.model, "GET"),
        ("/v1/chat/completions", gateway.chat_completions, "POST"),
        ("/v1/completions", gateway.completions, "POST"),
        ("/v1/embeddings", gateway.embeddings, "POST"),
        ("/v1/feedback", gateway.feedback, "POST"),
        # `user` is the app's own string, which may hold a '/' (sent as %2F, which routing
        # sees decoded) or anything else: matched whole, before the route's fixed end, so
        # that the protocol (not a 404) judges it.
        ("/v1/users/{user:app_user}/consent", gateway.consent, "POST"),
        ("/v1/users/{user:app_user}/export", gateway.export, "GET"),
        ("/v1/users/{user:app_user}/adapters", gateway.adapters, "GET"),
        ("/v1/users/{user:app_user}", gateway.forget, "DELETE"),
        ("/v1/responses", responses.create, "POST"),
        ("/v1/responses/{response_id}", responses.retrieve, "GET"),
        ("/v1/responses/{response_id}", responses.delete, "DELETE"),
    ]
    origins = [o.strip() for o in gateway.service.config.http.cors_origins.split(",") if o.strip()]

    def allowed_hosts() -> frozenset[str] | None:
        config = gateway.config  # read per request: SIGHUP may swap it
        extra = frozenset(h.strip().lower().strip("[]") for h in config.http.allowed_hosts.split(",") if h.strip())
        address = config.http_address
        if address is not None and is_loopback(address[0]):
            return LOOPBACK_NAMES | extra
        return extra or None  # beyond loopback, API keys guard the data; names only if listed

    return Starlette(
        routes=[Route(path, gateway.answering_errors(fn), methods=[method]) for path, fn, method in routes],
        exception_handlers={HTTPException: gateway.on_http_error},
        # Browser apps: preflights are answered before routing and without a key (browsers
        # send none on them); the real request still needs one.
        # The browser guard first: a rebound Host or a cross-site write is refused before CORS.
        middleware=[Middleware(BrowserGuard, allowed_hosts=allowed_hosts,
                               origin_allowed=origin_rule(origins, LOOPBACK_ORIGIN)),
                    Middleware(CORSMiddleware, allow_origins=origins, allow_origin_regex=LOOPBACK_ORIGIN,
                               allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                               allow_headers=["Authorization", "Content-Type", "OpenAI-Organization",
                                              "OpenAI-Project", "X-Stainless-Lang", "X-Stainless-Package-Version",
                                              "X-Stainless-OS", "X-Stainless-Arch", "X-Stainless-Runtime",
                                              "X-Stainless-Runtime-Version", "X-Stainless-Retry-Count",
                                              "X-Stainless-Timeout"],
                               expose_headers=["X-Mace-Adapter", "Retry-After", "Retry-After-Ms"],
                               max_age=600)])


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # maced owns SIGTERM/SIGINT (drain) and SIGHUP (reload); uvicorn must not take them.
        yield

    def install_signal_handlers(self) -> None:  # the same hook in uvicorn < 0.29
        return None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # asyncio took the small `backlog` for both its accepts per wake-up and listen(); the
        # kernel's queue gets the large one back, the accept batches stay small.
        for sock in sockets or ():
            sock.listen(LISTEN_BACKLOG)


class HttpGateway:
    """Binds the HTTP socket up front (errors surface before the model loads), then serves the
    app with uvicorn on the running event loop until `close()`."""

    def __init__(self, config: DaemonConfig, service: Service,
                 app_factory: Callable[[Service], Gateway] = Gateway) -> None:
        self.config = config
        self.gateway = app_factory(service)
        self.app = build_app(self.gateway)
        self.socket: socket.socket | None = None
        self.endpoint = ""
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task[None] | None = None
        self.book: ConnectionBook | None = None
        self.cap = 0
        self._accept_errors: AcceptErrorFilter | None = None

    def summary(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "auth": bool(self.gateway.service.identities.api_keys),
                **self.gateway.summary(), **(self.book.summary() if self.book else {})}

    def bind(self) -> str:
        address = self.config.http_address
        assert address is not None
        host, port = address
        self.cap = http_connection_cap(self.config.limits)  # before the socket: a LimitError stops the start
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, sockaddr = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(LISTEN_BACKLOG)
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
        limits = self.config.limits
        cap = self.cap
        self.book = ConnectionBook(cap, limits.http_max_connections_per_peer, limits.http_request_read_timeout_s)
        # The book keeps connections at or under `cap` (evicting idle ones); uvicorn's own limit
        # answers 503 only when that many requests run at once.
        config = uvicorn.Config(
            self.app, http=functools.partial(GuardedH11, book=self.book), ws="none", lifespan="off",
            log_config=None, log_level="warning", access_log=False, server_header=False,
            proxy_headers=False, timeout_graceful_shutdown=2, timeout_keep_alive=limits.http_keep_alive_s,
            limit_concurrency=cap + 1, h11_max_incomplete_event_size=limits.http_max_header_bytes,
            backlog=ACCEPT_BATCH)
        self._accept_errors = AcceptErrorFilter(asyncio.get_running_loop(), limits.accept_error_log_interval_s)
        self._accept_errors.install()
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
        if self._accept_errors is not None:
            self._accept_errors.remove()
