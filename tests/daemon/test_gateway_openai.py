"""What real OpenAI clients send, through the official `openai` client against a real `maced`
(tiny random model): structured output, tools and the turns after a call, logprobs, penalties,
logit bias, prompt lists and token ids, echo, embeddings, prefill, free-form `user` strings,
seed -1, CORS. A random model writes nothing sensible, so each check is one the daemon must make
hold whatever the model prefers (a grammar's mask, a forced call, the formula of a field)."""

from __future__ import annotations

import base64
import json
import math
import struct
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from daemon.sdk import Client, RemoteError
from tests.daemon.test_cli import macectl
from tests.daemon.test_gateway import Gateway, start_gateway

CHAT = [{"role": "user", "content": "What's the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome"]}, "rain": {"type": "boolean"},
    "days": {"type": "array", "items": {"enum": ["mon", "tue"]}, "maxItems": 2}},
    "required": ["city", "rain", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ORIGIN = "https://app.example.com"


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Gateway]:
    g = start_gateway(tmp_path_factory.mktemp("gateway-openai"), tiny_model,
                      extra=["--set", f"http.cors_origins={ORIGIN}", "--set", "finetune.enabled=false"])
    yield g
    code, _ = g.daemon.stop()
    assert code == 0, g.daemon.log()


def test_json_schema_output_validates_whole_and_streamed(gw: Gateway) -> None:
    client = gw.openai()
    response_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=400, n=2, temperature=1.0,
                                           seed=3, response_format=response_format)
    for choice in whole.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=400, temperature=1.0, seed=3,
                                            response_format=response_format, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    mode = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=400, temperature=1.0, seed=5,
                                          response_format={"type": "json_object"})
    if mode.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(mode.choices[0].message.content), dict)
    regex = client.completions.create(model="tiny", prompt="Answer:", max_tokens=30, temperature=1.0, seed=1,
                                      extra_body={"response_format": {"type": "regex", "regex": "(yes|no)!"}})
    assert regex.choices[0].text in ("yes!", "no!")


def _round_trip(client, stream: bool) -> tuple[list, str]:
    # A random model pads the call's JSON with all the whitespace the grammar allows: room for it.
    kwargs = dict(model="tiny", messages=CHAT, tools=[WEATHER], max_tokens=600, temperature=1.0, seed=7)
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(**kwargs, tool_choice="required", stream=True):
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            assert not choice.delta.content  # a call's text never streams as content
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += delta.id or ""
                entry["name"] += (delta.function.name or "") if delta.function else ""
                entry["arguments"] += (delta.function.arguments or "") if delta.function else ""
            finish = choice.finish_reason or finish
        assert finish == "tool_calls"
        tool_calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                      for _, c in sorted(calls.items())]
    else:
        first = client.chat.completions.create(**kwargs, tool_choice={"type": "function",
                                                                      "function": {"name": "get_weather"}})
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        tool_calls = [c.model_dump() for c in choice.message.tool_calls]
    assert len(tool_calls) == 1 and tool_calls[0]["function"]["name"] == "get_weather"
    arguments = json.loads(tool_calls[0]["function"]["arguments"])
    assert set(arguments) == {"city", "unit"} and tool_calls[0]["id"].startswith("call_")
    history = CHAT + [{"role": "assistant", "content": None, "tool_calls": tool_calls},
                      {"role": "tool", "tool_call_id": tool_calls[0]["id"], "content": "18 C and sunny"}]
    final = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], tool_choice="none",
                                           max_tokens=8, extra_body={"ignore_eos": True})
    return tool_calls, final.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_round_trip(gw: Gateway, stream: bool) -> None:
    tool_calls, answer = _round_trip(gw.openai(), stream)
    assert answer and not answer.startswith("<tool_call>")


def test_chat_logprobs_whole_and_streamed_are_the_same_numbers(gw: Gateway) -> None:
    client = gw.openai()
    kwargs = dict(model="tiny", messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the best token
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    streamed = [e for chunk in client.chat.completions.create(**kwargs, stream=True) if chunk.choices
                and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


def test_top_logprobs_at_the_ends_of_their_range(gw: Gateway) -> None:
    client = gw.openai()
    kwargs = dict(model="tiny", messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
                  extra_body={"ignore_eos": True})
    none = client.chat.completions.create(**kwargs, top_logprobs=0)
    most = client.chat.completions.create(**kwargs, top_logprobs=20)
    assert none.choices[0].message.content == most.choices[0].message.content
    for zero, twenty in zip(none.choices[0].logprobs.content, most.choices[0].logprobs.content, strict=True):
        assert zero.top_logprobs == [] and zero.logprob == pytest.approx(twenty.logprob)
        values = [t.logprob for t in twenty.top_logprobs]
        assert len(values) == 20 and values == sorted(values, reverse=True)
        assert values[0] == pytest.approx(twenty.logprob)  # greedy: the chosen token is the best
        assert sum(math.exp(v) for v in values) <= 1 + 1e-6
    legacy = client.completions.create(model="tiny", prompt="Once upon", max_tokens=3, temperature=0, logprobs=0,
                                       extra_body={"ignore_eos": True})
    lp = legacy.choices[0].logprobs
    assert len(lp.token_logprobs) == 3 and lp.top_logprobs == [{}, {}, {}]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="Once upon", max_tokens=3, logprobs=21)
    assert info.value.param == "logprobs"


def test_completions_legacy_logprobs_echo_prompt_lists_and_token_ids(gw: Gateway, tiny_model: Path) -> None:
    client = gw.openai()
    out = client.completions.create(model="tiny", prompt="Once upon", max_tokens=4, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == out.choices[0].text and lp.text_offset[0] == 0
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    echoed = client.completions.create(model="tiny", prompt="Once upon", max_tokens=4, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == "Once upon" + out.choices[0].text
    many = client.completions.create(model="tiny", prompt=["Once upon", "Hello"], max_tokens=4, n=2, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == out.choices[0].text
    assert len(many.model_extra["mace"]["interaction_ids"]) == 2
    ids = AutoTokenizer.from_pretrained(tiny_model).encode("Once upon")
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == out.choices[0].text
    both = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert [c.text for c in both.choices] == [out.choices[0].text] * 2
    streamed = client.completions.create(model="tiny", prompt=["Once upon", "Hello"], max_tokens=4, temperature=0,
                                         stream=True, echo=True, extra_body={"ignore_eos": True})
    texts: dict[int, str] = {}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts[0] == "Once upon" + out.choices[0].text and texts[1].startswith("Hello")


def test_penalties_and_logit_bias_reach_the_sampler(gw: Gateway, tiny_model: Path) -> None:
    client = gw.openai()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    token = tokenizer.encode("x", add_special_tokens=False)[0]
    forced = client.completions.create(model="tiny", prompt="Hi", max_tokens=5, temperature=0,
                                       logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == "x" * 5
    plain = client.completions.create(model="tiny", prompt="Hi", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    penalised = client.completions.create(model="tiny", prompt="Hi", max_tokens=12, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=2.0,
                                          extra_body={"ignore_eos": True})
    assert penalised.choices[0].text != plain.choices[0].text
    rewarded = client.completions.create(model="tiny", prompt="Hi", max_tokens=12, temperature=0,
                                         frequency_penalty=-2.0, presence_penalty=-2.0,
                                         extra_body={"ignore_eos": True})
    assert rewarded.choices[0].text != plain.choices[0].text
    with Client(gw.daemon.endpoint, timeout_s=30) as sdk:  # the SDK speaks the same fields
        same = sdk.generate("Hi", max_tokens=12, frequency_penalty=2.0, presence_penalty=2.0, ignore_eos=True)
        [first] = sdk.generate("Hi", max_tokens=1, logprobs=0, ignore_eos=True).candidates[0].logprobs
    assert same.text == penalised.choices[0].text
    # -100 on the token greedy decoding picks first: not chosen, and last of the alternatives.
    banned = client.completions.create(model="tiny", prompt="Hi", max_tokens=1, temperature=0, logprobs=20,
                                       logit_bias={str(first["token_id"]): -100}, extra_body={"ignore_eos": True})
    word = bytes(first["bytes"]).decode("utf-8", "replace")
    assert plain.choices[0].text.startswith(word)
    assert banned.choices[0].logprobs.tokens[0] != word and word not in banned.choices[0].logprobs.top_logprobs[0]


def test_embeddings_float_and_base64(gw: Gateway) -> None:
    client = gw.openai()
    out = client.embeddings.create(model="tiny", input=["hello world", "goodbye"], encoding_format="float")
    assert [d.index for d in out.data] == [0, 1] and out.usage.prompt_tokens > 0
    for d in out.data:
        assert math.isclose(math.sqrt(sum(v * v for v in d.embedding)), 1.0, rel_tol=1e-5)
    # The client's default asks for base64 (float32, little-endian) and decodes it itself.
    default = client.embeddings.create(model="tiny", input="hello world")
    assert default.data[0].embedding == pytest.approx(out.data[0].embedding, abs=1e-6)
    raw = client.embeddings.with_raw_response.create(model="tiny", input="hello world", encoding_format="base64")
    packed = base64.b64decode(json.loads(raw.text)["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == pytest.approx(out.data[0].embedding, abs=1e-6)
    with Client(gw.daemon.endpoint, timeout_s=30) as sdk:
        assert sdk.embed("hello world")[0] == pytest.approx(out.data[0].embedding, abs=1e-6)
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="tiny", input="x", dimensions=8)
    assert info.value.param == "dimensions"
    assert len(client.embeddings.create(model="tiny", input=["a"] * 256, encoding_format="float").data) == 256
    for bad in ("", [], ["a"] * 257, ["a", ""], [[]]):
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model="tiny", input=bad, encoding_format="float")
        assert info.value.param == "input", bad


def test_a_final_assistant_message_is_continued(gw: Gateway, tiny_model: Path) -> None:
    client = gw.openai()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    messages = CHAT + [{"role": "assistant", "content": "It is"}]
    prefill = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                             extra_body={"ignore_eos": True})
    text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    same = client.completions.create(model="tiny", prompt=tokenizer.encode(text, add_special_tokens=False),
                                     max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert prefill.choices[0].message.content == same.choices[0].text
    closed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                            extra_body={"ignore_eos": True, "add_generation_prompt": True})
    assert closed.usage.prompt_tokens > prefill.usage.prompt_tokens  # closed, and a new turn opened


@pytest.mark.parametrize("app_user", ["user:1234", "tenant/42 bob@example.com", "ü" + "x:" * 127 + "!"])
def test_an_apps_own_user_string_keys_the_user_everywhere(gw: Gateway, app_user: str) -> None:
    assert len(app_user) <= 256
    client = gw.openai()
    quoted = urllib.request.quote(app_user, safe="")
    status, _, body = _post(gw, f"/v1/users/{quoted}/consent", {"granted": True})
    assert status == 200, body
    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, user=app_user, seed=-1,
                                           temperature=1.0)
    assert reply.model_extra["mace"]["recorded"] is True
    with Client(gw.daemon.endpoint, timeout_s=30) as sdk:
        exported = sdk.export(app_user)
        assert sdk.adapters(app_user) == []  # adapters are keyed on the same id (none trained yet)
    assert [i["request_id"] for i in exported["interactions"]] == [reply.id]
    cli = macectl(gw.daemon.endpoint, "users", "export", app_user)
    assert cli.returncode == 0 and reply.id in cli.stdout
    status, _, body = gw.get(f"/v1/users/{quoted}/export")
    assert status == 200 and json.loads(body)["data"]["interactions"][0]["request_id"] == reply.id
    status, _, body = gw.get(f"/v1/users/{quoted}/adapters")
    assert status == 200 and json.loads(body)["data"] == []
    # The user's feedback, through the app's string, reaches the same record.
    ack = client.post("/feedback", cast_to=object, body={"id": reply.id, "user": app_user, "kind": "thumbs",
                                                         "candidate": 0, "up": True})
    assert ack["durable"] is True
    cli = macectl(gw.daemon.endpoint, "users", "forget", app_user, "--yes", "--json")
    assert cli.returncode == 0 and json.loads(cli.stdout)["interactions"] == 1, cli.stdout
    status, _, body = gw.get(f"/v1/users/{quoted}/export")
    assert status == 404 and json.loads(body)["error"]["code"] == "unknown_user"  # nothing left of them
    # 257 characters is one too many, on every front.
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1, user=app_user + "x" * 257)
    assert info.value.param == "user"


def _post(gw: Gateway, path: str, body: dict) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{gw.port}{path}", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {gw.key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _preflight(gw: Gateway, origin: str) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{gw.port}/v1/chat/completions", method="OPTIONS",
                                     headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                              "Access-Control-Request-Headers": "authorization,content-type"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}


@pytest.mark.parametrize("origin,allowed", [
    ("http://localhost:5173", True), ("http://127.0.0.1:8080", True), (ORIGIN, True),
    ("https://evil.example", False), ("http://localhost.evil.example", False),
])
def test_browser_preflights_are_answered_for_allowed_origins_only(gw: Gateway, origin: str, allowed: bool) -> None:
    status, headers = _preflight(gw, origin)
    if allowed:
        assert status == 200 and headers.get("access-control-allow-origin") == origin
        assert "POST" in headers["access-control-allow-methods"]
        assert "authorization" in headers["access-control-allow-headers"].lower()
    else:
        assert status == 400 and "access-control-allow-origin" not in headers
    # The request itself still needs the key, from any origin.
    request = urllib.request.Request(f"http://127.0.0.1:{gw.port}/v1/models", headers={"Origin": origin})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 401
    # With it, an allowed page may read the reply (and an error's), another origin's page may not.
    request.add_header("Authorization", f"Bearer {gw.key}")
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        assert response.headers.get("access-control-allow-origin") == (origin if allowed else None)
    assert info.value.headers.get("access-control-allow-origin") == (origin if allowed else None)


def test_the_sdk_speaks_the_same_fields_over_zeromq(gw: Gateway) -> None:
    with Client(gw.daemon.endpoint, timeout_s=60) as sdk:
        whole = sdk.generate(messages=CHAT, tools=[WEATHER], tool_choice="required", max_tokens=600,
                             temperature=1.0, seed=7)
        [candidate] = whole.candidates
        assert candidate.finish_reason == "tool_calls" and candidate.text == ""
        assert candidate.tool_calls[0]["function"]["name"] == "get_weather"
        stream = sdk.stream(messages=CHAT, tools=[WEATHER], tool_choice="required", max_tokens=600,
                            temperature=1.0, seed=7, logprobs=1)
        tokens = list(stream)
        assert "".join(t.text for t in tokens) == ""  # the call never streams as text
        [call] = [c for t in tokens for c in (t.tool_calls or [])]
        assert call == stream.result.candidates[0].tool_calls[0]  # same id, same arguments
        streamed = [x["token_id"] for t in tokens for x in (t.logprobs or [])]
        assert streamed == [x["token_id"] for x in stream.result.candidates[0].logprobs]
        constrained = sdk.generate("Answer:", max_tokens=30, temperature=1.0, seed=2,
                                   response_format={"type": "regex", "regex": "(yes|no)!"})
        assert constrained.text in ("yes!", "no!")
        schema = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
        for candidate in sdk.generate(messages=CHAT, max_tokens=400, n=2, temperature=1.0, seed=4,
                                      response_format=schema).candidates:
            jsonschema.validate(json.loads(candidate.text), SCHEMA)
        with pytest.raises(RemoteError) as info:  # a schema that does not compile names the field
            sdk.generate(messages=CHAT, max_tokens=4, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
        assert (info.value.code, info.value.param) == ("bad_request", "response_format")


def test_tool_choice_none_hides_the_tools_and_auto_shows_them(gw: Gateway) -> None:
    client = gw.openai()
    kwargs = dict(model="tiny", messages=CHAT, max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
    bare = client.chat.completions.create(**kwargs)
    hidden = client.chat.completions.create(**kwargs, tools=[WEATHER], tool_choice="none")
    shown = client.chat.completions.create(**kwargs, tools=[WEATHER], tool_choice="auto")
    default = client.chat.completions.create(**kwargs, tools=[WEATHER])  # auto, as OpenAI's default
    assert hidden.usage.prompt_tokens == bare.usage.prompt_tokens
    assert shown.usage.prompt_tokens == default.usage.prompt_tokens > bare.usage.prompt_tokens
    assert hidden.choices[0].message.content == bare.choices[0].message.content
    for reply in (hidden, shown):  # a random model calls nothing: plain content, no calls
        assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "length"


def test_the_remaining_rows_of_the_compatibility_table(gw: Gateway) -> None:
    """docs/gateway.md's table, the rows no other test drives: each as the table says."""
    client = gw.openai()
    greedy = dict(model="tiny", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    system = client.chat.completions.create(messages=[{"role": "system", "content": "Be brief."}, *CHAT], **greedy)
    developer = client.chat.completions.create(messages=[{"role": "developer", "content": "Be brief."}, *CHAT],
                                               **greedy)
    assert developer.choices[0].message.content == system.choices[0].message.content
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens
    joined = client.chat.completions.create(messages=[{"role": "user", "content": "Hello\nthere"}], **greedy)
    parts = client.chat.completions.create(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}], **greedy)
    assert parts.choices[0].message.content == joined.choices[0].message.content
    assert parts.usage.prompt_tokens == joined.usage.prompt_tokens
    accepted = client.chat.completions.create(messages=CHAT, parallel_tool_calls=False, tools=[WEATHER], top_p=0.5,
                                              model="tiny", max_tokens=2, temperature=0,
                                              extra_body={"ignore_eos": True, "not_a_field": 1})
    assert accepted.choices[0].finish_reason == "length"
    two = client.completions.create(model="tiny", prompt="Hi", n=2, best_of=2, max_tokens=2, temperature=1.0, seed=1)
    assert len(two.choices) == 2
    unrecorded = client.chat.completions.create(messages=CHAT, user="alice", **{**greedy, "extra_body": {"record": False}})
    assert unrecorded.model_extra["mace"]["recorded"] is False
    refused = [
        (dict(prompt="Hi", suffix="!"), "suffix"),
        (dict(prompt="Hi", n=1, best_of=3), "best_of"),
        (dict(prompt=[1, 2, 3], echo=True, stream=True), "echo"),
        (dict(prompt="Hi", echo=True, logprobs=1), "echo"),
    ]
    for kwargs, param in refused:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", max_tokens=2, **kwargs)
        assert info.value.param == param, kwargs


def test_the_consent_route_takes_fleet_consent_and_keeps_the_old_body(gw: Gateway) -> None:
    status, _, body = _post(gw, "/v1/users/fleet-hal/consent", {})  # the old default: grant
    assert status == 200 and json.loads(body) == {"user": "fleet-hal", "granted": True, "fleet": False,
                                                  "changed": True}
    status, _, body = _post(gw, "/v1/users/fleet-hal/consent", {"fleet": True})
    assert status == 200 and json.loads(body)["fleet"] is True and json.loads(body)["granted"] is True
    status, _, body = _post(gw, "/v1/users/fleet-hal/consent", {"granted": False, "fleet": True})
    assert status == 400 and b"fleet" in body
    status, _, body = _post(gw, "/v1/users/fleet-ivo/consent", {"fleet": True})
    assert status == 403 and b"consent_required" in body
