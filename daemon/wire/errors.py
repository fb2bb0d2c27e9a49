"""The daemon's one table of error codes: each code as both fronts send it (`error.code` in a
ZeroMQ reply and in an HTTP error body), its HTTP status, and what it means.

Pure standard library (the SDK shares it). `ProtocolError` is how the daemon refuses a request;
the runtime's typed errors (`edge_runtime.errors.MaceError` and its subclasses) carry codes from
this table too (tests/daemon/test_error_table.py checks every one is here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ErrorCode:
    code: str  # stable: clients branch on it
    http_status: int
    meaning: str  # for docs and `macectl`
    zmq: bool = True  # False: only the HTTP gateway can answer it (routing, API keys)


ERRORS: tuple[ErrorCode, ...] = (
    ErrorCode("bad_message", 400, "the frames could not be read as one msgpack map (bad msgpack, invalid "
              "UTF-8, wrong frame count)"),
    ErrorCode("too_large", 413, "a frame exceeds the daemon's size limit"),
    ErrorCode("unsupported_version", 400, "the request's protocol version is not spoken by this daemon"),
    ErrorCode("unknown_op", 400, "the operation name is not one this daemon knows"),
    ErrorCode("bad_request", 400, "a field is missing, of the wrong type or out of range"),
    ErrorCode("duplicate_id", 409, "the client reused the id of one of its requests still in flight"),
    ErrorCode("busy", 429, "too many requests in flight for this client or for the daemon"),
    ErrorCode("not_ready", 503, "the model is still loading"),
    ErrorCode("shutting_down", 503, "the daemon is stopping and admits nothing new"),
    ErrorCode("cancelled", 499, "the request was cancelled by its client"),
    ErrorCode("timeout", 504, "the request ran past its timeout_s"),
    ErrorCode("admission_rejected", 429, "the device is under pressure; retry after retry_after_s"),
    ErrorCode("unknown_request", 404, "no recorded interaction with that id for this user"),
    ErrorCode("unknown_user", 404, "the daemon holds nothing on that user"),
    ErrorCode("unknown_pair", 404, "no preference pair with that id (erased, expired, or never created)"),
    ErrorCode("adapter_unavailable", 404, "no such adapter version is served for that user (or it cannot "
              "load)"),
    ErrorCode("adapter_trimmed", 404, "that adapter version existed but the retention policy removed it "
              "(finetune.keep_versions); roll back to a version still listed"),
    ErrorCode("consent_required", 403, "the user has not consented to feedback collection"),
    ErrorCode("duplicate_feedback", 409, "the same feedback was already recorded; the first one stands"),
    ErrorCode("duplicate_request", 409, "that interaction id was already recorded"),
    ErrorCode("store_unavailable", 503, "the feedback store cannot commit right now"),
    ErrorCode("model_unavailable", 503, "the model cannot be loaded"),
    ErrorCode("insufficient_memory", 503, "the memory budget cannot hold what serving the model needs at all "
              "(weights, the smallest KV cache, one iteration's activations)"),
    ErrorCode("not_supported", 501, "this daemon build cannot do that (e.g. fine-tuning not available)"),
    ErrorCode("privacy_refused", 403, "the device's own fleet terms refuse the round or evaluation: a floor "
              "(noise, clip, examples, users) or its epsilon or evaluate budget; the message names which"),
    ErrorCode("forbidden", 403, "the principal lacks the right for this operation"),
    ErrorCode("internal", 500, "a bug in the daemon; the request failed, the daemon keeps serving"),
    ErrorCode("model_not_found", 404, "the request names a model this daemon does not serve", zmq=False),
    ErrorCode("not_found", 404, "no such HTTP route", zmq=False),
    ErrorCode("invalid_api_key", 401, "missing or wrong `Authorization: Bearer` key", zmq=False),
    ErrorCode("method_not_allowed", 405, "the HTTP route does not take that method", zmq=False),
    ErrorCode("host_not_allowed", 421, "the request's Host is not one a loopback gateway answers (DNS "
              "rebinding); see http.allowed_hosts", zmq=False),
    ErrorCode("unsupported_media_type", 415, "a state-changing request whose body is not "
              "application/json", zmq=False),
    ErrorCode("cross_site", 403, "a state-changing request from a web page whose origin is not allowed "
              "(http.cors_origins)", zmq=False),
)
BY_CODE = {e.code: e for e in ERRORS}
# The codes a ZeroMQ reply may carry (docs/protocol.md), with their meaning.
ERROR_CODES: dict[str, str] = {e.code: e.meaning for e in ERRORS if e.zmq}
# Every code's HTTP status (the gateway's error body carries the code itself in `error.code`).
HTTP_STATUS: dict[str, int] = {e.code: e.http_status for e in ERRORS}


class ProtocolError(Exception):
    """A request the daemon refuses, with the error code the reply carries."""

    def __init__(self, code: str, message: str, *, retry_after_s: float | None = None,
                 details: dict[str, Any] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code if code in ERROR_CODES else "internal"
        self.message = message
        self.retry_after_s = retry_after_s
        self.details = details
        self.param = param  # the request field at fault (`messages.2.tool_calls`), when one is


