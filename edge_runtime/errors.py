"""Typed errors a user (or an app) can cause, each with a message a person can act on.

The daemon maps these onto protocol error codes; nothing here imports torch.
"""

from __future__ import annotations


class MaceError(Exception):
    """Base of every error the runtime raises on purpose."""

    code = "internal"


class BadRequest(MaceError):
    """The request itself is invalid (bad parameter, empty or oversized prompt, bad text).
    `param` names the request field at fault where one is (fronts report it to the client)."""

    code = "bad_request"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotAvailable(MaceError):
    """The model cannot be loaded (not cached and offline, unreadable file, unsupported architecture)."""

    code = "model_unavailable"


class InsufficientMemory(ModelNotAvailable):
    """The configured memory budget cannot hold what serving the model needs at all (weights,
    the smallest useful KV cache, one iteration's activations); the message gives each figure
    against the budget, so the engine refuses at start instead of running out later."""

    code = "insufficient_memory"


class UnknownRequest(MaceError):
    """A request id that the engine does not know (finished long ago, or never existed)."""

    code = "unknown_request"


class AdmissionRejected(MaceError):
    """Admission control said no; `retry_after_s` tells the client when to try again."""

    code = "admission_rejected"

    def __init__(self, message: str, retry_after_s: float = 1.0, reason: str = "") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason or message


class RequestFailed(MaceError):
    """The engine could not run this one request (its forward rows, sampling, stop check or
    detokenising raised); the request fails alone and the engine goes on with the others."""

    code = "internal"


class EngineBroken(MaceError):
    """The engine failed in a way no request caused (a forward of a known-good probe fails too,
    or its own bookkeeping raised): every request in flight fails, and a host may restart it."""

    code = "internal"
