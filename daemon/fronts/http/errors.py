"""The HTTP gateway's error replies: OpenAI's error shape, the OpenAI error `type` of each HTTP
status (the status of each code is the daemon's one table, daemon/wire/errors.py), and the field
named as the client sent it.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.responses import Response

from daemon.fronts.http.replies import json_response
from daemon.wire import HTTP_STATUS, ProtocolError
from edge_runtime.errors import MaceError

log = logging.getLogger("daemon.fronts.http")

# HTTP status -> OpenAI's error `type`.
ERROR_TYPE = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
    413: "invalid_request_error", 415: "invalid_request_error", 421: "invalid_request_error", 429: "rate_limit_error", 499: "cancelled_error",
    500: "server_error", 501: "not_supported_error", 503: "service_unavailable_error",
    504: "timeout_error",
}


class GatewayError(Exception):
    """An error reply in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, code: str, message: str, *, param: str | None = None,
                 retry_after_s: float | None = None, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.details = details

    @property
    def status(self) -> int:
        return HTTP_STATUS.get(self.code, 500)

    @classmethod
    def from_exc(cls, exc: BaseException) -> GatewayError:
        if isinstance(exc, GatewayError):
            return exc
        if isinstance(exc, ClientDisconnect):  # the peer left (or was dropped) mid-body: nothing to log
            return cls("cancelled", "the client disconnected before its request was read")
        if isinstance(exc, ProtocolError):
            return cls(exc.code, exc.message, param=exc.param, retry_after_s=exc.retry_after_s,
                       details=exc.details)
        if isinstance(exc, MaceError):  # the engine's BadRequest names its field too
            return cls(exc.code, str(exc), param=getattr(exc, "param", None),
                       retry_after_s=getattr(exc, "retry_after_s", None))
        log.error("HTTP request failed", exc_info=exc)
        return cls("internal", f"{type(exc).__name__}: {exc}")

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"message": self.message, "type": ERROR_TYPE.get(self.status, "server_error"),
                                 "param": self.param, "code": self.code}
        if self.retry_after_s is not None:
            error["retry_after_s"] = self.retry_after_s
        if self.details:
            error["details"] = self.details
        return {"error": error}

    def response(self) -> Response:
        headers: dict[str, str] = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
            headers["Retry-After-Ms"] = str(max(1, round(self.retry_after_s * 1000)))
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return json_response(self.body(), self.status, headers)


def as_sent(error: GatewayError, names: dict[str, str]) -> GatewayError:
    """The error with its field named as the client sent it (`max_completion_tokens` where the
    protocol says `max_tokens`, `messages` where it says `prompt`), in `param` and the message."""
    sent = names.get(error.param or "")
    if sent:
        error.message = error.message.replace(f"'{error.param}'", f"'{sent}'")
        error.param = sent
    return error

