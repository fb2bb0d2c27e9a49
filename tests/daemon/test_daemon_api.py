"""The API of a real `maced` process on the tiny model, through the SDK and raw sockets."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from daemon.sdk import AsyncClient, Client, RemoteError
from tests.daemon.conftest import REPO, DaemonProcess


def raw_request(endpoint: str, message: dict, *, socket_type: int = zmq.DEALER) -> dict:
    ctx = zmq.Context.instance()
    with ctx.socket(socket_type) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send(msgpack.packb(message))
        assert sock.poll(10_000), "no reply"
        return msgpack.unpackb(sock.recv())


def test_health_and_status_describe_the_daemon(shared_daemon: DaemonProcess) -> None:
    with shared_daemon.client() as c:
        health = c.health()
        assert (health["ok"], health["state"], health["model"]) == (True, "serving", "tiny")
        status = c.status()
    assert status["daemon"]["protocol"] == 1 and status["daemon"]["endpoints"] == [shared_daemon.endpoint]
    assert status["model"]["backend"] == "torch" and status["model"]["weights_bytes"] > 0
    assert status["memory"]["ledger"]["kv_cache"] == 8 << 20
    assert status["admission"]["state"] in ("normal", "shed_finetune")
    assert status["feedback"]["open"] is True
    assert status["finetune"]["available"] is True and status["finetune"]["trainer"] == "engine"


def test_generate_whole_with_n_candidates(shared_daemon: DaemonProcess) -> None:
    with shared_daemon.client() as c:
        result = c.generate("Tell me a story", max_tokens=5, n=3, temperature=1.0, seed=7, ignore_eos=True)
    assert [cand.index for cand in result.candidates] == [0, 1, 2]
    assert all(cand.completion_tokens == 5 and cand.finish_reason == "length" for cand in result.candidates)
    assert result.interaction_id.startswith("ix-") and result.usage["completion_tokens"] == 15
    assert result.recorded is False  # no user given


def test_greedy_stream_matches_whole_generation(shared_daemon: DaemonProcess) -> None:
    with shared_daemon.client() as c:
        whole = c.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=12, ignore_eos=True)
        stream = c.stream(messages=[{"role": "user", "content": "hi"}], max_tokens=12, ignore_eos=True)
        tokens = list(stream)
    assert "".join(t.text for t in tokens) == whole.text == stream.result.text
    assert stream.result.candidates[0].completion_tokens == 12


def test_invalid_requests_get_typed_errors_and_the_daemon_keeps_serving(shared_daemon: DaemonProcess) -> None:
    ep = shared_daemon.endpoint
    cases = [
        ({"v": 1, "id": "a", "op": "frobnicate"}, "unknown_op"),
        ({"v": 9, "id": "a", "op": "status"}, "unsupported_version"),
        ({"v": 1, "id": "a", "op": "generate", "prompt": "hi", "temperature": -1}, "bad_request"),
        ({"v": 1, "id": "a", "op": "generate", "prompt": "x" * 300_000}, "bad_request"),
        ({"v": 1, "id": "a", "op": "generate", "prompt": "hi", "adapter": 2, "user": "bob"}, "adapter_unavailable"),
        ({"v": 1, "id": "a", "op": "adapters.rollback", "user": "bob", "version": 1}, "adapter_unavailable"),
        ({"v": 1, "id": "a", "op": "feedback", "user": "nobody", "interaction_id": "ix-1",
          "feedback": {"kind": "choice", "chosen": 0}}, "unknown_user"),
        ({"v": 1, "id": "a", "op": "feedback", "user": "nobody", "interaction_id": "ix-1",
          "feedback": {"kind": "stars", "n": 5}}, "bad_request"),
        ({"v": 1, "id": "a", "op": "users.forget", "user": "never-seen"}, "unknown_user"),
    ]
    for message, code in cases:
        reply = raw_request(ep, message)
        assert reply["type"] == "error" and reply["id"] == "a", reply
        assert reply["error"]["code"] == code, reply
        assert reply["error"]["message"]
    with shared_daemon.client() as c:
        assert c.generate("still there?", max_tokens=2).candidates


def test_req_sockets_can_call_simple_ops(shared_daemon: DaemonProcess) -> None:
    reply = raw_request(shared_daemon.endpoint, {"v": 1, "id": 42, "op": "health"}, socket_type=zmq.REQ)
    assert reply["id"] == 42 and reply["type"] == "result" and reply["result"]["ok"] is True


def test_cancel_stops_a_stream_with_its_partial_text(shared_daemon: DaemonProcess) -> None:
    with shared_daemon.client() as c:
        stream = c.stream("count forever", max_tokens=100_000, ignore_eos=True)
        got = []
        with pytest.raises(RemoteError) as info:
            for token in stream:
                got.append(token.text)
                if len(got) == 3:
                    assert stream.cancel() is True
        assert info.value.code == "cancelled"
        partial = info.value.details["partial"][0]
        assert partial["finish_reason"] == "abort" and partial["text"].startswith("".join(got))


def test_server_side_timeout_ends_a_long_generation(shared_daemon: DaemonProcess) -> None:
    with shared_daemon.client() as c:
        with pytest.raises(RemoteError) as info:
            c.request("generate", {"prompt": "go on", "max_tokens": 100_000, "ignore_eos": True,
                                   "timeout_s": 0.3}, timeout_s=10)
    assert info.value.code == "timeout" and info.value.details["partial"]


def test_duplicate_in_flight_id_is_refused(shared_daemon: DaemonProcess) -> None:
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(shared_daemon.endpoint)
        long = {"v": 1, "id": "same", "op": "generate", "prompt": "x", "max_tokens": 100_000,
                "ignore_eos": True, "timeout_s": 0.25}  # far below the ~2047 tokens the context allows
        sock.send(msgpack.packb(long))
        sock.send(msgpack.packb(long))
        first = msgpack.unpackb(sock.recv()) if sock.poll(10_000) else None
        assert first == {"v": 1, "id": "same", "type": "error",
                         "error": {"code": "duplicate_id", "message": first["error"]["message"]}}
        final = msgpack.unpackb(sock.recv()) if sock.poll(10_000) else None
        assert final.get("error", {}).get("code") == "timeout", final  # the original still gets its one final reply


def test_per_client_in_flight_limit_answers_busy(shared_daemon: DaemonProcess) -> None:
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(shared_daemon.endpoint)
        for i in range(17):  # the shared daemon allows 16 per client
            sock.send(msgpack.packb({"v": 1, "id": i, "op": "generate", "prompt": "x", "max_tokens": 100_000,
                                     "ignore_eos": True, "timeout_s": 1.0}))
        replies = []
        while len(replies) < 17 and sock.poll(15_000):
            replies.append(msgpack.unpackb(sock.recv()))
    codes = sorted(r["error"]["code"] for r in replies)
    assert codes == ["busy"] + ["timeout"] * 16
    assert len({r["id"] for r in replies}) == 17  # exactly one final reply each


def test_consent_record_feedback_export_forget(shared_daemon: DaemonProcess) -> None:
    with shared_daemon.client() as c:
        without = c.generate("hello", max_tokens=3, user="carol")
        assert without.recorded is False and "consent" in without.raw["record_note"]
        assert c.consent("carol")["granted"] is True
        # Seeded, so the recorded answers are the same on every run and device.
        result = c.generate("Which is better?", max_tokens=4, n=2, temperature=1.0, seed=11, user="carol")
        assert result.recorded is True
        ack = c.choose("carol", result.interaction_id, 1)
        assert ack["durable"] is True and len(ack["pair_ids"]) == 1
        with pytest.raises(RemoteError) as info:
            c.choose("carol", result.interaction_id, 0)
        assert info.value.code == "duplicate_feedback"
        assert c.rate("carol", result.interaction_id, 5, candidate=0)["feedback_id"]
        exported = c.export("carol")
        assert exported["user_id"] == "carol"
        assert [i["request_id"] for i in exported["interactions"]] == [result.interaction_id]
        status = c.status()["feedback"]
        assert status["interactions"] >= 1 and status["pairs_pending"] + status["pairs_heldout"] >= 1
        erased = c.forget("carol")
        assert erased["interactions"] == 1 and erased["feedback"] == 2
        with pytest.raises(RemoteError) as info:
            c.export("carol")
        assert info.value.code == "unknown_user"


def test_adapters_list_is_empty_while_nobody_was_trained(shared_daemon: DaemonProcess) -> None:
    with shared_daemon.client() as c:
        assert c.adapters() == [] and c.adapters("carol") == []
        assert c.status()["finetune"]["enabled"] is False  # the shared daemon does not train


def test_async_client_runs_many_streams_at_once(shared_daemon: DaemonProcess) -> None:
    async def one(client: AsyncClient, i: int) -> str:
        stream = await client.stream(f"prompt {i}", max_tokens=8, ignore_eos=True)
        text = await stream.text()
        assert stream.result is not None and stream.result.text == text
        return text

    async def main() -> list[str]:
        async with AsyncClient(shared_daemon.endpoint, timeout_s=30) as client:
            texts = await asyncio.gather(*(one(client, i) for i in range(12)))
            assert (await client.health())["ok"]
            return texts

    texts = asyncio.run(main())
    assert len(texts) == 12 and all(texts)


def test_a_client_that_disconnects_mid_stream_gets_its_work_cancelled(shared_daemon: DaemonProcess) -> None:
    c = shared_daemon.client()
    stream = c.stream("never read", max_tokens=100_000, ignore_eos=True)
    c._sock.close(linger=0)  # vanish without cancelling, as a crashed app would
    deadline = time.monotonic() + 20
    with shared_daemon.client() as observer:
        while time.monotonic() < deadline:
            if observer.status()["queues"]["generates_in_flight"] == 0:
                break
            time.sleep(0.2)
        assert observer.status()["queues"]["generates_in_flight"] == 0
    del stream


def test_client_reports_an_absent_daemon_quickly(tmp_path) -> None:
    start = time.monotonic()
    with Client(f"ipc://{tmp_path}/nobody.sock", timeout_s=1, connect_timeout_s=0.5, retries=1) as c:
        with pytest.raises(Exception) as info:
            c.status()
    assert type(info.value).__name__ == "DaemonUnavailable" and time.monotonic() - start < 5


def test_importing_the_sdk_does_not_import_torch() -> None:
    code = ("import sys, daemon.sdk; heavy = [m for m in ('torch', 'transformers', 'edge_runtime') "
            "if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
