"""sd_notify over a real datagram socket, and the watchdog rule (ping only while both loops live)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from daemon.sdnotify import Notifier, Watchdog, watchdog_interval_s


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_notifier_sends_lines_to_a_path_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sink:
        sink.bind(path)
        notifier = Notifier({"NOTIFY_SOCKET": path})
        notifier.ready("serving tiny")
        lines = sink.recv(4096).decode().split("\n")
        assert lines[0] == "READY=1" and "STATUS=serving tiny" in lines
        assert f"MAINPID={os.getpid()}" in lines


def test_notifier_supports_abstract_sockets() -> None:
    name = f"mace-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sink:
        sink.bind("\0" + name)
        Notifier({"NOTIFY_SOCKET": "@" + name}).send("WATCHDOG=1")
        assert sink.recv(100) == b"WATCHDOG=1"


def test_notifier_is_a_noop_outside_systemd() -> None:
    notifier = Notifier({})
    assert not notifier.enabled and notifier.send("READY=1") is False


def test_watchdog_interval_is_for_this_process_only() -> None:
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 30.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 30.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval_s({}) is None


class Recorder(Notifier):
    def __init__(self) -> None:
        super().__init__({})
        self.sent: list[str] = []

    @property
    def enabled(self) -> bool:
        return True

    def send(self, *lines: str) -> bool:
        self.sent.extend(lines)
        return True


def test_watchdog_pings_at_half_the_interval_while_the_event_loop_ticks() -> None:
    clock, notifier = FakeClock(), Recorder()
    dog = Watchdog(notifier, 10.0, clock=clock)
    for _ in range(20):  # 20 engine iterations over 10 s, the loop ticking along
        dog.loop_alive()
        dog.engine_alive()
        clock.now += 0.5
    assert notifier.sent.count("WATCHDOG=1") == 2


def test_watchdog_stops_pinging_when_the_event_loop_is_stuck() -> None:
    clock, notifier = FakeClock(), Recorder()
    dog = Watchdog(notifier, 10.0, clock=clock)
    dog.loop_alive()
    clock.now += 6.0  # the loop has not ticked for more than half the interval
    dog.engine_alive()
    assert notifier.sent == []
