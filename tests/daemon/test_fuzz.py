"""Hostile input against a real daemon, through the reusable harness (tests/daemon/fuzz.py):
malformed frames (bad msgpack, wrong types, huge fields, unknown ops, odd multipart, timestamps,
trailing-newline ids), legal requests at the edge of every documented range (the sampler
extremes included), broken transports, and frames past the hard limit, while other clients'
well-formed requests run beside them.

Every frame with a reply address gets exactly one final reply; no other client's request fails
or changes its result; the daemon does not die. `tools/fuzz_protocol.py --frames 10000` is the
long mode of the same harness.
"""

from __future__ import annotations

import random
import socket
import time

import zmq

from daemon.sdk import Client
from tests.daemon.fuzz import run_fuzz

FRAMES = 2_400
SEED = 20_251_122


def transport_garbage(path: str, rng: random.Random) -> int:
    """Raw bytes on the ipc socket: a broken ZMTP greeting, a truncated frame, noise."""
    sent = 0
    greeting = b"\xff" + b"\x00" * 8 + b"\x01\x7f\x03\x00NULL" + b"\x00" * 16 + b"\x00" + b"\x00" * 31
    for payload in (greeting[:5], greeting + b"\x04\x1a\x05READY", greeting + b"\x01\xff\x00",
                    rng.randbytes(2000), b"GET / HTTP/1.1\r\n\r\n"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect(path)
            try:
                s.sendall(payload)
            except OSError:
                pass
            sent += 1
    return sent


def test_daemon_answers_every_hostile_frame_once_and_other_clients_are_untouched(start_daemon) -> None:
    # The fuzzer and the bystanders connect as one principal (this test's uid), and sequences in
    # flight are counted per principal (limits.max_sequences_per_client, tests/security/test_limits.py):
    # lift that quota here, where what is checked is that hostile frames harm nobody.
    d = start_daemon(extra_args=["--set", "limits.max_sequences_per_client=100000"])
    rng = random.Random(SEED)
    raw = transport_garbage(str(d.socket), rng)
    # Frames past the hard limit make libzmq drop the sender's connection: no reply, no harm.
    with zmq.Context.instance().socket(zmq.DEALER) as giant:
        giant.setsockopt(zmq.LINGER, 2000)
        giant.connect(d.endpoint)
        for _ in range(3):
            giant.send(b"\x00" * (5 << 20))
        time.sleep(0.5)
    report = run_fuzz(d.endpoint, frames=FRAMES, seed=SEED, alive=lambda: d.proc.poll() is None)
    print(f"\nfuzz: {report.as_dict()} (+{raw} raw transport payloads)")
    assert report.problems() == [], report.as_dict()
    assert report.frames == FRAMES and report.bystander_requests >= 6
    codes = report.codes
    for code in ("bad_message", "bad_request", "unknown_op", "unsupported_version", "too_large", "result"):
        assert codes.get(code, 0) > 10, codes
    with Client(d.endpoint, timeout_s=30) as c:
        assert c.generate("after the storm", max_tokens=4, ignore_eos=True).usage["completion_tokens"] == 4
        errors = c.status()["server"]["errors"]
    assert errors.get("internal", 0) == 0, errors
    code, _ = d.stop()
    assert code == 0
