"""Hostile input against a real daemon: >= 10,000 malformed messages (bad msgpack, wrong types,
huge fields, unknown ops, odd multipart, broken transports) while a well-formed client is served.

Every message sent on a ZeroMQ socket must get exactly one final reply; the daemon must not die.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from typing import Any

import msgpack
import zmq

from daemon.client import Client
from daemon.protocol import ERROR_CODES

MESSAGES = 10_400
SOCKETS = 4
SEED = 20_251_122

VALID = [
    {"v": 1, "id": "g", "op": "generate", "prompt": "x", "max_tokens": 1, "timeout_s": 1.0},
    {"v": 1, "id": "m", "op": "generate", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    {"v": 1, "id": "f", "op": "feedback", "user": "eve", "interaction_id": "ix-1",
     "feedback": {"kind": "rating", "candidate": 0, "stars": 3}},
    {"v": 1, "id": "c", "op": "users.consent", "user": "eve", "granted": True},
    {"v": 1, "id": "x", "op": "users.export", "user": "eve"},
    {"v": 1, "id": "k", "op": "cancel", "target": "nothing"},
    {"v": 1, "id": "a", "op": "adapters.rollback", "user": "eve", "version": 1},
    {"v": 1, "id": "s", "op": "health"},
]


def nasty_value(rng: random.Random) -> Any:
    choice = rng.randrange(14)
    return [
        None, True, -1, 2**64 - 1, -(2**63), float("nan"), float("inf"), 1e308,
        "", "\u202e\x00" * rng.randrange(1, 50), rng.randbytes(rng.randrange(0, 40)),
        [rng.random() for _ in range(rng.randrange(0, 20))], {"kind": rng.randbytes(3)},
        "x" * rng.randrange(1, 5000),
    ][choice]


def hostile_frames(rng: random.Random) -> list[bytes]:
    """One hostile message as the frames a DEALER sends (the daemon sees an identity before them)."""
    kind = rng.randrange(12)
    if kind in (5, 6) and rng.random() < 0.75:
        kind = 3  # megabyte frames are a few hundred of the 10,000, not a thousand and more
    base = dict(rng.choice(VALID))
    if kind == 0:  # random bytes
        return [rng.randbytes(rng.randrange(0, 300))]
    if kind == 1:  # a valid request cut short
        packed = msgpack.packb(base)
        return [packed[: rng.randrange(0, len(packed))]]
    if kind == 2:  # valid msgpack, not a map
        return [msgpack.packb(rng.choice([[1, 2], 7, "status", None, b"\x00", [base]]))]
    if kind == 3:  # one field replaced by a value of the wrong type or range
        key = rng.choice(sorted(base))
        base[key] = nasty_value(rng)
        return [msgpack.packb(base, use_bin_type=True)]
    if kind == 4:  # unknown ops, versions and extra fields
        base[rng.choice(["op", "v", "id", "zz" + str(rng.randrange(99))])] = rng.choice(
            ["rm -rf", "generate ", "STATUS", 0, 99, None, "status" * 30])
        return [msgpack.packb(base)]
    if kind == 5:  # huge fields below the frame limit
        base["prompt" if base["op"] == "generate" else "user"] = "A" * rng.randrange(200_001, 900_000)
        return [msgpack.packb(base)]
    if kind == 6:  # frames over the soft limit (answered `too_large`)
        return [msgpack.packb({"v": 1, "id": "big", "op": "status", "pad": b"\x00" * (1_100_000)})]
    if kind == 7:  # odd multipart: extra frames, empty frames, REQ-style envelope with two bodies
        body = msgpack.packb(base)
        return rng.choice([[body, body], [b"", b"", body], [b"", body, body], [body, b""], [b""] * 4])
    if kind == 8:  # invalid UTF-8 inside a string
        return [b"\x83\xa1v\x01\xa2id\xa1z\xa2op\xa6\xff\xfe\xfd\xfc\xfb\xfa"]
    if kind == 9:  # deep nesting, many keys, extension types
        return [rng.choice([b"\x91" * 3000 + b"\xc0",
                            msgpack.packb({f"k{i}": i for i in range(20_000)}),
                            msgpack.packb({"v": 1, "id": msgpack.ExtType(1, b"x"), "op": "health"})])]
    if kind == 10:  # well-formed envelope, hostile ids and users
        base["id"] = rng.choice(["", "x" * 129, ["list"], 2**70 // 2**7, True])
        if "user" in base:
            base["user"] = rng.choice(["../../etc/passwd", ".hidden", "a" * 65, "", "é"])
        return [msgpack.packb(base)]
    return [msgpack.packb({"v": 1, "id": rng.randrange(2**62), "op": rng.choice(
        ["status", "adapters.list", "cancel", "feedback"])})]  # valid or nearly: answered too


def fuzz_socket(endpoint: str, seed: int, count: int, stats: dict[str, Any]) -> None:
    rng = random.Random(seed)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(endpoint)
    finals = 0
    codes: dict[str, int] = {}

    def drain(timeout_ms: int) -> None:
        nonlocal finals
        while sock.poll(timeout_ms):
            frames = sock.recv_multipart()
            reply = msgpack.unpackb(frames[-1])
            if reply.get("type") == "token":
                continue
            finals += 1
            if reply["type"] == "error":
                code = reply["error"]["code"]
                assert code in ERROR_CODES, reply
                codes[code] = codes.get(code, 0) + 1
            else:
                assert reply["type"] == "result", reply
            timeout_ms = 0

    for i in range(count):
        sock.send_multipart(hostile_frames(rng))
        if i % 100 == 99:
            drain(0)
    deadline = time.monotonic() + 60
    while finals < count and time.monotonic() < deadline:
        drain(200)
    sock.close()
    stats[seed] = (finals, codes)


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


def test_daemon_survives_10000_hostile_messages_and_keeps_serving(start_daemon) -> None:
    d = start_daemon(extra_args=["--set", "server.max_inflight_per_client=4096"])
    rng = random.Random(SEED)
    served: list[float] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def well_formed_client() -> None:
        with Client(d.endpoint, timeout_s=30) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    assert c.generate("hello", max_tokens=3, ignore_eos=True).usage["completion_tokens"] == 3
                except BaseException as exc:  # recorded, asserted below
                    failures.append(exc)
                    return
                served.append(time.monotonic() - t0)

    good = threading.Thread(target=well_formed_client)
    good.start()
    started = time.monotonic()
    stats: dict[int, Any] = {}
    per_socket = MESSAGES // SOCKETS
    fuzzers = [threading.Thread(target=fuzz_socket, args=(d.endpoint, SEED + i, per_socket, stats))
               for i in range(SOCKETS)]
    for t in fuzzers:
        t.start()
    raw = transport_garbage(str(d.socket), rng)
    # Frames past the hard limit make libzmq drop the sender's connection: no reply, no harm.
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.DEALER) as giant:
        giant.setsockopt(zmq.LINGER, 2000)
        giant.connect(d.endpoint)
        for _ in range(3):
            giant.send(b"\x00" * (5 << 20))
        time.sleep(0.5)
    for t in fuzzers:
        t.join(120)
    elapsed = time.monotonic() - started
    stop.set()
    good.join(30)

    sent = per_socket * SOCKETS + raw + 3
    assert sent >= 10_000
    assert d.proc.poll() is None, d.log()
    for seed, (finals, codes) in stats.items():
        assert finals == per_socket, f"socket {seed}: {finals} final replies for {per_socket} messages"
        assert codes.get("bad_message", 0) > 100 and codes.get("bad_request", 0) > 100, codes
        assert codes.get("too_large", 0) > 10 and codes.get("unknown_op", 0) > 10, codes
    assert len(stats) == SOCKETS
    assert not failures, failures
    assert len(served) >= 3, "the well-formed client was starved"
    with Client(d.endpoint, timeout_s=30) as c:
        assert c.generate("after the storm", max_tokens=4, ignore_eos=True).usage["completion_tokens"] == 4
        server = c.status()["server"]
    assert server["errors"].get("bad_message", 0) > 400
    print(f"\nfuzz: {sent} hostile messages in {elapsed:.1f} s; well-formed client served {len(served)} "
          f"times (max {max(served):.2f} s); daemon pid {d.proc.pid} still up; errors {server['errors']}")
    code, _ = d.stop()
    assert code == 0
    assert os.path.exists(d.log_path)
