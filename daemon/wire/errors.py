"""The daemon's error codes, each once: what it means, its HTTP status and its wire code.

Pure standard library (the SDK shares it). `ProtocolError` is how the daemon refuses a request.
"""

from __future__ import annotations

from typing import Any

# --- error codes -------------------------------------------------------------------------------
# Stable strings: clients branch on them. The message next to each is for docs and `macectl`.
ERROR_CODES: dict[str, str] = {
    "bad_message": "the frames could not be read as one msgpack map (bad msgpack, invalid UTF-8, "
    "wrong frame count)",
    "too_large": "a frame exceeds the daemon's size limit",
    "unsupported_version": "the request's protocol version is not spoken by this daemon",
    "unknown_op": "the operation name is not one this daemon knows",
    "bad_request": "a field is missing, of the wrong type or out of range",
    "duplicate_id": "the client reused the id of one of its requests still in flight",
    "busy": "too many requests in flight for this client or for the daemon",
    "not_ready": "the model is still loading",
    "shutting_down": "the daemon is stopping and admits nothing new",
    "cancelled": "the request was cancelled by its client",
    "timeout": "the request ran past its timeout_s",
    "admission_rejected": "the device is under pressure; retry after retry_after_s",
    "unknown_request": "no recorded interaction with that id for this user",
    "unknown_user": "the daemon holds nothing on that user",
    "adapter_unavailable": "no such adapter version is served for that user (or it cannot load)",
    "consent_required": "the user has not consented to feedback collection",
    "duplicate_feedback": "the same feedback was already recorded; the first one stands",
    "duplicate_request": "that interaction id was already recorded",
    "store_unavailable": "the feedback store cannot commit right now",
    "model_unavailable": "the model cannot be loaded",
    "not_supported": "this daemon build cannot do that (e.g. fine-tuning not available)",
    "internal": "a bug in the daemon; the request failed, the daemon keeps serving",
}


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


