"""End to end on the real default model: 32 concurrent SDK clients stream, users give feedback,
`macectl status --json` shows it stored and a new adapter version trained from it, and SIGTERM
exits 0 within 10 s without losing any acknowledged feedback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from daemon.sdk import Client, RemoteError
from edge_runtime.feedback import FeedbackStore
from tests.daemon.conftest import REPO

CLIENTS = 32
USERS = [f"user{i}" for i in range(4)]


def macectl_status(endpoint: str) -> dict:
    run = subprocess.run([sys.executable, "-m", "daemon.sdk.cli", "--endpoint", endpoint, "status", "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=60, env=os.environ.copy())
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_default_model_end_to_end(start_daemon, default_model_dir) -> None:
    # One torch thread: on a small shared CPU box, OpenMP workers that spin while preempted make
    # every iteration many times slower (tools/results/loadgen-threads2.md).
    d = start_daemon(model=str(default_model_dir), engine_flags=["--set", "engine.num_threads=1"], extra_args=[
        "--set", "finetune.pairs_per_version=2",
        "--set", "feedback.heldout_fraction=0.0"], ready=False)
    d.wait_ready(timeout_s=300)
    with d.client() as c:
        for user in USERS:
            c.consent(user)

    # 1. 32 clients stream at once; a user's requests ask for two candidates to choose from.
    outcomes: list[tuple[str | None, object]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(CLIENTS)

    def one_client(i: int) -> None:
        user = USERS[i % len(USERS)] if i % 2 == 0 else None
        try:
            with Client(d.endpoint, timeout_s=300) as c:
                barrier.wait()
                stream = c.stream(messages=[{"role": "user", "content": f"Give me tip number {i} for cooking."}],
                                  max_tokens=8, n=2 if user else 1, temperature=0.9 if user else 0.0,
                                  seed=i, user=user)
                pieces: dict[int, str] = {}
                for token in stream:
                    pieces[token.index] = pieces.get(token.index, "") + token.text
                result = stream.result
                assert result is not None
                for cand in result.candidates:
                    assert pieces.get(cand.index, "") == cand.text
                    assert cand.finish_reason in ("stop", "length")
                outcomes.append((user, result))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one_client, args=(i,)) for i in range(CLIENTS)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[:3]
    assert len(outcomes) == CLIENTS
    streamed_s = time.monotonic() - t0

    # 2. Feedback on every recorded interaction; each ack means committed.
    acked: dict[str, list[str]] = {u: [] for u in USERS}
    with d.client() as c:
        for user, result in outcomes:
            if user is None:
                assert not result.recorded
                continue
            assert result.recorded and len(result.candidates) == 2
            ack = c.choose(user, result.interaction_id, 1)
            assert ack["durable"] is True
            acked[user].append(result.interaction_id)
    total_acked = sum(len(v) for v in acked.values())
    assert total_acked == CLIENTS // 2

    status = macectl_status(d.endpoint)
    assert status["feedback"]["feedback"] == total_acked
    assert status["feedback"]["interactions"] == total_acked
    assert status["model"]["model"] == "smollm2-135m-instruct"

    # 3. The engine packs the pairs' DPO stages into its iterations; a new adapter version is published.
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        status = macectl_status(d.endpoint)
        # The engine's own counters are a snapshot refreshed every half second: wait for both.
        if status["finetune"]["versions_published"] >= 1 and status["adapters"]["versions_served"] >= 1:
            break
        time.sleep(2)
    assert status["finetune"]["versions_published"] >= 1, status["finetune"]
    assert status["adapters"]["versions_served"] >= 1
    with d.client() as c:
        adapters = c.adapters()
        trained_user = adapters[0]["user"]
        active = max(a["version"] for a in adapters if a["user"] == trained_user and a["active"])
        # The trainer may publish again between the listing and the call: the request
        # must get the newest version at its admission, which is at least the one listed active.
        served = c.generate("Hi", max_tokens=2, user=trained_user).adapter
        name, _, version = (served or "").partition("@")
        assert name == trained_user and int(version) >= active >= 1, (served, adapters)
        assert int(version) in {a["version"] for a in c.adapters(trained_user)}

    # 4. SIGTERM with streams in flight: exit 0 within 10 s, every acknowledged feedback kept.
    interrupted: list[str] = []

    def long_stream() -> None:
        with Client(d.endpoint, timeout_s=60) as c:
            try:
                for _ in c.stream("Tell a long story.", max_tokens=4000, ignore_eos=True):
                    pass
                interrupted.append("finished")
            except RemoteError as exc:
                interrupted.append(exc.code)

    streams = [threading.Thread(target=long_stream) for _ in range(4)]
    for t in streams:
        t.start()
    time.sleep(2)
    code, took = d.stop()
    for t in streams:
        t.join(30)
    assert code == 0 and took < 10, (code, took, d.log()[-2000:])
    assert sorted(interrupted) == ["shutting_down"] * 4
    with FeedbackStore(d.state_dir / "feedback.sqlite3") as store:
        for user, ids in acked.items():
            exported = store.export_user(user)
            stored = {i["request_id"] for i in exported["interactions"] if i["feedback"]}
            assert stored == set(ids), user
    print(f"\ne2e: {CLIENTS} concurrent streams in {streamed_s:.1f} s, {total_acked} feedback acknowledged, "
          f"adapter versions published: {status['finetune']['versions_published']}, SIGTERM exit in {took:.2f} s")
