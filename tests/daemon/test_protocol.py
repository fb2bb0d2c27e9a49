"""The wire protocol on its own: decoding, envelope splitting, request validation, error codes."""

from __future__ import annotations

import re

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.wire import (
    ERROR_CODES,
    OPS,
    FleetRoundArgs,
    FleetRoundConfig,
    GenerateArgs,
    ProtocolError,
    decode,
    encode,
    error_from,
    error_message,
    parse_request,
    split_envelope,
)


def req(op: str, **fields: object) -> dict:
    return {"v": 1, "id": "r1", "op": op, **fields}


def code_of(fn, *args) -> str:
    with pytest.raises(ProtocolError) as info:
        fn(*args)
    assert info.value.code in ERROR_CODES
    return info.value.code


@pytest.mark.parametrize("frame, code", [
    (b"", "bad_message"),
    (b"\xc1", "bad_message"),
    (b"\x91" * 5000 + b"\xc0", "bad_message"),  # nesting deeper than the unpacker allows
    (b"\xdf\xff\xff\xff\xff", "bad_message"),  # a map claiming 4 billion entries
    (b"\x81\xa1a\xa2\xff\xfe", "bad_message"),  # invalid UTF-8 in a string
    (msgpack.packb({1: 2}), "bad_message"),  # non-string key
    (msgpack.packb([1, 2]), "bad_message"),  # not a map
    (msgpack.packb(msgpack.ExtType(5, b"x")), "bad_message"),
    (msgpack.packb({"a": 1}) + b"\x00", "bad_message"),  # trailing bytes
    (b"\x00" * 10_000, "too_large"),
])
def test_decode_rejects_malformed_frames_with_a_code(frame: bytes, code: str) -> None:
    assert code_of(decode, frame, 8192) == code


def test_decode_roundtrips_a_request() -> None:
    message = req("generate", prompt="héllo ✓", max_tokens=3)
    assert decode(encode(message), 1 << 20) == message


def test_envelope_accepts_dealer_and_req_framing() -> None:
    assert split_envelope([b"id", b"body"]) == ([b"id"], b"body")
    assert split_envelope([b"id", b"", b"body"]) == ([b"id", b""], b"body")
    for frames in ([b"id"], [b"id", b"a", b"b"], [b"id", b"x", b"", b"y"]):
        assert code_of(split_envelope, frames) == "bad_message"


@pytest.mark.parametrize("message, code", [
    ({"id": "a", "op": "status"}, "unsupported_version"),
    ({"v": 2, "id": "a", "op": "status"}, "unsupported_version"),
    ({"v": True, "id": "a", "op": "status"}, "unsupported_version"),
    ({"v": 1, "op": "status"}, "bad_request"),
    ({"v": 1, "id": "x" * 200, "op": "status"}, "bad_request"),
    ({"v": 1, "id": "a", "op": "launch"}, "unknown_op"),
    ({"v": 1, "id": "a", "op": ["status"]}, "unknown_op"),
    ({"v": 1, "id": "a", "op": "status", "extra": 1}, "bad_request"),
    (req("generate"), "bad_request"),
    (req("generate", prompt="hi", messages=[{"role": "user", "content": "x"}]), "bad_request"),
    (req("generate", prompt="   "), "bad_request"),
    (req("generate", prompt=5), "bad_request"),
    (req("generate", prompt="hi", max_tokens=0), "bad_request"),
    (req("generate", prompt="hi", max_tokens=True), "bad_request"),
    (req("generate", prompt="hi", temperature=float("nan")), "bad_request"),
    (req("generate", prompt="hi", top_p=0.0), "bad_request"),
    (req("generate", prompt="hi", n=17), "bad_request"),
    (req("generate", prompt="hi", stop=[""]), "bad_request"),
    (req("generate", prompt="hi", stop=["x"] * 17), "bad_request"),
    (req("generate", prompt="hi", stop_token_ids=[-1]), "bad_request"),
    (req("generate", prompt="hi", seed=-1), "bad_request"),
    (req("generate", prompt="hi", adapter=3), "bad_request"),  # a version needs a user
    (req("generate", prompt="hi", user="tab\tin"), "bad_request"),  # control characters
    (req("generate", prompt="hi", user="x" * 257), "bad_request"),
    (req("generate", messages=[{"role": "hacker", "content": "x"}]), "bad_request"),
    (req("generate", messages=[{"role": "user", "content": "x", "name": "y"}]), "bad_request"),
    (req("generate", messages=[]), "bad_request"),
    (req("feedback", user="a", interaction_id="ix-1", feedback="good"), "bad_request"),
    (req("feedback", user="a", interaction_id="bad id", feedback={"kind": "choice"}), "bad_request"),
    (req("users.consent", user="a"), "bad_request"),
    (req("users.consent", user="a", granted=1), "bad_request"),
    (req("users.consent", user="a", fleet=1), "bad_request"),
    (req("users.consent", user="a", granted=False, fleet=True), "bad_request"),
    (req("fleet.publish"), "bad_request"),
    (req("fleet.publish", path="relative/dir"), "bad_request"),
    (req("fleet.rollback", version=-1), "bad_request"),
    (req("adapters.rollback", user="a", version="3"), "bad_request"),
    (req("cancel", target=[1]), "bad_request"),
])
def test_invalid_requests_get_the_right_error_code(message: dict, code: str) -> None:
    assert code_of(parse_request, message) == code


def test_generate_defaults_and_sampling_arguments() -> None:
    request = parse_request(req("generate", prompt="hi", stop="END", n=2, temperature=0.7, seed=3))
    args = request.args
    assert isinstance(args, GenerateArgs)
    assert args.stop == ("END",) and args.n == 2 and not args.stream and args.adapter == "latest"
    kwargs = args.sampling_kwargs(default_max_tokens=33)
    assert kwargs["max_tokens"] == 33 and kwargs["temperature"] == 0.7 and kwargs["seed"] == 3


_TENSORS = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
            {"dtype": "float32", "shape": [2, 3], "data": b"\0" * 24}}
_LORA = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}


def test_fleet_round_fields_are_checked_and_defaulted() -> None:
    args = parse_request(req("fleet.round", round=1, adapter=_TENSORS, lora_config=_LORA)).args
    assert isinstance(args, FleetRoundArgs) and args.config == FleetRoundConfig()
    tensor = next(iter(args.adapter.values()))
    assert tensor.shape == (2, 3) and tensor.dtype == "float32" and args.lora_config.lora_alpha == 4.0
    bad = [
        ({"config": {"noise_multiplier": -1}}, "config.noise_multiplier"),
        ({"config": {"stepz": 1}}, "config"),
        ({"adapter": {}}, "adapter"),
        ({"adapter": {"a": {"dtype": "float16", "shape": [1], "data": b"\0\0"}}}, "adapter.a"),
        ({"adapter": {"a": {"dtype": "float32", "shape": [2], "data": b"\0" * 4}}}, "adapter.a"),
        ({"adapter": {"a": {"dtype": "float32", "shape": [1], "data": "text"}}}, "adapter.a"),
        ({"lora_config": {"r": 0, "lora_alpha": 1, "target_modules": ["q_proj"]}}, "lora_config"),
        ({"round": -1}, "round"),
    ]
    for change, param in bad:
        fields = {"round": 1, "adapter": _TENSORS, "lora_config": _LORA, **change}
        with pytest.raises(ProtocolError) as info:
            parse_request(req("fleet.round", **fields))
        assert info.value.code == "bad_request" and info.value.param == param, change


def test_every_op_parses_with_its_fields() -> None:
    samples = {
        "generate": {"messages": [{"role": "user", "content": "hi"}], "stream": True, "user": "bob"},
        "cancel": {"target": "r0"},
        "feedback": {"user": "bob", "interaction_id": "ix-00", "feedback": {"kind": "choice", "chosen": 1}},
        "status": {}, "health": {}, "adapters.list": {}, "adapters.rollback": {"user": "bob", "version": 2},
        "users.consent": {"user": "bob", "granted": False}, "users.export": {"user": "bob"},
        "users.forget": {"user": "bob"}, "embed": {"input": ["a", "b"]},
        "fleet.publish": {"path": "/var/lib/mace-edge/round-7"}, "fleet.rollback": {"version": 0},
        "fleet.status": {},
        "fleet.round": {"round": 3, "adapter": _TENSORS, "lora_config": _LORA, "config": {"steps": 2, "clip": 0.5}},
        "fleet.evaluate": {"adapter": _TENSORS, "lora_config": _LORA},
    }
    assert set(samples) == set(OPS)
    for op, fields in samples.items():
        assert parse_request(req(op, **fields)).op == op


def test_error_replies_carry_code_message_and_retry_hint() -> None:
    reply = error_message("r1", "admission_rejected", "busy device", retry_after_s=2)
    assert reply == {"v": 1, "id": "r1", "type": "error",
                     "error": {"code": "admission_rejected", "message": "busy device", "retry_after_s": 2.0}}
    assert error_message(None, "no-such-code", "x")["error"]["code"] == "internal"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_any_bytes_either_decode_to_a_map_or_raise_protocol_error(frame: bytes) -> None:
    try:
        assert isinstance(decode(frame, 4096), dict)
    except ProtocolError as exc:
        assert exc.code in ERROR_CODES


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(OPS + ("bogus",)), st.dictionaries(
    st.sampled_from(["prompt", "messages", "max_tokens", "temperature", "n", "stop", "user", "feedback",
                     "interaction_id", "granted", "fleet", "path", "version", "target", "stream", "seed", "junk"]),
    _values, max_size=6))
def test_any_fields_either_parse_or_raise_protocol_error(op: str, fields: dict) -> None:
    try:
        parse_request(req(op, **fields))
    except ProtocolError as exc:
        assert exc.code in ERROR_CODES


# --- the input holes an outside client found (issue 21) ------------------------------------------


@pytest.mark.parametrize("user", ["nl\n", "web\n", "a\n", "ok\r", "x\x00"])
def test_a_user_id_with_a_trailing_newline_or_control_is_refused(user: str) -> None:
    from edge_runtime.errors import BadRequest
    from edge_runtime.ids import validate_user_id

    assert code_of(parse_request, req("users.consent", user=user, granted=True)) == "bad_request"
    assert code_of(parse_request, req("generate", prompt="x", user=user)) == "bad_request"
    with pytest.raises(BadRequest):
        validate_user_id(user)


def test_request_and_interaction_ids_with_a_trailing_newline_are_refused() -> None:
    from edge_runtime.errors import BadRequest
    from edge_runtime.ids import validate_request_id

    with pytest.raises(BadRequest):
        validate_request_id("ix-1\n")
    feedback = req("feedback", user="eve", interaction_id="ix-1\n", feedback={"kind": "thumbs", "up": True})
    assert code_of(parse_request, feedback) == "bad_request"


@pytest.mark.parametrize("value", [0, False, "", {}, -0.0, 0.0, b"", True, 5, "1"])
def test_stop_token_ids_that_are_not_a_list_are_a_bad_request(value: object) -> None:
    assert code_of(parse_request, req("generate", prompt="x", stop_token_ids=value)) == "bad_request"


def test_stop_token_ids_nil_and_empty_list_mean_none() -> None:
    assert parse_request(req("generate", prompt="x", stop_token_ids=None)).args.stop_token_ids == ()
    assert parse_request(req("generate", prompt="x", stop_token_ids=[])).args.stop_token_ids == ()
    assert parse_request(req("generate", prompt="x", stop_token_ids=[0, 7])).args.stop_token_ids == (0, 7)


@pytest.mark.parametrize("version", [1.0, True, "1", 1.5, -0.0, [1]])
def test_only_the_integer_1_is_version_1(version: object) -> None:
    assert code_of(parse_request, {"v": version, "id": "r", "op": "health"}) == "unsupported_version"
    assert parse_request({"v": 1, "id": "r", "op": "health"}).op == "health"


@pytest.mark.parametrize("where", ["id", "v", "op", "user", "nested", "list"])
def test_a_msgpack_timestamp_anywhere_is_a_bad_message(where: str) -> None:
    ts = msgpack.Timestamp(1_700_000_000, 5)
    message: dict = req("users.consent", user="eve", granted=True)
    if where == "nested":
        message = req("feedback", user="eve", interaction_id="ix-1", feedback={"kind": "rating", "stars": ts})
    elif where == "list":
        message = req("generate", prompt="x", stop=["a", ts])
    else:
        message[where] = ts
    assert code_of(decode, msgpack.packb(message, datetime=False), 1 << 20) == "bad_message"
    assert code_of(decode, msgpack.packb(ts), 1 << 20) == "bad_message"


def test_a_req_client_with_a_malformed_body_keeps_its_delimiter_in_the_reply_envelope() -> None:
    from daemon.wire import reply_envelope

    for frames in ([b"id", b"", b"a", b"b"], [b"id", b"", b"", b"a"], [b"id", b"", b"a", b"b", b"c"]):
        assert code_of(split_envelope, frames) == "bad_message"
        assert reply_envelope(frames) == [b"id", b""]
    assert reply_envelope([b"id", b"a", b"b"]) == [b"id"]
    assert reply_envelope([b"id"]) == [b"id"]


@pytest.mark.parametrize("app_user", ["user:1234", "../etc", "Ana María <ana@example.com>", ".hidden", "x" * 256])
def test_any_printable_app_user_maps_to_one_safe_id(app_user):
    """OpenAI's `user` is free-form: each string gets one id, the same on every call, that is a
    plain file name (no path, no separators); ids the daemon already accepts stay themselves."""
    parsed = parse_request(req("generate", prompt="hi", user=app_user)).args.user
    assert parsed == parse_request(req("users.export", user=app_user)).args.user
    assert re.fullmatch(r"h-[0-9a-f]{40}", parsed)
    assert parse_request(req("generate", prompt="hi", user="alice.b@x")).args.user == "alice.b@x"


def test_generate_parses_the_openai_shaped_fields() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "x"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "assistant", "content": "It is"}]
    args = parse_request(req(
        "generate", messages=messages, tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        continue_final_message=True, logprobs=5, presence_penalty=-2, frequency_penalty=2, logit_bias={"7": -100, 9: 3},
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}})).args
    assert args.tool_choice == "get_weather" and args.continue_final_message and args.is_chat
    assert args.prompt[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "x"}'
    assert args.logit_bias == ((7, -100.0), (9, 3.0)) and args.logprobs == 5
    assert args.response_format == ("json_schema", '{"type": "object"}')
    kwargs = args.sampling_kwargs(16)
    assert (kwargs["presence_penalty"], kwargs["frequency_penalty"], kwargs["logprobs"]) == (-2.0, 2.0, 5)
    assert parse_request(req("generate", prompt=[1, 2, 3])).args.prompt == [1, 2, 3]
    assert parse_request(req("generate", prompt="x", response_format={"type": "json_object"})).args.response_format \
        == ("json", "")


@pytest.mark.parametrize("fields,param", [
    ({"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),  # tools need messages
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},  # last is not assistant
     "continue_final_message"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ({"messages": [{"role": "tool", "content": "x", "tool_calls": []}]}, "messages.0"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "bad name"}}]}]},
     "messages.0.tool_calls"),
    ({"prompt": []}, "prompt"), ({"prompt": [1, -1]}, "prompt"), ({"prompt": [True]}, "prompt"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"), ({"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"1": "a"}}, "logit_bias"),
    ({"prompt": "x", "response_format": {"type": "regex"}}, "response_format"),
    ({"prompt": "x", "response_format": {"type": "grammar", "grammar": ""}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
])
def test_malformed_openai_shaped_fields_are_bad_requests_naming_the_field(fields, param) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_request(req("generate", **fields))
    assert (info.value.code, info.value.param) == ("bad_request", param)
    assert error_from("r", info.value)["error"]["param"] == param  # and the ZeroMQ reply carries it
