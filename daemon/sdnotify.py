"""systemd's notify protocol (READY, STATUS, WATCHDOG, STOPPING) over $NOTIFY_SOCKET, and the
watchdog rule that pings only while both the engine loop and the event loop are alive.

A few lines of datagram code instead of a dependency; every call is a no-op outside systemd.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


class Notifier:
    """Sends `KEY=VALUE` lines to the service manager; safe to call from any thread."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        address = environ.get("NOTIFY_SOCKET", "")
        # '@' names a socket in the abstract namespace: the kernel spells it with a leading NUL.
        self.address = "\0" + address[1:] if address.startswith("@") else address
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *lines: str) -> bool:
        if self._sock is None:
            return False
        payload = "\n".join(lines).encode()
        try:
            with self._lock:
                self._sock.sendto(payload, self.address)
        except OSError as exc:  # systemd gone or restarting: nothing to do but say so once in a while
            log.debug("sd_notify %r failed: %s", lines, exc)
            return False
        return True

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def reloading(self) -> None:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.send("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval_s(environ: Mapping[str, str] | None = None) -> float | None:
    """WatchdogSec as seconds when the watchdog is meant for this process, else None."""
    environ = os.environ if environ is None else environ
    usec = environ.get("WATCHDOG_USEC", "")
    pid = environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 1e6


class Watchdog:
    """Pings WATCHDOG=1 from the engine thread, at half the interval, but only while the event
    loop has also ticked recently: a stuck engine or a stuck loop both stop the pings, and
    systemd restarts the daemon."""

    def __init__(self, notifier: Notifier, interval_s: float | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.notifier = notifier
        self.interval_s = interval_s
        self.clock = clock
        self._last_ping = float("-inf")
        self._loop_tick = clock()
        self.pings = 0

    @property
    def enabled(self) -> bool:
        return self.interval_s is not None and self.notifier.enabled

    @property
    def period_s(self) -> float:
        return (self.interval_s or 2.0) / 2

    def loop_alive(self) -> None:
        """Called by a periodic task on the event loop."""
        self._loop_tick = self.clock()

    def engine_alive(self) -> None:
        """Called by the engine thread after every iteration (and while idle)."""
        if self.interval_s is None:
            return
        now = self.clock()
        if now - self._last_ping < self.period_s:
            return
        if now - self._loop_tick > self.period_s:
            return  # the event loop is stuck: let the watchdog fire
        self._last_ping = now
        if self.notifier.send("WATCHDOG=1"):
            self.pings += 1
