"""Frames on the wire: the protocol version, msgpack encoding and decoding, ROUTER envelopes, and
the token, result and error messages a reply is made of.

Pure: msgpack and the standard library only (no zmq, no torch).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgpack

from daemon.wire.errors import ERROR_CODES, ProtocolError

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)


def encode(message: Mapping[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not part of the protocol")


def _refuse_timestamps(values: Iterable[Any]) -> None:
    # msgpack decodes its timestamp extension (type -1) itself instead of calling ext_hook.
    if any(isinstance(value, msgpack.Timestamp) for value in values):
        raise ValueError("msgpack extension type -1 (timestamp) is not part of the protocol")


def _no_timestamps_in_list(items: list[Any]) -> list[Any]:
    _refuse_timestamps(items)
    return items


def _no_timestamps_in_map(pairs: dict[Any, Any]) -> dict[Any, Any]:
    _refuse_timestamps(pairs.values())
    return pairs


def decode(frame: bytes, max_bytes: int | None = None) -> dict[str, Any]:
    """One frame -> one msgpack map; ProtocolError `too_large` / `bad_message` otherwise."""
    if max_bytes is not None and len(frame) > max_bytes:
        raise ProtocolError("too_large", f"frame of {len(frame)} bytes exceeds the limit of {max_bytes}")
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=True, ext_hook=_no_ext,
                                  timestamp=0, list_hook=_no_timestamps_in_list,
                                  object_hook=_no_timestamps_in_map)
    except UnicodeDecodeError as exc:
        raise ProtocolError("bad_message", f"a string is not valid UTF-8 ({exc.reason})") from None
    except (ValueError, msgpack.UnpackException) as exc:
        # Covers truncated input, extra data, nesting too deep, huge declared sizes, bad types.
        raise ProtocolError("bad_message", f"not a msgpack message: {exc or type(exc).__name__}") from None
    if not isinstance(message, dict):
        raise ProtocolError("bad_message", f"a request must be a msgpack map, got {type(message).__name__}")
    return message


def reply_envelope(frames: Sequence[Any]) -> list[bytes]:
    """The frames a reply goes back under: the routing id (bytes), and the empty delimiter a REQ
    client puts first (without it a REQ socket drops the reply), even when the body is malformed
    or too large. Only the length of the frames after the id is read, so they may be unread
    zmq frames."""
    if len(frames) >= 3 and len(frames[1]) == 0:
        return [frames[0], b""]
    return list(frames[:1])


def split_envelope(frames: list[bytes]) -> tuple[list[bytes], bytes]:
    """ROUTER frames -> (reply envelope, body). DEALER clients send [body]; REQ clients put an
    empty delimiter first, which must come back in the reply envelope. Anything else raises
    `bad_message` (answered under `reply_envelope(frames)`)."""
    if len(frames) < 2:
        raise ProtocolError("bad_message", "a request has exactly one body frame; got none")
    envelope = reply_envelope(frames)
    bodies = frames[len(envelope):]
    if len(bodies) != 1:
        raise ProtocolError("bad_message", f"a request has exactly one body frame; got {len(bodies)}")
    return envelope, bodies[0]


# --- replies -----------------------------------------------------------------------------------


def token_message(request_id: Any, index: int, text: str, token_id: int | None,
                  extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A streamed piece of candidate `index`; `extra` may add `logprobs` (the pieces' tokens)
    and `tool_calls` (calls that completed in this piece)."""
    message = {"v": PROTOCOL_VERSION, "id": request_id, "type": "token", "index": index, "text": text,
               "token_id": token_id}
    if extra:
        message.update(extra)
    return message


def result_message(request_id: Any, result: Mapping[str, Any]) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "type": "result", "result": dict(result)}


def error_message(request_id: Any, code: str, message: str, *, retry_after_s: float | None = None,
                  details: Mapping[str, Any] | None = None, param: str | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code if code in ERROR_CODES else "internal", "message": message}
    if param is not None:
        error["param"] = param
    if retry_after_s is not None:
        error["retry_after_s"] = float(retry_after_s)
    if details:
        error["details"] = dict(details)
    return {"v": PROTOCOL_VERSION, "id": request_id, "type": "error", "error": error}


def error_from(request_id: Any, exc: ProtocolError) -> dict[str, Any]:
    return error_message(request_id, exc.code, exc.message, retry_after_s=exc.retry_after_s,
                         details=exc.details, param=exc.param)
