"""Limits that hold before and after authentication: the `[limits]` settings, the file
descriptors the HTTP gateway may use (RLIMIT_NOFILE minus a reserve for ZeroMQ and SQLite),
the per-request caps, and the key a client's sequence quota is counted under.
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# Fewer HTTP connections than this and the gateway could not serve a handful of clients.
MIN_HTTP_CONNECTIONS = 16


@dataclass(frozen=True)
class LimitSettings:
    """`[limits]` in maced.toml (docs/daemon.md, docs/security.md)."""

    # HTTP connections open at once, all peers together; lowered at start to RLIMIT_NOFILE minus
    # fd_reserve. When full, the connection that has waited longest without sending a whole
    # request is dropped for the new one, so idle sockets cannot lock out working clients.
    http_max_connections: int = 1024
    http_max_connections_per_peer: int = 256  # per peer address, the same eviction rule
    fd_reserve: int = 256  # descriptors kept for ZeroMQ peers, SQLite, model files, logs
    # A request's headers and body must have arrived within this many seconds of its first byte
    # (or of the connection, for the first request); slower ones are closed.
    http_request_read_timeout_s: float = 10.0
    http_keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    http_max_header_bytes: int = 16384  # request line and headers together
    max_sequences_per_request: int = 64  # prompts x n in one request
    # The largest max_tokens a request may ask for (the context length stops a generation anyway;
    # lower it to bound one request's time).
    max_tokens_ceiling: int = 131072
    # Sequences (n of each generate) in flight per client key (API key, CURVE key, endpoint
    # kind): more sockets or connections of the same client share it.
    max_sequences_per_client: int = 256
    accept_error_log_interval_s: float = 10.0  # accept failures (EMFILE) are logged once per interval

    def __post_init__(self) -> None:
        for key in ("http_max_connections", "http_max_connections_per_peer", "http_max_header_bytes",
                    "max_sequences_per_request", "max_tokens_ceiling", "max_sequences_per_client"):
            if getattr(self, key) < 1:
                raise ValueError(f"limits.{key} must be >= 1")
        if self.fd_reserve < 64:
            raise ValueError("limits.fd_reserve must be >= 64 (ZeroMQ, SQLite and the model need descriptors)")
        if min(self.http_request_read_timeout_s, self.http_keep_alive_s, self.accept_error_log_interval_s) <= 0:
            raise ValueError("limits.http_request_read_timeout_s, http_keep_alive_s and "
                             "accept_error_log_interval_s must be > 0")
        if self.http_max_header_bytes < 1024:
            raise ValueError("limits.http_max_header_bytes must be at least 1024")


class LimitError(OSError):
    """The process cannot open enough files to serve with the reserve it needs (an OSError: the
    gateway's bind reports it like any other failure to listen)."""


def raise_nofile_soft_limit() -> int:
    """The soft RLIMIT_NOFILE raised to the hard one (the unit's LimitNOFILE); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass  # keep the soft limit; the cap below is derived from it
    return soft


def http_connection_cap(limits: LimitSettings, nofile: int | None = None) -> int:
    """The HTTP gateway's connection cap: the setting, lowered so that `fd_reserve` descriptors
    always stay free for everything else. LimitError where that leaves too few."""
    if nofile is None:
        nofile = raise_nofile_soft_limit()
    if nofile == resource.RLIM_INFINITY:
        return limits.http_max_connections
    room = nofile - limits.fd_reserve
    if room < MIN_HTTP_CONNECTIONS:
        raise LimitError(f"RLIMIT_NOFILE is {nofile}: with limits.fd_reserve = {limits.fd_reserve} that leaves "
                         f"{max(room, 0)} descriptors for HTTP connections (at least {MIN_HTTP_CONNECTIONS} "
                         "needed); raise LimitNOFILE or lower limits.fd_reserve")
    if room < limits.http_max_connections:
        log.warning("limits.http_max_connections lowered from %d to %d (RLIMIT_NOFILE %d minus fd_reserve %d)",
                    limits.http_max_connections, room, nofile, limits.fd_reserve)
        return room
    return limits.http_max_connections


def quota_key(client: Any, principal: Any = None) -> Any:
    """The unit a client's sequence quota is counted under: what identifies a client that it
    cannot multiply by opening sockets or connections. The principal as the front identified it
    (daemon.principals: its kind, app and how: peer uid, CURVE key, API key); without one, the
    API key digest (or host) of an HTTP client, or the endpoint a ZeroMQ client came in on."""
    if principal is not None and getattr(principal, "via", ""):
        return ("principal", principal.kind, principal.app, principal.via)
    if isinstance(client, tuple) and client and client[0] == "http":
        _, digest, host = client
        return ("http", digest or host)
    if isinstance(client, tuple) and len(client) == 2 and isinstance(client[0], int):
        return ("zmq", client[0])
    return client


class EveryInterval:
    """How a repeating failure is logged: the first at once, then one line per interval with
    the count since (an accept loop failing 7,000 times a second writes one line, not 7,000)."""

    def __init__(self, interval_s: float, clock: Any = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.suppressed = 0
        self._last = float("-inf")

    def due(self) -> int | None:
        """None: stay silent (counted). Else: log now, with this many suppressed since the last line."""
        now = self.clock()
        if now - self._last < self.interval_s:
            self.suppressed += 1
            return None
        self._last = now
        count, self.suppressed = self.suppressed, 0
        return count
