"""The OpenAI-compatible HTTP gateway of a real `maced` process (tiny model), driven with the
official `openai` client: it must be the same daemon the SDK talks to (same generations, same
feedback store, same adapters, same admission control), only spoken to in OpenAI's dialect."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon.sdk import Client
from tests.daemon.conftest import REPO, DaemonProcess, free_tcp_port, wait_for

KEY = "test-key-0123456789abcdef"
CHAT = [{"role": "user", "content": "Say something"}]
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


class Gateway:
    """One daemon with its HTTP gateway: the openai client, raw HTTP, and the SDK beside it."""

    def __init__(self, daemon: DaemonProcess, port: int, key: str | None) -> None:
        self.daemon = daemon
        self.port = port
        self.key = key
        self.base_url = f"http://127.0.0.1:{port}/v1"

    def openai(self, **kwargs: Any) -> Any:
        kwargs.setdefault("api_key", self.key or "unused")
        return openai.OpenAI(base_url=self.base_url, max_retries=0, timeout=60, **kwargs)

    def get(self, path: str, *, auth: bool = True) -> tuple[int, dict[str, str], bytes]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}")
        if auth and self.key:
            request.add_header("Authorization", f"Bearer {self.key}")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        status, _, body = self.get("/metrics")
        assert status == 200
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def start_gateway(root: Path, tiny_model: Path, *, key: str | None = KEY, extra: list[str] | None = None,
                  env: dict[str, str] | None = None) -> Gateway:
    port = free_tcp_port()
    env = dict(env or {})
    if key:
        env["MACE_HTTP_API_KEYS"] = key
    daemon = DaemonProcess(root, tiny_model, extra_args=["--http", f"127.0.0.1:{port}", *(extra or [])],
                           env=env)
    daemon.wait_ready()
    return Gateway(daemon, port, key)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Gateway]:
    """One daemon with API keys and a fast fine-tuner, shared by the tests that do not stop it."""
    g = start_gateway(tmp_path_factory.mktemp("gateway"), tiny_model,
                      extra=["--set", "finetune.pairs_per_version=2", "--set", "finetune.idle_s=0.2",
                             "--set", "feedback.heldout_fraction=0.0"])
    yield g
    code, _ = g.daemon.stop()
    assert code == 0, g.daemon.log()


def test_models_health_and_auth(gw: Gateway) -> None:
    client = gw.openai()
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").owned_by == "mace-edge"
    status, _, body = gw.get("/health", auth=False)  # liveness needs no key
    assert status == 200 and json.loads(body)["state"] == "serving"
    with pytest.raises(openai.AuthenticationError) as info:
        gw.openai(api_key="wrong-key-0123456789").models.list()
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    status, _, body = gw.get("/metrics", auth=False)
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"


def test_chat_completion_is_the_sdk_generation(gw: Gateway) -> None:
    completion = gw.openai().chat.completions.create(model="tiny", messages=CHAT, max_tokens=8,
                                                      temperature=0, extra_body={"ignore_eos": True})
    choice = completion.choices[0]
    assert completion.object == "chat.completion" and completion.model == "tiny"
    assert completion.id.startswith("ix-") and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and completion.usage.completion_tokens == 8
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 8
    with Client(gw.daemon.endpoint, timeout_s=30) as sdk:
        same = sdk.generate(messages=CHAT, max_tokens=8, ignore_eos=True)
    assert choice.message.content == same.text  # greedy: the same engine, the same tokens
    assert completion.model_extra["mace"]["adapter"] is None  # no user: the base model


def test_chat_stream_matches_the_whole_reply_and_reports_usage(gw: Gateway) -> None:
    client = gw.openai()
    whole = client.chat.completions.create(model="default", messages=CHAT, max_tokens=10, temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("ix-")


def test_completions_n_seed_stop_and_streamed_candidates(gw: Gateway) -> None:
    client = gw.openai()
    kwargs = dict(model="tiny", prompt="Once upon a time", n=2, temperature=1.0, seed=5, max_tokens=6,
                  extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert first.object == "text_completion" and [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded
    assert all(c.finish_reason == "length" for c in first.choices) and first.usage.completion_tokens == 12

    streamed: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, str] = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert streamed == {c.index: c.text for c in first.choices} and finish == {0: "length", 1: "length"}

    greedy = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12,
                                       temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    stop = next(greedy[k:k + 2] for k in range(len(greedy) // 2, len(greedy) - 1) if greedy[k:k + 2].strip())
    stopped = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12,
                                        temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert stopped.choices[0].text == greedy[:greedy.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_n2_feedback_through_the_extension_is_stored_like_sdk_feedback(gw: Gateway) -> None:
    client = gw.openai()
    consent = client.post("/users/hana/consent", body={"granted": True}, cast_to=object)
    assert consent["granted"] is True
    completion = client.chat.completions.create(model="tiny", messages=CHAT, n=2, temperature=1.0,
                                                max_tokens=5, user="hana")
    assert len(completion.choices) == 2 and completion.model_extra["mace"]["recorded"] is True
    ack = client.post("/feedback", cast_to=object,
                      body={"id": completion.id, "user": "hana", "kind": "choice", "chosen": 1})
    assert ack["durable"] is True and len(ack["pair_ids"]) == 1 and ack["completion_id"] == completion.id
    rated = client.post("/feedback", cast_to=object, body={"id": completion.id, "user": "hana",
                                                           "kind": "rating", "candidate": 0, "stars": 2})
    assert rated["durable"] is True

    with pytest.raises(openai.ConflictError) as dup:  # the same feedback twice: the first one stands
        client.post("/feedback", cast_to=object,
                    body={"id": completion.id, "user": "hana", "kind": "choice", "chosen": 1})
    assert dup.value.code == "duplicate_feedback"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.post("/feedback", cast_to=object, body={"id": "ix-0000", "user": "hana", "kind": "choice",
                                                       "chosen": 0})
    assert unknown.value.code == "unknown_request"
    with pytest.raises(openai.BadRequestError) as bad:
        client.post("/feedback", cast_to=object, body={"id": completion.id, "user": "hana", "kind": "stars"})
    assert bad.value.code == "bad_request"

    with Client(gw.daemon.endpoint, timeout_s=30) as sdk:  # the same feedback through the SDK
        native = sdk.generate(messages=CHAT, n=2, temperature=1.0, max_tokens=5, user="hana")
        sdk_ack = sdk.choose("hana", native.interaction_id, 1)
        sdk.rate("hana", native.interaction_id, 2, candidate=0)
        exported = sdk.export("hana")
    assert len(sdk_ack["pair_ids"]) == 1
    by_id = {i["request_id"]: i for i in exported["interactions"]}
    via_http, via_sdk = by_id[completion.id], by_id[native.interaction_id]
    assert [c["text"] for c in via_http["candidates"]] == [c.message.content for c in completion.choices]

    def shape(feedback: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in f.items() if k != "created_at"} for f in feedback]

    assert shape(via_http["feedback"]) == shape(via_sdk["feedback"]) and len(via_http["feedback"]) == 2
    sources = [p["from_request_ids"] for p in exported["preference_pairs"]]
    assert [completion.id] in sources and [native.interaction_id] in sources


def test_a_trained_user_gets_their_adapter_on_the_next_call(gw: Gateway) -> None:
    client = gw.openai()
    client.post("/users/ivy/consent", body={}, cast_to=object)
    for prompt in ("Say hi", "Say bye"):
        completion = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], n=2, temperature=1.0, seed=3,
            max_tokens=6, user="ivy")
        assert completion.model_extra["mace"] == {**completion.model_extra["mace"], "adapter": None,
                                                  "recorded": True}
        client.post("/feedback", cast_to=object,
                    body={"id": completion.id, "user": "ivy", "kind": "choice", "chosen": 1})
    # pairs_per_version=2: the idle trainer publishes version 1 of ivy's adapter.
    wait_for(lambda: any(a["active"] for a in client.get("/users/ivy/adapters", cast_to=object)["data"]), 120)
    served = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "Say hi"}], max_tokens=3, user="ivy")
    label = served.parse().model_extra["mace"]["adapter"]
    assert served.headers["x-mace-adapter"] == label and label.startswith("ivy@")
    # The newest version at admission (the idle trainer may publish another one meanwhile).
    versions = [a["version"] for a in client.get("/users/ivy/adapters", cast_to=object)["data"]]
    assert int(label.split("@")[1]) in versions
    base = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hi"}],
                                          max_tokens=3, user="ivy", extra_body={"adapter": "base"})
    assert base.model_extra["mace"]["adapter"] is None
    anonymous = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3)
    assert anonymous.model_extra["mace"]["adapter"] is None


def test_invalid_input_and_unknown_model_get_openai_errors(gw: Gateway) -> None:
    client = gw.openai()
    cases = [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(n=99), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_completion_tokens=0), "max_completion_tokens"),  # named as the client sent it
        (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(top_logprobs=2), "top_logprobs"),
        (dict(frequency_penalty=2.5), "frequency_penalty"),
        (dict(presence_penalty=-3), "presence_penalty"),
        (dict(logit_bias={"x": 1}), "logit_bias"),
        (dict(logit_bias={"5": 101}), "logit_bias"),
        (dict(seed=-5), "seed"),
        (dict(user="tab\there"), "user"),
        (dict(user="x" * 257), "user"),
        (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages.0.role"),
        (dict(messages=[{"role": "function", "name": "f", "content": "hi"}]), "messages.0.role"),
        (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
         "messages.0.content"),
        (dict(stop=["x"] * 17), "stop"),
        (dict(extra_body={"stop": 5}), "stop"),  # not "stop.str": the union member is no field
        (dict(response_format={"type": "xml"}), "response_format"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools"),
        (dict(functions=[{"name": "f"}]), "functions"),
        # Refused where the request is compiled, not parsed: still the field the client sent.
        (dict(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}),
         "response_format"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
         "response_format"),
        (dict(extra_body={"response_format": {"type": "regex", "regex": "(("}}), "response_format"),
        (dict(extra_body={"response_format": {"type": "grammar", "grammar": "start: undefined_rule"}}),
         "response_format"),
        (dict(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
        (dict(tools=[TOOL, TOOL]), "tools"),
        (dict(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "other"}}), "tool_choice"),
        (dict(logit_bias={"99999999": 1}), "logit_bias"),  # beyond the vocabulary
        (dict(messages=[*CHAT, {"role": "assistant", "content": None, "tool_calls": [5]}]),
         "messages.1.tool_calls"),
    ]
    for overrides, param in cases:
        kwargs = {"model": "tiny", "messages": CHAT, "max_tokens": 2, **overrides}
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**kwargs)
            pytest.fail(f"accepted: {overrides}")
        error = info.value
        assert (error.status_code, error.type, error.code, error.param) == (
            400, "invalid_request_error", "bad_request", param), (overrides, error.body)
        assert error.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=0)
    assert "'max_completion_tokens'" in info.value.body["message"]  # the message names it too
    for prompt in (["one"] * 65, [], "", ["one", ""], [[]], [[1, 2], []], [10**6]):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
        assert info.value.param == "prompt", prompt
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, echo=True, logprobs=2)
    assert info.value.param == "echo"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    assert (info.value.code, info.value.param, info.value.type) == ("model_not_found", "model", "not_found_error")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    status, _, body = gw.get("/v1/nothing-here")
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
    # Still serving after all that.
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices


def test_metrics_cover_both_fronts(gw: Gateway) -> None:
    client = gw.openai()
    client.completions.create(model="tiny", prompt="count", max_tokens=4, stream=True,
                              extra_body={"ignore_eos": True}).close()
    with Client(gw.daemon.endpoint, timeout_s=30) as sdk:
        list(sdk.stream("count", max_tokens=4, ignore_eos=True))
        http = sdk.status()["http"]
    assert http["endpoint"] == f"http://127.0.0.1:{gw.port}" and http["auth"] is True
    assert http["requests"] >= 1 and http["generates_in_flight"] == 0
    m = gw.metrics()
    for api in ("zmq", "http"):
        assert m[("mace_time_to_first_token_seconds_count", (("api", api),))] >= 1
        assert m[("mace_inter_token_latency_seconds_count", (("api", api),))] >= 1
        assert m[("mace_requests_total", (("api", api), ("outcome", "ok")))] >= 1
        assert m[("mace_completion_tokens_total", (("api", api),))] >= 4
    assert m[("mace_memory_ledger_budget_bytes", ())] > 0
    assert m[("mace_memory_ledger_bytes", (("kind", "weights"),))] > 0
    assert ("mace_queue_depth", (("queue", "engine_waiting"),)) in m
    assert sum(m[("mace_admission_state", (("state", s),))] for s in
               ("normal", "shed_finetune", "queue", "reject", "off")) == 1
    assert m[("mace_finetune_enabled", ())] == 1 and ("mace_finetune_pairs_trained_total", ()) in m
    assert ("mace_tokens_per_second", ()) in m  # a 10 s window: its value depends on timing
    # The engine thread publishes its own counters every half second.
    wait_for(lambda: gw.metrics()[("mace_engine_tokens_generated_total", ())] > 0, 10)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_hangs_up_gets_its_generation_cancelled(gw: Gateway, stream: bool) -> None:
    cancelled = ("mace_requests_total", (("api", "http"), ("outcome", "cancelled")))
    before = gw.metrics().get(cancelled, 0)
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=30)
    conn.request("POST", "/v1/completions", headers={"Authorization": f"Bearer {KEY}",
                                                     "Content-Type": "application/json"},
                 body=json.dumps({"model": "tiny", "prompt": "go on", "max_tokens": 100_000,
                                  "ignore_eos": True, "stream": stream}))
    if stream:
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
        assert response.read1(64).startswith(b"data: ")
    else:  # a whole reply: hang up while the daemon is still generating it
        wait_for(lambda: gw.metrics().get(("mace_queue_depth", (("queue", "generates_in_flight"),)), 0) >= 1, 30)
    conn.sock.shutdown(2)
    conn.close()
    wait_for(lambda: gw.metrics().get(cancelled, 0) > before, 30)


def test_admission_rejection_is_a_429_with_retry_after(tmp_path: Path, tiny_model: Path) -> None:
    # A reserve larger than any machine's memory: headroom is negative, admission says reject.
    g = start_gateway(tmp_path, tiny_model, key=None, env={"MACE_TELEMETRY_MEMORY_RESERVE_MB": "100000000"})
    try:
        wait_for(lambda: json.loads(g.get("/health")[2])["admission"] == "reject", 20, 0.1)
        client = g.openai()
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
        error = info.value
        assert (error.status_code, error.code, error.type) == (429, "admission_rejected", "rate_limit_error")
        assert int(error.response.headers["retry-after"]) >= 2 and "memory headroom" in error.message
        with pytest.raises(openai.RateLimitError):  # a stream is refused before it starts
            client.completions.create(model="tiny", prompt="hi", max_tokens=2, stream=True)
        assert g.metrics()[("mace_admission_state", (("state", "reject"),))] == 1
    finally:
        code, _ = g.daemon.stop()
    assert code == 0, g.daemon.log()


def test_sigterm_drains_an_http_stream_and_exits_0(tmp_path: Path, tiny_model: Path) -> None:
    g = start_gateway(tmp_path, tiny_model, key=None, extra=["--set", "server.drain_timeout_s=0.5"])
    try:
        stream = g.openai().completions.create(model="tiny", prompt="go on", max_tokens=100_000, stream=True,
                                               extra_body={"ignore_eos": True})
        got = 0
        with pytest.raises(openai.APIError) as info:
            for _ in stream:
                got += 1
                if got == 3:
                    g.daemon.signal(signal.SIGTERM)
        assert info.value.code == "shutting_down"
        assert g.daemon.proc.wait(15) == 0
    finally:
        g.daemon.stop()


def test_a_non_loopback_bind_needs_api_keys(tmp_path: Path) -> None:
    def maced(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "daemon.main", *args, "--print-config"], cwd=REPO,
                              capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})

    refused = maced("--http", "0.0.0.0:8000")
    assert refused.returncode == 2 and "without API keys" in refused.stderr
    keys = tmp_path / "keys"
    keys.write_text("# one per line\nkey-aaaaaaaaaaaaaaaaaaaa\n")
    allowed = maced("--http", "0.0.0.0:8000", "--set", f"http.api_key_file={keys}")
    assert allowed.returncode == 0 and "key-aaaa" not in allowed.stdout
    hidden = maced("--set", "http.api_keys=key-bbbbbbbbbbbbbbbbbbbb")
    assert hidden.returncode == 0 and "key-bbbb" not in hidden.stdout and "(set, hidden)" in hidden.stdout


def test_http_settings_are_parsed_and_checked(tmp_path: Path) -> None:
    from daemon.config import ConfigError, load_config

    def config(*flags: tuple[str, str]) -> Any:
        return load_config(None, {}, [(name, value, f"--set {name}") for name, value in flags])

    assert config().http_address == ("127.0.0.1", 8000)
    assert config(("http.bind", "[::1]:0")).http_address == ("::1", 0)
    assert config(("http.bind", "")).http_address is None
    for bad in ("8000", "localhost:http", "127.0.0.1:70000"):
        with pytest.raises(ConfigError, match="http.bind"):
            config(("http.bind", bad))
    with pytest.raises(ConfigError, match="shorter than 16"):
        config(("http.api_keys", "short"))
    with pytest.raises(ConfigError, match="http.api_key_file"):
        config(("http.api_key_file", str(tmp_path / "missing")))
    keys = tmp_path / "keys"
    keys.write_text("key-cccccccccccccccccccc  # laptop\n\nkey-dddddddddddddddddddd\n")
    both = config(("http.bind", "0.0.0.0:8000"), ("http.api_key_file", str(keys)),
                  ("http.api_keys", "key-eeeeeeeeeeeeeeeeeeee"))
    assert both.http_api_keys == {"key-cccccccccccccccccccc", "key-dddddddddddddddddddd",
                                  "key-eeeeeeeeeeeeeeeeeeee"}
