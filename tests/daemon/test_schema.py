"""One request schema (daemon/wire/schema.py) from both fronts: the same request sent as the SDK
sends it over ZeroMQ and as an OpenAI client sends it over HTTP reaches the service as an equal
`GenerateArgs`, and every documented range (docs/protocol.md) is accepted at both its edges and
refused just past them, identically on both transports."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import starlette.testclient as starlette_testclient

from daemon.config import load_config
from daemon.fronts.http.app import build_app
from daemon.fronts.http.handlers import Gateway
from daemon.principals import Identities
from daemon.sdk import ops
from daemon.wire import GenerateArgs, ProtocolError, decode, encode, parse_request
from daemon.wire.schema import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, MAX_TOKENS_CAP, WANT


class CapturingService:
    """What the gateway asks of a Service, keeping each GenerateArgs it is handed."""

    def __init__(self) -> None:
        self.config = load_config(None, {}, [])
        self.identities = Identities()
        self.model_name = "tiny"
        self.seen: list[GenerateArgs] = []
        self.users = SimpleNamespace(erasers={})  # /v1/responses registers its store's eraser

    async def generate(self, args: GenerateArgs, call: Any) -> dict[str, Any]:
        self.seen.append(args)
        raise ProtocolError("not_ready", "captured")  # the engine is not this test's

    def cancel(self, call: Any, reason: str) -> None:
        pass


@pytest.fixture(scope="module")
def http() -> Any:
    service = CapturingService()
    with starlette_testclient.TestClient(build_app(Gateway(service)), base_url="http://127.0.0.1") as client:  # type: ignore[arg-type]
        client.service = service
        yield client


def over_zmq(fields: dict[str, Any]) -> GenerateArgs:
    """What the ZeroMQ server does with a frame: decode, then validate by the schema."""
    message = {"v": 1, "id": "r1", "op": "generate", **fields}
    return parse_request(decode(encode(message), 1 << 20)).args


def over_http(http: Any, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], GenerateArgs | None]:
    before = len(http.service.seen)
    response = http.post(path, json={"model": "tiny", **body})
    seen = http.service.seen[before:]
    return response.status_code, response.json(), (seen[0] if seen else None)


TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "find",
                                           "parameters": {"type": "object"}}}]


def test_the_same_chat_request_reaches_the_service_as_one_object_from_both_fronts(http: Any) -> None:
    sampling = {"temperature": 0.5, "top_p": 0.9, "seed": 3, "n": 2, "stop": ["END"], "user": "user:1234",
                "presence_penalty": -0.5, "frequency_penalty": 1.5, "logit_bias": {"5": 1.5, "9": -100}}
    extensions = {"top_k": 5, "ignore_eos": True, "adapter": "base", "record": False}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    sdk = ops.generate_fields(None, messages, {**sampling, **extensions, "max_tokens": 7, "logprobs": 2,
                                               "tools": TOOLS, "tool_choice": "lookup",
                                               "response_format": {"type": "json_object"}})
    from_zmq = over_zmq(sdk)
    status, _, from_http = over_http(http, "/v1/chat/completions", {
        **sampling, **extensions, "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 2,
        "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Weather?"}],
        "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "lookup"}},
        "response_format": {"type": "json_object"}})
    assert status == 503 and from_http is not None
    assert from_http == from_zmq
    assert from_zmq.sampling_kwargs(16) == from_http.sampling_kwargs(16)
    assert from_zmq.prompt == messages and from_zmq.logit_bias == ((5, 1.5), (9, -100.0))


def test_the_same_text_request_reaches_the_service_as_one_object_from_both_fronts(http: Any) -> None:
    fields = {"max_tokens": 4, "temperature": 0.0, "stop": "x", "echo": True, "seed": 9,
              "response_format": {"type": "regex", "regex": "[ab]+"}}
    status, _, from_http = over_http(http, "/v1/completions", {"prompt": [1, 2, 3], **fields})
    assert status == 503 and from_http == over_zmq(ops.generate_fields([1, 2, 3], None, fields))  # type: ignore[arg-type]


# (field, accepted at the edges, refused just past them, HTTP route): every range of the
# generate table in docs/protocol.md that both fronts carry (timeout_s and stop_token_ids are
# the native protocol's only; the gateway's seed -1 is llama.cpp's "random seed", see gateway.md).
TINY = 5e-324
RANGES = [
    ("max_tokens", [1, MAX_TOKENS_CAP], [0, MAX_TOKENS_CAP + 1], "chat"),
    ("temperature", [0.0, TINY, 100.0], [-TINY, 100.00000000000001], "chat"),
    ("top_k", [0, 2**31 - 1], [-1, 2**31], "chat"),
    ("top_p", [TINY, 1.0], [0.0, 1.0000000000000002], "chat"),
    ("seed", [0, 2**63 - 1 - MAX_N], [-2, 2**63 - MAX_N], "chat"),
    ("n", [1, MAX_N], [0, MAX_N + 1], "chat"),
    ("presence_penalty", [-2.0, 2.0], [-2.0000000000000004, 2.0000000000000004], "chat"),
    ("frequency_penalty", [-2.0, 2.0], [-2.0000000000000004, 2.0000000000000004], "chat"),
    ("logprobs", [0, MAX_LOGPROBS], [-1, MAX_LOGPROBS + 1], "text"),
    ("stop", [["x"] * 16, ["x" * 256]], [["x"] * 17, ["x" * 257], [""]], "chat"),
    ("logit_bias", [{"0": -100.0, str(2**31 - 1): 100.0}, {str(i): 1.0 for i in range(MAX_LOGIT_BIAS)}],
     [{"1": 100.00000000000001}, {"1": -100.00000000000001}, {"-1": 1.0}, {str(2**31): 1.0},
      {str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)}], "chat"),
]


def _case(name: str, value: Any, route: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    if route == "chat":
        prompt: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
        path = "/v1/chat/completions"
    else:
        prompt, path = {"prompt": "hi"}, "/v1/completions"
    return path, {**prompt, "temperature": 0.0, name: value}, {**prompt, name: value}


@pytest.mark.parametrize("name, accepted, refused, route", RANGES, ids=[r[0] for r in RANGES])
def test_every_documented_range_is_the_same_on_both_transports(http: Any, name: str, accepted: list[Any],
                                                               refused: list[Any], route: str) -> None:
    for value in accepted:
        path, body, fields = _case(name, value, route)
        status, reply, from_http = over_http(http, path, body)
        assert status == 503 and from_http == over_zmq({"temperature": 0.0, **fields}), (name, value, reply)
    for value in refused:
        path, body, fields = _case(name, value, route)
        with pytest.raises(ProtocolError) as info:
            over_zmq(fields)
        status, reply, _ = over_http(http, path, body)
        error = reply["error"]
        assert (info.value.code, info.value.param) == ("bad_request", name), value
        assert (status, error["code"], error["param"]) == (400, "bad_request", name), (value, error)
        if not (name == "seed" and value < 0):  # the gateway says why -1 is the one negative seed
            assert error["message"] == info.value.message, value  # the same text on both


def test_the_refusal_texts_read_their_bounds_off_the_schema() -> None:
    assert WANT["max_tokens"] == f"an integer in [1, {MAX_TOKENS_CAP}]"
    assert WANT["top_p"] == "a number in (0.0, 1.0]" and WANT["temperature"] == "a number in [0.0, 100.0]"
    assert WANT["logprobs"] == f"an integer in [0, {MAX_LOGPROBS}]"
    with pytest.raises(ProtocolError) as info:
        over_zmq({"prompt": "x", "n": MAX_N + 1})
    assert info.value.message == f"generate: 'n' must be an integer in [1, {MAX_N}]; got {MAX_N + 1}"


def test_engine_params_are_built_from_the_schema_without_a_second_range_check() -> None:
    """The engine takes what the schema admitted; past the protocol's bounds it refuses only what
    would break its arithmetic (edge_runtime/sampling.py)."""
    from edge_runtime.sampling import SamplingParams

    args = over_zmq({"prompt": "x", "logprobs": MAX_LOGPROBS, "n": MAX_N, "logit_bias": {"3": 100}})
    params = SamplingParams(**args.sampling_kwargs(8))
    assert (params.logprobs, params.n, params.logit_bias) == (MAX_LOGPROBS, MAX_N, ((3, 100.0),))


@pytest.mark.parametrize("name, value", [
    ("max_tokens", "5"), ("max_tokens", True), ("max_tokens", 5.0), ("n", True), ("temperature", "0.5"),
    ("top_p", False), ("stop", 5), ("stop", [1]), ("logit_bias", [1]), ("logit_bias", {"1": "2"}),
    ("user", 5), ("seed", "3"), ("top_k", 1.5), ("adapter", True), ("record", 1), ("ignore_eos", "yes"),
])
def test_a_value_of_the_wrong_type_is_refused_alike_on_both_transports(http: Any, name: str, value: Any) -> None:
    """The gateway does not coerce ("5" -> 5, true -> 1) where the native protocol refuses."""
    path, body, fields = _case(name, value, "chat")
    with pytest.raises(ProtocolError) as info:
        over_zmq(fields)
    status, reply, _ = over_http(http, path, body)
    assert (status, reply["error"]["param"], reply["error"]["message"]) == (400, name, info.value.message)
