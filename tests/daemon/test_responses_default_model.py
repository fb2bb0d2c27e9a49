"""`/v1/responses` with the official `openai` client against a real `maced` serving the default
model (issue #34's bar): text whole and streamed, a tool-call round trip through
`previous_response_id` whose answer reads the tool's result back, a JSON-schema answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from tests.daemon.conftest import DaemonProcess, free_tcp_port
from tests.daemon.test_gateway import KEY, Gateway

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
RESULT = '{"temperature": 18, "unit": "celsius", "sky": "sunny"}'
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Gateway]:
    port = free_tcp_port()
    daemon = DaemonProcess(tmp_path_factory.mktemp("responses-default"), default_model_dir,
                           engine_flags=["--set", "engine.num_threads=1"],
                           extra_args=["--http", f"127.0.0.1:{port}", "--set", "finetune.enabled=false"],
                           env={"MACE_HTTP_API_KEYS": KEY})
    daemon.wait_ready(timeout_s=300)
    yield Gateway(daemon, port, KEY)
    code, _ = daemon.stop()
    assert code == 0, daemon.log()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_responses_on_the_default_model(gw: Gateway) -> None:
    client = gw.openai().with_options(timeout=300)
    ask = dict(model="default", instructions="Answer in one short sentence.", temperature=0, max_output_tokens=40)
    whole = client.responses.create(input="Name a river in France.", **ask)
    assert whole.output_text.strip() and whole.status in ("completed", "incomplete")
    with client.responses.stream(input="Name a river in France.", **ask) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        streamed = stream.get_final_response() if whole.status == "completed" else None
    assert deltas == whole.output_text  # greedy: the same answer, whichever way it travels
    if streamed is not None:
        assert streamed.output_text == whole.output_text

    first = client.responses.create(model="default", input="What is the weather like in Paris right now?",
                                    tools=[WEATHER], tool_choice="required", temperature=0, max_output_tokens=96)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    final = client.responses.create(model="default", previous_response_id=first.id, tools=[WEATHER],
                                    tool_choice="none", temperature=0, max_output_tokens=48,
                                    input=[{"type": "function_call_output", "call_id": call.call_id,
                                            "output": RESULT}])
    assert [item.type for item in final.output] == ["message"]
    assert "18" in final.output_text, final.output_text  # the answer reads the tool's result back

    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    person = client.responses.create(model="default", input="Invent a person: give a name and an age.",
                                     text=text, temperature=0, max_output_tokens=96)
    assert person.status == "completed"
    jsonschema.validate(json.loads(person.output_text), PERSON)
    print("text:", whole.output_text, "| call:", call.arguments, "| answer:", final.output_text,
          "| json:", person.output_text)
