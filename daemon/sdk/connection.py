"""What both clients' connections share: request ids, the DEALER socket's options (timeouts,
reconnects, CURVE), and the rule for when a request may be sent again.
"""

from __future__ import annotations

import itertools
import secrets
from typing import Any

import zmq

from daemon.sdk.results import RemoteError
from daemon.wire import IDEMPOTENT_OPS

# The daemon did nothing with a request refused for these reasons: resending is always safe.
_RETRY_ANY = frozenset({"busy", "not_ready"})


class Ids:
    def __init__(self) -> None:
        self._prefix = secrets.token_hex(4)
        self._counter = itertools.count(1)

    def next(self) -> str:
        return f"{self._prefix}-{next(self._counter)}"


def configure(sock: zmq.Socket, connect_timeout_s: float, curve_server_key: bytes | None,
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


class Retrying:
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
