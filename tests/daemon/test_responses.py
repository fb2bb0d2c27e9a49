"""`/v1/responses` (issue #34 item 5) through the official `openai` client against a real
`maced` (tiny random model): text whole and streamed, a tool call round trip, a JSON-schema
answer, typed 400s, and stored responses that only their own app and user can reach. A random
model writes nothing sensible, so each check is one the daemon must make hold whatever the model
prefers (greedy sameness, a grammar's mask, a forced call)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.daemon.conftest import DaemonProcess, free_tcp_port
from tests.daemon.test_gateway import Gateway

KEYS = {"default": "default-key-0123456789abcd", "a": "app-a-key-0123456789abcdef",
        "b": "app-b-key-0123456789abcdef"}
SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome"]}, "rain": {"type": "boolean"},
    "days": {"type": "array", "items": {"enum": ["mon", "tue"]}, "maxItems": 2}},
    "required": ["city", "rain", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                          "unit": {"enum": ["C", "F"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
QUESTION = "What's the weather in Paris?"
GREEDY = dict(model="tiny", temperature=0, max_output_tokens=12, extra_body={"ignore_eos": True})


class Apps:
    """One daemon whose gateway has a default-app key and two apps' keys."""

    def __init__(self, root: Path, model: Path) -> None:
        port = free_tcp_port()
        config = root / "maced.toml"
        config.write_text(f'[http]\napi_keys = "{KEYS["default"]}"\n[finetune]\nenabled = false\n'
                          + "".join(f'[[apps]]\nname = "{n}"\napi_keys = ["{KEYS[n]}"]\n' for n in ("a", "b")))
        self.daemon = DaemonProcess(root, model, extra_args=["--config", str(config)],
                                    env={"MACE_HTTP_BIND": f"127.0.0.1:{port}"})
        self.daemon.wait_ready()
        self.gateways = {name: Gateway(self.daemon, port, key) for name, key in KEYS.items()}

    def openai(self, app: str = "default") -> openai.OpenAI:
        return self.gateways[app].openai()


@pytest.fixture(scope="module")
def apps(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Apps]:
    a = Apps(tmp_path_factory.mktemp("responses"), tiny_model)
    yield a
    code, _ = a.daemon.stop()
    assert code == 0, a.daemon.log()


def test_text_whole(apps: Apps) -> None:
    client = apps.openai()
    response = client.responses.create(input="Say something", instructions="Be brief.", **GREEDY)
    assert response.object == "response" and response.id.startswith("ix-")  # the interaction id
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text and response.output[0].content[0].type == "output_text"
    assert response.usage.output_tokens == 12 and response.usage.input_tokens > 0
    assert response.instructions == "Be brief." and response.temperature == 0
    # The same text through chat: one generate path.
    chat = client.chat.completions.create(model="tiny", temperature=0, max_tokens=12, extra_body={"ignore_eos": True},
                                          messages=[{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "Say something"}])
    assert chat.choices[0].message.content == response.output_text


def test_streamed_text_events_add_up_to_the_whole_answer(apps: Apps) -> None:
    client = apps.openai()
    whole = client.responses.create(input=[{"role": "user", "content": "Say something"}], **GREEDY)
    events = list(client.responses.create(input=[{"role": "user", "content": "Say something"}], stream=True,
                                          **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == events[-4].text == final.output_text == whole.output_text
    assert final.id == events[0].response.id and final.usage.output_tokens == 12
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


def _first_call(client: openai.OpenAI, stream: bool) -> tuple[openai.types.responses.Response, object]:
    kwargs = dict(model="tiny", input=QUESTION, tools=[WEATHER], max_output_tokens=600, temperature=1.0,
                  extra_body={"seed": 7})
    if not stream:
        response = client.responses.create(**kwargs, tool_choice={"type": "function", "name": "get_weather"})
        return response, response.output[-1]
    with client.responses.stream(**kwargs, tool_choice="required") as stream_:
        kinds = [event.type for event in stream_]
        response = stream_.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert "response.output_text.delta" not in kinds  # a call's text never streams as text
    return response, response.output[-1]


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_round_trip(apps: Apps, stream: bool) -> None:
    client = apps.openai()
    first, call = _first_call(client, stream)
    assert first.status == "completed" and [item.type for item in first.output] == ["function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city", "unit"}
    answer = "18 C and sunny"
    # The client sends the whole history back (Codex's way) ...
    history = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": answer}]
    final = client.responses.create(model="tiny", input=history, tools=[WEATHER], tool_choice="none",
                                    max_output_tokens=8, extra_body={"ignore_eos": True})
    assert [item.type for item in final.output] == ["message"] and final.output_text
    assert not final.output_text.startswith("<tool_call>")
    # ... or only the call's output, after previous_response_id: the same prompt, the same answer.
    chained = client.responses.create(model="tiny", previous_response_id=first.id, tools=[WEATHER],
                                      tool_choice="none", max_output_tokens=8, temperature=0,
                                      input=[{"type": "function_call_output", "call_id": call.call_id,
                                              "output": answer}], extra_body={"ignore_eos": True})
    again = client.responses.create(model="tiny", input=history, tools=[WEATHER], tool_choice="none",
                                    max_output_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert chained.output_text == again.output_text
    assert chained.usage.input_tokens == again.usage.input_tokens


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]  # a random model fills a free string up to the token limit
    rain: bool


def test_json_schema_answers_parse_and_validate(apps: Apps) -> None:
    client = apps.openai()
    text = {"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}}
    whole = client.responses.create(model="tiny", input=QUESTION, text=text, max_output_tokens=400,
                                    temperature=1.0, extra_body={"seed": 3})
    assert whole.status == "completed"
    jsonschema.validate(json.loads(whole.output_text), SCHEMA)
    assert whole.text.format.type == "json_schema"
    streamed = list(client.responses.create(model="tiny", input=QUESTION, text=text, max_output_tokens=400,
                                            temperature=1.0, stream=True, extra_body={"seed": 3}))
    assert streamed[-1].type == "response.completed"
    jsonschema.validate(json.loads(streamed[-1].response.output_text), SCHEMA)
    parsed = client.responses.parse(model="tiny", input=QUESTION, text_format=Weather, max_output_tokens=400,
                                    temperature=1.0, extra_body={"seed": 5})
    assert isinstance(parsed.output_parsed, Weather)


@pytest.mark.parametrize(("kwargs", "param"), [
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]),
     "input.0.content.0"),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input.0.type"),
    (dict(input="hi", tools=[{"type": "web_search"}]), "tools.0.type"),
    (dict(input="hi", background=True), "background"),
    (dict(input="hi", max_output_tokens=0), "max_output_tokens"),
    (dict(input="hi", text={"format": {"type": "json_schema", "name": "x", "schema": 3}}), "text.format"),
    (dict(input="hi", tools=[WEATHER], tool_choice={"type": "function", "name": "nope"}), "tool_choice"),
    (dict(input=[]), "input"),
])
def test_bad_input_is_a_typed_400(apps: Apps, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        apps.openai().responses.create(model="tiny", **kwargs)
    error = info.value.body
    assert info.value.status_code == 400 and error["code"] == "bad_request" and error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_stored_responses_belong_to_their_app_and_user(apps: Apps) -> None:
    a, b = apps.openai("a"), apps.openai("b")
    mine = a.responses.create(input="my PIN is 4321", user="alice", **GREEDY)
    assert a.responses.retrieve(mine.id).output_text == mine.output_text
    for attempt in (lambda: b.responses.retrieve(mine.id),  # another app, even its own "alice"
                    lambda: b.responses.create(input="and?", previous_response_id=mine.id, user="alice", **GREEDY),
                    lambda: a.responses.create(input="and?", previous_response_id=mine.id, user="bob", **GREEDY),
                    lambda: apps.openai().responses.retrieve(mine.id)):
        with pytest.raises(openai.NotFoundError) as info:
            attempt()
        assert info.value.body["code"] == "unknown_request" and "4321" not in str(info.value.body)
    follow = a.responses.create(input="and?", previous_response_id=mine.id, user="alice", **GREEDY)
    assert follow.previous_response_id == mine.id
    assert follow.usage.input_tokens > mine.usage.input_tokens  # the earlier turns went in front
    unstored = a.responses.create(input="hi", user="alice", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(unstored.id)
    # Erasing alice drops what was stored for her; deleting by id drops one response.
    other = a.responses.create(input="hello", user="carol", **GREEDY)
    status, _, body = _delete(apps.gateways["a"], "/v1/users/alice")  # alice has nothing else here
    assert status == 200 and json.loads(body)["erased"]["responses"] == 2
    assert _delete(apps.gateways["a"], "/v1/users/alice")[0] == 404  # nothing left: as for any user
    for gone in (mine.id, follow.id):
        with pytest.raises(openai.NotFoundError):
            a.responses.retrieve(gone)
    assert a.responses.retrieve(other.id).id == other.id
    a.responses.delete(other.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(other.id)


def _delete(gateway: Gateway, path: str) -> tuple[int, dict, bytes]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{gateway.port}{path}", method="DELETE",
                                     headers={"Authorization": f"Bearer {gateway.key}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_a_consenting_users_response_takes_feedback_and_is_erased_with_the_rest(apps: Apps) -> None:
    a = apps.openai("a")
    a.post("/users/dave/consent", body={"granted": True}, cast_to=object)
    response = a.responses.create(input="Suggest a name for a cat.", user="dave", **GREEDY)
    assert response.model_extra["mace"]["recorded"] is True
    ack = a.post("/feedback", cast_to=object, body={"id": response.id, "user": "dave", "kind": "thumbs",
                                                   "candidate": 0, "up": True})
    assert ack["completion_id"] == response.id and ack["durable"] is True
    status, _, body = _delete(apps.gateways["a"], "/v1/users/dave")
    erased = json.loads(body)["erased"]
    assert status == 200 and erased["responses"] == 1 and len(erased) > 1  # the store's report too
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(response.id)


def test_an_erasure_over_zeromq_drops_the_users_stored_responses_too(apps: Apps) -> None:
    a = apps.openai("a")
    kept = a.responses.create(input="Name a colour.", user="frank", **GREEDY)
    assert a.responses.retrieve(kept.id).id == kept.id
    with apps.daemon.client() as c:  # the daemon's own uid: the operator, who may name the app
        erased = c.forget("frank", app="a")
    assert erased["responses"] == 1 and erased["prefix_blocks"] == 0
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(kept.id)


def _raw_stream(client: openai.OpenAI, **kwargs: object) -> list[dict]:
    with client.responses.with_streaming_response.create(stream=True, **kwargs) as raw:
        return [json.loads(line[len("data: "):]) for line in raw.iter_lines() if line.startswith("data: ")]


def test_real_replies_validate_strictly_and_count_the_prefix_cache_truly(apps: Apps) -> None:
    from tests.daemon.test_responses_strict import strict_event, strict_response

    client = apps.openai()
    # A prompt no other test sent: its first reply writes the prompt's full blocks to the prefix
    # cache (but those of a start other tests sent, read back), the second reads them all back
    # (all but the last token, which must run).
    question = "Strictly count these words please: " + " ".join(f"w{i}" for i in range(40))
    kwargs = dict(input=question, tools=[WEATHER], **GREEDY)
    first = client.responses.with_raw_response.create(**kwargs).http_response.json()
    usage = strict_response(first).usage
    block = 16  # engine.block_size's default
    prompt = usage.input_tokens
    details = usage.input_tokens_details
    assert details.cached_tokens + details.cache_write_tokens == prompt // block * block
    assert details.cache_write_tokens >= 32
    events = _raw_stream(client, **kwargs)
    parsed = [strict_event(e) for e in events]
    usage = parsed[-1].response.usage
    assert usage.input_tokens_details.cached_tokens == (prompt - 1) // block * block
    assert usage.input_tokens_details.cache_write_tokens == 0
    calls = dict(model="tiny", input=QUESTION, tools=[WEATHER], max_output_tokens=600, temperature=1.0,
                 extra_body={"seed": 7})
    forced = client.responses.with_raw_response.create(
        tool_choice={"type": "function", "name": "get_weather"}, **calls).http_response.json()
    assert strict_response(forced).output[-1].type == "function_call"
    streamed = [strict_event(e) for e in _raw_stream(client, tool_choice="required", **calls)]
    assert streamed[-1].type == "response.completed" and streamed[-1].response.output[-1].type == "function_call"
