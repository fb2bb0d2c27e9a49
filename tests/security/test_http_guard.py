"""A hostile web page against a real keyless loopback `maced` (tiny model): DNS rebinding (a
foreign Host) and cross-site writes (text/plain bodies, foreign Origin, Sec-Fetch-Site) are
refused; the gateway's own clients and CORS-allowed pages still work."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.conftest import DaemonProcess, free_tcp_port, tiny_model  # noqa: F401 - fixture


class Http:
    def __init__(self, port: int) -> None:
        self.port = port

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            response = conn.getresponse()
            raw = response.read()
        finally:
            conn.close()
        return response.status, json.loads(raw) if raw else {}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Http]:  # noqa: F811
    port = free_tcp_port()
    daemon = DaemonProcess(tmp_path_factory.mktemp("guard"), tiny_model,
                           extra_args=["--http", f"127.0.0.1:{port}", "--set", "finetune.enabled=false",
                                       "--set", "http.allowed_hosts=mace.lan",
                                       "--set", "http.cors_origins=https://app.example.com"])
    daemon.wait_ready()
    yield Http(port)
    daemon.stop()


CONSENT = json.dumps({"granted": True}).encode()


def test_a_rebound_host_is_refused(gateway: Http) -> None:
    status, body = gateway.request("GET", "/v1/users/alice/export", headers={"Host": "evil.example:8000"})
    assert status == 421 and body["error"]["code"] == "host_not_allowed", body
    status, body = gateway.request("DELETE", "/v1/users/alice", headers={"Host": "attacker.test"})
    assert status == 421, body
    for host in ("localhost:1234", "127.0.0.1", "[::1]:8000", "mace.lan:8000", "LOCALHOST"):
        status, body = gateway.request("GET", "/health", headers={"Host": host})
        assert status == 200, (host, body)


def test_a_cross_site_text_plain_post_is_refused(gateway: Http) -> None:
    # What a page's <form> or no-cors fetch sends: no preflight, text/plain, the page's Origin.
    status, body = gateway.request("POST", "/v1/users/bob/consent", CONSENT,
                                   {"Content-Type": "text/plain", "Origin": "https://evil.example",
                                    "Sec-Fetch-Site": "cross-site"})
    assert status == 403 and body["error"]["code"] == "cross_site", body
    # Even without Origin / Sec-Fetch-Site (an old browser), text/plain is not JSON.
    status, body = gateway.request("POST", "/v1/users/bob/consent", CONSENT, {"Content-Type": "text/plain"})
    assert status == 415 and body["error"]["code"] == "unsupported_media_type", body
    status, body = gateway.request("POST", "/v1/completions", b'{"prompt": "x", "max_tokens": 1}',
                                   {"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 415, body
    status, body = gateway.request("DELETE", "/v1/users/bob", None,
                                   {"Origin": "null", "Sec-Fetch-Site": "cross-site"})
    assert status == 403, body


def test_own_clients_and_allowed_pages_still_write(gateway: Http) -> None:
    json_type = {"Content-Type": "application/json"}
    status, body = gateway.request("POST", "/v1/users/carol/consent", CONSENT, json_type)
    assert status == 200, body
    for origin in ("https://app.example.com", "http://localhost:3000"):
        status, body = gateway.request("POST", "/v1/users/carol/consent", CONSENT,
                                       {**json_type, "Origin": origin, "Sec-Fetch-Site": "cross-site"})
        assert status == 200, (origin, body)
    status, body = gateway.request("POST", "/v1/users/carol/consent", CONSENT,
                                   {"Content-Type": "application/json; charset=utf-8",
                                    "Sec-Fetch-Site": "same-origin"})
    assert status == 200, body
    status, body = gateway.request("DELETE", "/v1/users/carol")
    assert status == 200, body
