"""The generate request's `speculation` field (docs/speculative.md): checked once at the edge
and handed to the engine's SamplingParams; the SDK sends it as any other parameter, the HTTP
gateway as an extension of chat, completions and /v1/responses."""

from __future__ import annotations

from typing import Any

import pytest

from daemon.wire import ProtocolError
from daemon.wire.schema import parse_generate
from edge_runtime import SamplingParams
from tests.daemon.test_schema import http, over_http  # noqa: F401 (the in-process gateway fixture)


@pytest.mark.parametrize("value", ["auto", "on", "off"])
def test_speculation_reaches_the_engine(value):
    args = parse_generate("generate", {"prompt": "hi", "speculation": value})
    assert SamplingParams(**args.sampling_kwargs(8)).speculation == value


def test_speculation_defaults_to_auto_and_refuses_other_values():
    assert parse_generate("generate", {"prompt": "hi"}).sampling_kwargs(8)["speculation"] == "auto"
    with pytest.raises(ProtocolError) as err:
        parse_generate("generate", {"prompt": "hi", "speculation": "sometimes"})
    assert "'auto', 'on' or 'off'" in str(err.value)


# -- the HTTP gateway: a vendor extension on chat, completions and /v1/responses ----------------

BODIES = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
          "/v1/completions": {"prompt": "hi"}, "/v1/responses": {"input": "hi"}}


@pytest.mark.parametrize("path", list(BODIES))
def test_the_gateway_hands_speculation_on_and_refuses_other_values(http: Any, path: str):  # noqa: F811
    for value in ("auto", "on", "off"):
        _, _, seen = over_http(http, path, {**BODIES[path], "speculation": value})
        assert seen is not None and seen.speculation == value
    _, _, seen = over_http(http, path, BODIES[path])
    assert seen is not None and seen.speculation == "auto"
    status, reply, seen = over_http(http, path, {**BODIES[path], "speculation": "sometimes"})
    assert (status, seen) == (400, None)
    assert reply["error"]["param"] == "speculation" and "'auto', 'on' or 'off'" in reply["error"]["message"]


def test_the_official_openai_client_sends_speculation_in_extra_body(http: Any):  # noqa: F811
    import openai

    client = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1/v1", http_client=http, max_retries=0)
    calls = [lambda extra: client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                          extra_body=extra),
             lambda extra: client.completions.create(model="tiny", prompt="hi", extra_body=extra),
             lambda extra: client.responses.create(model="tiny", input="hi", extra_body=extra)]
    for call in calls:
        before = len(http.service.seen)
        with pytest.raises(openai.APIError):  # the capturing service answers no generation
            call({"speculation": "off"})
        assert [a.speculation for a in http.service.seen[before:]] == ["off"]
        with pytest.raises(openai.BadRequestError) as err:
            call({"speculation": "always"})
        assert err.value.body["param"] == "speculation"
        assert len(http.service.seen) == before + 1
