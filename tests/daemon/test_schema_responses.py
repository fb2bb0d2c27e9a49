"""`/v1/responses` judges its fields by the one request schema, as chat does: a value of the wrong
type is not coerced by its pydantic shell ("5" -> 5, true -> 1) but refused with chat's code,
text and `param` (the field as the Responses client named it)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.daemon.test_schema import http, over_http  # noqa: F401 (the in-process gateway fixture)

CHAT = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.0}
RESPONSES = {"input": "hi", "temperature": 0.0}
NAMES = {"max_tokens": "max_output_tokens"}  # chat's name -> the Responses request's


@pytest.mark.parametrize("name, value", [
    ("max_tokens", "5"), ("max_tokens", True), ("max_tokens", 5.0), ("max_tokens", 0), ("temperature", "0.5"),
    ("temperature", True), ("top_p", False), ("top_p", "1"), ("stop", 5), ("stop", [1]), ("user", 5),
    ("seed", "3"), ("seed", 1.5), ("seed", -2), ("top_k", 1.5), ("top_k", True), ("adapter", True),
    ("adapter", 1.5), ("record", 1), ("ignore_eos", "yes"),
])
def test_a_value_of_the_wrong_type_is_refused_alike_by_chat_and_responses(http: Any, name: str,  # noqa: F811
                                                                          value: Any) -> None:
    chat_status, chat, _ = over_http(http, "/v1/chat/completions", {**CHAT, name: value})
    sent = NAMES.get(name, name)
    status, reply, seen = over_http(http, "/v1/responses", {**RESPONSES, sent: value})
    assert seen is None and chat_status == status == 400, reply
    chat_error, error = chat["error"], reply["error"]
    assert (error["code"], error["param"]) == (chat_error["code"], NAMES.get(chat_error["param"], chat_error["param"]))
    assert error["message"] == chat_error["message"].replace(name, sent)


def test_well_typed_values_reach_the_service_as_chat_sends_them(http: Any) -> None:  # noqa: F811
    fields = {"temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ["x"], "user": "u1", "top_k": 4,
              "ignore_eos": True, "record": False}
    _, _, chat = over_http(http, "/v1/chat/completions", {**CHAT, **fields, "max_tokens": 5})
    _, _, responses = over_http(http, "/v1/responses", {**RESPONSES, **fields, "max_output_tokens": 5})
    assert chat is not None and chat == responses
