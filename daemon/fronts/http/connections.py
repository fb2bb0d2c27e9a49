"""The gateway's connections before any request is read: a cap on all of them and on each peer,
a deadline for a request's headers and body (uvicorn has none), and accept failures logged once
per interval. Idle or half-sent sockets cost a descriptor each and authenticate nothing, so
these hold before the API key is looked at.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from daemon.limits import EveryInterval

log = logging.getLogger("daemon.fronts.http")

_ACCEPT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class ConnectionBook:
    """Every open gateway connection, oldest first, with its peer. When the cap (or the peer's
    cap) is reached, the connection that has waited longest without a whole request goes: a
    working client's request is read in milliseconds, an attacker's idle sockets are not."""

    def __init__(self, cap: int, per_peer: int, read_timeout_s: float) -> None:
        self.cap = cap
        self.per_peer = per_peer
        self.read_timeout_s = read_timeout_s
        self.open: dict[GuardedH11, str] = {}  # insertion order = age
        self.peers: dict[str, dict[GuardedH11, None]] = {}  # each peer's, oldest first
        self.evicted = 0
        self.timed_out = 0

    def admit(self, conn: GuardedH11, peer: str) -> None:
        mine = self.peers.setdefault(peer, {})
        if len(mine) >= self.per_peer:
            self._evict(mine)
        if len(self.open) >= self.cap:
            self._evict(self.open)
        self.open[conn] = peer
        mine[conn] = None

    def forget(self, conn: GuardedH11) -> None:
        peer = self.open.pop(conn, None)
        if peer is not None:
            mine = self.peers[peer]
            mine.pop(conn, None)
            if not mine:
                del self.peers[peer]

    def _evict(self, among: dict[GuardedH11, Any]) -> None:
        # Oldest first, and almost always the first one: a connection whose request is being
        # answered only if none waits for its request. Bounded scan: the cap's connections at most.
        victim = next((c for c in among if c.waiting_for_request()), None) or next(iter(among), None)
        if victim is not None:
            self.evicted += 1
            self.forget(victim)
            victim.drop()

    def summary(self) -> dict[str, Any]:
        return {"connections": len(self.open), "connection_cap": self.cap, "evicted": self.evicted,
                "read_timeouts": self.timed_out}


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with the book's caps and a read deadline: from the connection (or
    the first byte of a later request) until the request's last body byte."""

    def __init__(self, *args: Any, book: ConnectionBook, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.book = book
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.book.admit(self, self.client[0] if self.client else "")
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.book.forget(self)
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            self._arm()  # the first byte of a later request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm()  # the whole request is in (or the connection is done)

    def waiting_for_request(self) -> bool:
        """No whole request in yet (nothing sent, headers cut off, or a body still coming): what
        an idle or half-sent socket looks like. A request being answered is not waiting."""
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY)

    def drop(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.abort()  # no FIN dance: the descriptor is what is short

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.book.read_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self.waiting_for_request():
            self.book.timed_out += 1
            self.book.forget(self)
            self.drop()


class AcceptErrorFilter:
    """A loop exception handler that folds accept failures (out of descriptors or memory) into
    one line per interval with a count, and passes everything else to the handler before it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float) -> None:
        self.loop = loop
        self.previous = loop.get_exception_handler()
        self.every = EveryInterval(interval_s, time.monotonic)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _ACCEPT_ERRNOS:
            suppressed = self.every.due()
            if suppressed is not None:
                more = f" ({suppressed} more since the last line)" if suppressed else ""
                log.error("HTTP accept failed: %s%s; the gateway retries (connections are capped by "
                          "limits.http_max_connections)", exc.strerror or exc, more)
            return
        if self.previous is not None:
            self.previous(loop, context)
        else:
            loop.default_exception_handler(context)

    def install(self) -> None:
        self.loop.set_exception_handler(self)

    def remove(self) -> None:
        if self.loop.get_exception_handler() is self:
            self.loop.set_exception_handler(self.previous)
