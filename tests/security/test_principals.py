"""Issue #29 item 1, black-box against a real `maced`: each app reaches only its own users (over
ZeroMQ with CURVE keys and over HTTP with API keys), two apps' "alice" are two people, the
operator reaches any app's users, and nothing names another app's users.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
import zmq.auth

from daemon.sdk import Client, RemoteError
from edge_runtime.feedback import FeedbackStore
from edge_runtime.lora import LoraSettings, LoraWeights
from edge_runtime.lora.adapter import write_adapter
from edge_runtime.model.config import ModelConfig
from tests.daemon.conftest import DaemonProcess, free_tcp_port, tiny_model  # noqa: F401 - fixture

KEYS = {"a": "app-a-key-0123456789abcdef", "b": "app-b-key-0123456789abcdef",
        "default": "default-key-0123456789abcd", "operator": "operator-key-0123456789ab"}
SECRET = "my PIN is 4321"
UIDS = {"a": 65533, "b": 65534}  # ipc peers known by uid (another uid in the socket's reach: the default app)


class Daemon:
    """One maced with apps a and b (CURVE keys and API keys each), a default-app key and an
    operator key, and state written before it started: A's alice has adapter v1; the store holds
    "dora", written before apps existed."""

    def __init__(self, root: Path, model: Path) -> None:
        certs, authorized = root / "certs", root / "authorized"
        certs.mkdir(parents=True)
        authorized.mkdir()
        zmq.auth.create_certificates(certs, "server")
        (certs / "server.key_secret").chmod(0o600)  # maced refuses a secret others can read
        self.server_public, _ = zmq.auth.load_certificate(certs / "server.key")
        self.curve: dict[str, tuple[bytes, bytes]] = {}
        for name in ("a", "b"):
            zmq.auth.create_certificates(certs, name)
            shutil.copy(certs / f"{name}.key", authorized / f"{name}.key")
            self.curve[name] = zmq.auth.load_certificate(certs / f"{name}.key_secret")  # type: ignore[assignment]
        self.tcp, self.http = f"tcp://127.0.0.1:{free_tcp_port()}", f"127.0.0.1:{free_tcp_port()}"
        config = root / "maced.toml"
        config.write_text(
            f'[server]\ntcp = "{self.tcp}"\ncurve_secret_key = "{certs / "server.key_secret"}"\n'
            f'curve_authorized_keys = "{authorized}"\n'
            f'[http]\napi_keys = "{KEYS["default"]}"\n[finetune]\nenabled = false\n'
            + "".join(f'[[apps]]\nname = "{n}"\napi_keys = ["{KEYS[n]}"]\n'
                      f'curve_keys = ["{self.curve[n][0].decode()}"]\nuids = [{UIDS[n]}]\n' for n in ("a", "b"))
            + f'[operator]\napi_keys = ["{KEYS["operator"]}"]\n')
        state = root / "state"
        _adapter(state / "adapters" / "a~alice" / "v1", ModelConfig.from_dir(model))
        store = FeedbackStore(state / "feedback.sqlite3")  # as a daemon before apps wrote it
        store.set_consent("dora", True)
        store.record_interaction("dora", "ix-0000000000000001", "dora's old prompt", ["an answer"], model="tiny")
        store.close()
        self.process = DaemonProcess(root, model, extra_args=["--config", str(config)],
                                     env={"MACE_HTTP_BIND": self.http})
        self.process.wait_ready()

    def app(self, name: str) -> Client:
        return Client(self.tcp, timeout_s=30.0, curve_server_key=self.server_public,
                      curve_client_keys=self.curve[name])

    def operator(self) -> Client:  # this test runs as the daemon's own uid: the operator over ipc
        return self.process.client()

    def get(self, key: str, path: str) -> tuple[int, Any]:
        return self._http("GET", key, path)

    def post(self, key: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        return self._http("POST", key, path, body)

    def delete(self, key: str, path: str) -> tuple[int, Any]:
        return self._http("DELETE", key, path)

    def _http(self, method: str, key: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://{self.http}{path}", data=data, method=method, headers={
            "Authorization": f"Bearer {KEYS[key]}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                raw = reply.read()
                status = reply.status
        except urllib.error.HTTPError as exc:
            raw, status = exc.read(), exc.code
        text = raw.decode()
        return status, (json.loads(text) if text.startswith(("{", "[")) else text)


def _adapter(folder: Path, cfg: ModelConfig) -> None:
    weights = LoraWeights.init(cfg, LoraSettings(rank=4), seed=1)
    gen = torch.Generator().manual_seed(1)
    for key, b in weights.b.items():
        weights.b[key] = torch.randn(b.shape, generator=gen) * 2.0
    folder.mkdir(parents=True)
    write_adapter(folder, weights)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Daemon]:  # noqa: F811
    d = Daemon(tmp_path_factory.mktemp("principals"), tiny_model)
    yield d
    code, _ = d.process.stop()
    assert code == 0, d.process.log()


def _code(call: Any) -> RemoteError:
    with pytest.raises(RemoteError) as info:
        call()
    return info.value


def test_over_zeromq_app_b_cannot_reach_app_a_s_alice(daemon: Daemon) -> None:
    with daemon.app("a") as a, daemon.app("b") as b:
        a.consent("alice")
        told = a.generate(SECRET, max_tokens=4, user="alice")
        assert told.recorded
        # B's "alice" is another person: nothing of A's alice is hers.
        assert _code(lambda: b.export("alice")).code == "unknown_user"
        assert _code(lambda: b.choose("alice", told.interaction_id, 0)).code in ("unknown_user", "unknown_request")
        assert b.consent("alice")["changed"]  # B's alice is new: her consent is hers
        b.consent("alice", granted=False)
        b.forget("alice")
        assert b.adapters() == [] and b.adapters("alice") == []
        assert _code(lambda: b.rollback("alice", 0)).code in ("adapter_unavailable", "not_supported")
        unavailable = _code(lambda: b.generate("hello", max_tokens=4, user="alice", adapter=1))
        assert unavailable.code == "adapter_unavailable" and "~" not in unavailable.message
        # Naming A outright is refused, saying who lacks what.
        refused = _code(lambda: b.request("users.export", {"user": "alice", "app": "a"}))
        assert refused.code == "forbidden" and "app 'b'" in refused.message and "alice" not in refused.message
        # A's alice still has everything, and her feedback goes in.
        held = json.dumps(a.export("alice"))
        assert SECRET in held and a.consent("alice")["changed"] is False  # still granted
        assert a.choose("alice", told.interaction_id, 0)["durable"]
        assert [(x["user"], x["version"]) for x in a.adapters()] == [("alice", 1)]
        assert a.generate("hello", max_tokens=4, user="alice", adapter=1).adapter == "alice@1"


def test_over_http_key_b_cannot_reach_key_a_s_users(daemon: Daemon) -> None:
    assert daemon.post("a", "/v1/users/carol/consent", {})[0] == 200
    status, done = daemon.post("a", "/v1/chat/completions", {
        "model": "default", "messages": [{"role": "user", "content": SECRET}], "max_tokens": 4, "user": "carol"})
    assert status == 200
    status, exported = daemon.get("b", "/v1/users/carol/export")
    assert status == 404 and SECRET not in json.dumps(exported)
    assert daemon.post("b", "/v1/feedback", {"id": done["id"], "user": "carol", "kind": "choice",
                                             "chosen": 0})[0] == 404
    assert daemon.post("b", "/v1/users/carol/consent", {"granted": False})[0] == 200
    assert daemon.delete("b", "/v1/users/carol")[0] in (200, 404)
    assert daemon.get("b", "/v1/users/alice/adapters") == (200, {"object": "list", "data": []})
    status, refused = daemon.get("b", "/v1/users/carol/export?app=a")
    assert status == 403 and refused["error"]["code"] == "forbidden"
    status, exported = daemon.get("a", "/v1/users/carol/export")
    assert status == 200 and SECRET in json.dumps(exported) and exported["user"] == "carol"
    assert "a~" not in json.dumps(exported)
    adapters = daemon.get("a", "/v1/users/alice/adapters")[1]["data"]
    assert [(x["user"], x["version"]) for x in adapters] == [("alice", 1)]


def test_the_operator_exports_and_erases_any_app_s_user(daemon: Daemon) -> None:
    with daemon.app("a") as a, daemon.operator() as op:
        a.consent("erin")
        a.generate(SECRET, max_tokens=4, user="erin")
        assert _code(lambda: op.export("erin")).code == "unknown_user"  # the default app's erin
        assert SECRET in json.dumps(op.request("users.export", {"user": "erin", "app": "a"}))
        status, exported = daemon.get("operator", "/v1/users/erin/export?app=a")
        assert status == 200 and SECRET in json.dumps(exported)
        op.request("users.forget", {"user": "erin", "app": "a"})
        assert _code(lambda: a.export("erin")).code == "unknown_user"
        users = {x["user"] for x in op.adapters()}
        assert "a~alice" in users  # the operator's whole view names users by stored id


def test_fleet_administration_is_the_operator_s(daemon: Daemon, tmp_path: Path) -> None:
    with daemon.app("b") as b:
        refused = _code(lambda: b.fleet_publish(str(tmp_path)))
        assert refused.code == "forbidden" and "lacks the right to publish fleet adapters" in refused.message
        assert _code(lambda: b.fleet_rollback(None)).code == "forbidden"
        assert "current" not in json.dumps(b.status()["finetune"].get("current") or {})


def test_data_from_before_apps_is_the_default_app_s(daemon: Daemon) -> None:
    status, exported = daemon.get("default", "/v1/users/dora/export")
    assert status == 200 and "dora's old prompt" in json.dumps(exported)
    assert daemon.get("a", "/v1/users/dora/export")[0] == 404
    with daemon.operator() as op:
        assert "dora's old prompt" in json.dumps(op.export("dora"))


def test_metrics_and_status_name_no_user(daemon: Daemon) -> None:
    status, text = daemon.get("b", "/metrics")
    assert status == 200 and "alice" not in text and 'user="' not in text
    status, text = daemon.get("operator", "/metrics")
    assert 'mace_adapter_active_users{app="a"} 1.0' in text and "alice" not in text
    with daemon.app("b") as b:
        assert "alice" not in json.dumps(b.status())


def _as_uid(daemon: Daemon, uid: int, op: str, fields: dict[str, Any]) -> tuple[str, str]:
    """(error code or "ok", message) of one request sent over ipc by a process running as `uid`:
    a forked child (the interpreter lives where other uids cannot run it) with its own context."""
    os.chmod(daemon.process.run_dir, 0o755)  # the test's stand-in for the socket's group
    os.chmod(daemon.process.socket, 0o666)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            os.setgid(uid)
            os.setuid(uid)
            with Client(daemon.process.endpoint, timeout_s=30.0, retries=0, context=zmq.Context()) as c:
                c.request(op, fields)
            answer = ["ok", ""]
        except RemoteError as exc:
            answer = [exc.code, exc.message]
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            answer = ["child_failed", repr(exc)]
        os.write(write, json.dumps(answer).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    code, message = json.loads(text)
    return code, message


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as other uids")
def test_an_ipc_peer_is_known_by_its_uid(daemon: Daemon) -> None:
    with daemon.app("a") as a:
        a.consent("gina")
        a.generate(SECRET, max_tokens=4, user="gina")
    assert _as_uid(daemon, UIDS["a"], "users.export", {"user": "gina"})[0] == "ok"
    assert _as_uid(daemon, UIDS["b"], "users.export", {"user": "gina"})[0] == "unknown_user"
    code, message = _as_uid(daemon, UIDS["b"], "fleet.rollback", {})
    assert code == "forbidden" and message == "app 'b' (uid 65534) lacks the right to roll back the fleet adapter"
    # Any other uid that can open the socket is the default app: today's keyless use.
    assert _as_uid(daemon, 65532, "users.export", {"user": "dora"})[0] == "ok"
    assert _as_uid(daemon, 65532, "users.export", {"user": "gina", "app": "a"})[0] == "forbidden"


def test_the_official_openai_client_works_with_an_app_key_and_reaches_only_its_users(daemon: Daemon) -> None:
    import openai
    a = openai.OpenAI(base_url=f"http://{daemon.http}/v1", api_key=KEYS["a"], max_retries=0, timeout=60)
    b = openai.OpenAI(base_url=f"http://{daemon.http}/v1", api_key=KEYS["b"], max_retries=0, timeout=60)
    a.post("/users/hana/consent", body={}, cast_to=object)
    streamed = a.chat.completions.create(model="default", messages=[{"role": "user", "content": SECRET}],
                                         max_tokens=4, user="hana", stream=True)
    assert [c for c in streamed]
    done = a.chat.completions.create(model="default", messages=[{"role": "user", "content": SECRET}],
                                     max_tokens=4, user="hana")
    assert done.model_extra["mace"]["recorded"] is True
    assert SECRET in json.dumps(a.get("/users/hana/export", cast_to=object))
    with pytest.raises(openai.NotFoundError):
        b.get("/users/hana/export", cast_to=object)
    with pytest.raises(openai.PermissionDeniedError) as info:
        b.get("/users/hana/export?app=a", cast_to=object)
    assert "lacks the right" in str(info.value) and "hana" not in str(info.value)
