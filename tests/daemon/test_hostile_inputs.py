"""The inputs an outside client used against a real `maced` (issue 21), replayed over ZeroMQ and
HTTP: legal sampling extremes that used to crash the engine step (and, three in a row, the
daemon), user ids with a trailing newline, and a REQ client's malformed multi-frame body."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from daemon.sdk import RemoteError
from tests.daemon.conftest import DaemonProcess, free_tcp_port

PROMPT = "Tell me a story about a lighthouse"
EXTREMES = [{"temperature": 1e-39}, {"temperature": 5e-324}, {"temperature": 1.0, "top_p": 1e-300},
            {"temperature": 100.0, "top_p": 5e-324}, {"temperature": 1e-300, "top_p": 5e-324, "top_k": 1}]


class HttpDaemon:
    def __init__(self, daemon: DaemonProcess, port: int) -> None:
        self.daemon = daemon
        self.port = port

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[HttpDaemon]:
    port = free_tcp_port()
    d = DaemonProcess(tmp_path_factory.mktemp("hostile"), tiny_model,
                      extra_args=["--http", f"127.0.0.1:{port}", "--set", "server.max_inflight_per_client=64",
                                  "--set", "finetune.enabled=false"])
    d.wait_ready()
    yield HttpDaemon(d, port)
    code, _ = d.stop()
    assert code == 0, d.log()


def test_sampling_extremes_get_the_greedy_result_over_zeromq_and_the_daemon_keeps_serving(daemon: HttpDaemon) -> None:
    with daemon.daemon.client() as c:
        greedy = c.generate(PROMPT, max_tokens=12, ignore_eos=True).text
        for _ in range(3):  # three in a row used to make maced exit with status 1
            for extreme in EXTREMES:
                assert c.generate(PROMPT, max_tokens=12, ignore_eos=True, seed=3, **extreme).text == greedy
    assert daemon.daemon.proc.poll() is None


def test_twenty_pipelined_extreme_requests_each_get_one_reply_beside_another_clients_stream(daemon: HttpDaemon) -> None:
    with daemon.daemon.client() as c:
        greedy = c.generate(PROMPT, max_tokens=12, ignore_eos=True).text
        reference = c.generate("A bystander's question", max_tokens=40, ignore_eos=True).text
    bystander: list[str] = []

    def other_client() -> None:
        with daemon.daemon.client() as c:
            bystander.append(c.generate("A bystander's question", max_tokens=40, ignore_eos=True).text)

    other = threading.Thread(target=other_client)
    other.start()
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(daemon.daemon.endpoint)
        for i in range(20):
            sock.send(msgpack.packb({"v": 1, "id": f"x{i}", "op": "generate", "prompt": PROMPT, "max_tokens": 12,
                                     "ignore_eos": True, "temperature": 1e-39, "stream": i % 2 == 0}))
        finals: dict[str, dict] = {}
        while len(finals) < 20 and sock.poll(30_000):
            reply = msgpack.unpackb(sock.recv_multipart()[-1])
            if reply["type"] != "token":
                assert reply["id"] not in finals, "two final replies for one request"
                finals[reply["id"]] = reply
        assert not sock.poll(300), "a reply after every request had its final one"
    other.join(60)
    assert sorted(finals) == sorted(f"x{i}" for i in range(20))
    assert all(r["type"] == "result" and r["result"]["candidates"][0]["text"] == greedy for r in finals.values())
    assert bystander == [reference]


def test_sampling_extremes_over_http_get_the_greedy_result(daemon: HttpDaemon) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    status, greedy = daemon.post("/v1/completions", body)
    assert status == 200
    for _ in range(3):  # was 500, 500, 503, then the daemon was gone
        for extreme in EXTREMES:
            status, reply = daemon.post("/v1/completions", {**body, **{k: v for k, v in extreme.items() if k != "top_k"}})
            assert status == 200, reply
            assert reply["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert daemon.daemon.proc.poll() is None


def test_a_user_id_with_a_trailing_newline_is_refused_over_zeromq_and_http(daemon: HttpDaemon) -> None:
    with daemon.daemon.client() as c:
        with pytest.raises(RemoteError) as info:
            c.consent("nl\n")
        assert info.value.code == "bad_request"
    status, reply = daemon.post("/v1/users/web%0A/consent", {"granted": True})
    assert status == 400, reply
    adapters = daemon.daemon.state_dir / "adapters"
    assert not any("\n" in p.name for p in adapters.rglob("*")) if adapters.exists() else True


def test_a_req_client_sending_a_multi_frame_body_gets_bad_message(daemon: HttpDaemon) -> None:
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.REQ) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(daemon.daemon.endpoint)
        body = msgpack.packb({"v": 1, "id": "r", "op": "health"})
        sock.send_multipart([body, body])
        assert sock.poll(10_000), "the REQ client never got its reply"
        reply = msgpack.unpackb(sock.recv())
        assert reply["type"] == "error" and reply["error"]["code"] == "bad_message"
        sock.send(body)  # the REQ socket is usable again
        assert sock.poll(10_000) and msgpack.unpackb(sock.recv())["type"] == "result"
