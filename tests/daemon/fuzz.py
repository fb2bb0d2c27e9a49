"""A reusable protocol fuzzer for a real `maced`: hostile and edge-case frames from several
DEALER sockets, interleaved with well-formed requests from other clients whose results are known
in advance. CI runs a few thousand frames (tests/daemon/test_fuzz.py); `tools/fuzz_protocol.py
--frames 10000` runs the long mode against a daemon it starts (or any endpoint).

What a run asserts (`FuzzReport.problems`): every frame sent with a reply address got exactly one
final reply (no missing, no extra), every error code is a documented one, no well-formed request
of another client failed or changed its result, and the daemon is still up.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from daemon.sdk import Client
from daemon.wire import (
    ERROR_CODES,
    MAX_N,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKENS_CAP,
)

VALID: list[dict[str, Any]] = [
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

# The edges of every documented generate range (docs/protocol.md), legal and answered normally.
TINY = 5e-324  # the smallest positive double
SAMPLING_EXTREMES: list[dict[str, Any]] = [
    {"temperature": 1e-39}, {"temperature": TINY}, {"temperature": 1e-300}, {"temperature": 100.0},
    {"top_p": 1e-300, "temperature": 1.0}, {"top_p": TINY, "temperature": 100.0}, {"top_p": 1.0, "temperature": 1.0},
    {"top_k": 1, "temperature": 1.0}, {"top_k": 2**31 - 1, "temperature": 0.5},
    {"seed": 0, "temperature": 1.0}, {"seed": 2**63 - 1 - MAX_N, "temperature": 1.0, "n": MAX_N},
    {"n": MAX_N, "temperature": TINY, "top_p": TINY},
    {"max_tokens": MAX_TOKENS_CAP, "timeout_s": 0.3}, {"max_tokens": 1},
    {"stop": ["s" * MAX_STOP_CHARS] * MAX_STOP_STRINGS}, {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))},
    {"stop_token_ids": [2**31 - 1]}, {"ignore_eos": True, "max_tokens": 3}, {"timeout_s": TINY},
    {"adapter": 2**31 - 1, "user": "eve"}, {"adapter": "base", "user": "eve", "record": False},
]


def nasty_value(rng: random.Random) -> Any:
    return rng.choice([
        None, True, False, 0, -0.0, -1, 2**64 - 1, -(2**63), float("nan"), float("inf"), 1e308, TINY,
        "", "\u202e\x00" * rng.randrange(1, 50), rng.randbytes(rng.randrange(0, 40)), {}, "x\n",
        [rng.random() for _ in range(rng.randrange(0, 20))], {"kind": rng.randbytes(3)},
        "x" * rng.randrange(1, 5000), msgpack.Timestamp(rng.randrange(2**32), 0),
    ])


def hostile_frames(rng: random.Random) -> list[bytes]:
    """One hostile (or edge-of-range legal) message as the frames a DEALER sends."""
    kind = rng.randrange(14)
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
        base[rng.choice(sorted(base))] = nasty_value(rng)
        return [msgpack.packb(base, use_bin_type=True, datetime=False)]
    if kind == 4:  # unknown ops, versions and extra fields
        base[rng.choice(["op", "v", "id", "zz" + str(rng.randrange(99))])] = rng.choice(
            ["rm -rf", "generate ", "STATUS", 0, 99, None, "status" * 30, 1.0, True, "1"])
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
    if kind == 9:  # deep nesting, many keys, extension types (the timestamp one included)
        return [rng.choice([b"\x91" * 3000 + b"\xc0",
                            msgpack.packb({f"k{i}": i for i in range(20_000)}),
                            msgpack.packb({"v": 1, "id": msgpack.ExtType(1, b"x"), "op": "health"}),
                            msgpack.packb({"v": 1, "id": "t", "op": "health", "x": msgpack.Timestamp(1, 2)},
                                          datetime=False)])]
    if kind == 10:  # well-formed envelope, hostile ids and users
        base["id"] = rng.choice(["", "x" * 129, ["list"], 2**70 // 2**7, True, "id\n"])
        if "user" in base:
            base["user"] = rng.choice(["../../etc/passwd", ".hidden", "a" * 65, "", "é", "nl\n", "a\r"])
        return [msgpack.packb(base)]
    if kind in (11, 12):  # legal generates at the edges of every documented range
        extreme = rng.choice(SAMPLING_EXTREMES)
        message = {"v": 1, "id": f"e{rng.randrange(2**40)}", "op": "generate", "prompt": "edge",
                   "max_tokens": 2, "timeout_s": 5.0, **extreme}
        return [msgpack.packb(message)]
    return [msgpack.packb({"v": 1, "id": rng.randrange(2**62), "op": rng.choice(
        ["status", "adapters.list", "cancel", "feedback"])})]  # valid or nearly: answered too


@dataclass
class SocketTally:
    sent: int = 0
    finals: int = 0
    codes: Counter = field(default_factory=Counter)
    undocumented: list[Any] = field(default_factory=list)


@dataclass
class Bystander:
    """A well-formed client of its own: the same requests again and again, each result known."""

    prompt: str
    max_tokens: int
    stream: bool = False
    done: int = 0
    failures: list[str] = field(default_factory=list)


@dataclass
class FuzzReport:
    frames: int
    finals: int
    extra_finals: int
    codes: dict[str, int]
    undocumented: list[Any]
    bystander_requests: int
    bystander_failures: list[str]
    daemon_up: bool
    elapsed_s: float

    @property
    def missing(self) -> int:
        return max(0, self.frames - self.finals)

    def problems(self) -> list[str]:
        out = []
        if self.missing:
            out.append(f"{self.missing} frame(s) never got a final reply")
        if self.extra_finals:
            out.append(f"{self.extra_finals} final reply(ies) beyond one per frame")
        if self.undocumented:
            out.append(f"undocumented replies: {self.undocumented[:3]}")
        if self.bystander_failures:
            out.append(f"{len(self.bystander_failures)} collateral failure(s): {self.bystander_failures[:3]}")
        if not self.daemon_up:
            out.append("the daemon is down")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"frames": self.frames, "finals": self.finals, "missing": self.missing,
                "extra_finals": self.extra_finals, "codes": dict(sorted(self.codes.items())),
                "bystander_requests": self.bystander_requests,
                "collateral_failures": len(self.bystander_failures), "daemon_up": self.daemon_up,
                "elapsed_s": round(self.elapsed_s, 2), "problems": self.problems()}


def _fuzz_socket(endpoint: str, seed: int, count: int, tally: SocketTally, settle_s: float) -> None:
    rng = random.Random(seed)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(endpoint)

    def drain(timeout_ms: int) -> None:
        while sock.poll(timeout_ms):
            reply = msgpack.unpackb(sock.recv_multipart()[-1])
            timeout_ms = 0
            if reply.get("type") == "token":
                continue
            tally.finals += 1
            if reply.get("type") == "error":
                code = reply["error"]["code"]
                tally.codes[code] += 1
                if code not in ERROR_CODES:
                    tally.undocumented.append(reply)
            elif reply.get("type") == "result":
                tally.codes["result"] += 1
            else:
                tally.undocumented.append(reply)

    try:
        for i in range(count):
            sock.send_multipart(hostile_frames(rng))
            tally.sent += 1
            if i % 50 == 49:
                drain(0)
        deadline = time.monotonic() + 120
        while tally.finals < tally.sent and time.monotonic() < deadline:
            drain(200)
        drain(int(settle_s * 1000))  # anything beyond one final per frame would arrive now
    finally:
        sock.close()


def _bystander(endpoint: str, job: Bystander, expected: str, stop: threading.Event) -> None:
    with Client(endpoint, timeout_s=120, retries=0) as client:
        while not stop.is_set():
            try:
                if job.stream:
                    text = "".join(t.text for t in client.stream(job.prompt, max_tokens=job.max_tokens,
                                                                 ignore_eos=True))
                else:
                    text = client.generate(job.prompt, max_tokens=job.max_tokens, ignore_eos=True).text
            except Exception as exc:  # every failure of a well-formed request is collateral damage
                job.failures.append(f"{type(exc).__name__}: {exc}")
                stop.wait(1.0)
                continue
            job.done += 1
            if text != expected:
                job.failures.append(f"result changed: {text!r} != {expected!r}")


BYSTANDERS = [Bystander("A well-formed question about tides", 8),
              Bystander("Another client's streamed story", 12, stream=True),
              Bystander("hello", 3)]


def run_fuzz(endpoint: str, *, frames: int, sockets: int = 4, seed: int = 20_251_122,
             alive: Callable[[], bool] = lambda: True, settle_s: float = 1.0) -> FuzzReport:
    """Fuzz `endpoint` with `frames` hostile frames over `sockets` DEALERs while the bystanders
    run; returns what happened (see `FuzzReport.problems`)."""
    jobs = [Bystander(b.prompt, b.max_tokens, b.stream) for b in BYSTANDERS]
    with Client(endpoint, timeout_s=120) as client:  # results before the storm: the reference
        expected = [client.generate(j.prompt, max_tokens=j.max_tokens, ignore_eos=True).text for j in jobs]
    stop = threading.Event()
    threads = [threading.Thread(target=_bystander, args=(endpoint, j, e, stop), daemon=True)
               for j, e in zip(jobs, expected, strict=True)]
    tallies = [SocketTally() for _ in range(sockets)]
    per_socket = frames // sockets
    fuzzers = [threading.Thread(target=_fuzz_socket, args=(endpoint, seed + i, per_socket, t, settle_s), daemon=True)
               for i, t in enumerate(tallies)]
    started = time.monotonic()
    for t in threads + fuzzers:
        t.start()
    for t in fuzzers:
        t.join(600)
    stop.set()
    for t in threads:
        t.join(120)
    elapsed = time.monotonic() - started
    with Client(endpoint, timeout_s=120) as client:  # and after it: still the same answers
        for job, want in zip(jobs, expected, strict=True):
            got = client.generate(job.prompt, max_tokens=job.max_tokens, ignore_eos=True).text
            if got != want:
                job.failures.append(f"after the storm: {got!r} != {want!r}")
    codes: Counter = Counter()
    for t in tallies:
        codes.update(t.codes)
    sent = sum(t.sent for t in tallies)
    answered = sum(min(t.finals, t.sent) for t in tallies)  # per socket: extras never hide a miss
    extra = sum(max(0, t.finals - t.sent) for t in tallies)
    return FuzzReport(frames=sent, finals=answered, extra_finals=extra,
                      codes=dict(codes), undocumented=[u for t in tallies for u in t.undocumented],
                      bystander_requests=sum(j.done for j in jobs),
                      bystander_failures=[f for j in jobs for f in j.failures], daemon_up=alive(),
                      elapsed_s=elapsed)
