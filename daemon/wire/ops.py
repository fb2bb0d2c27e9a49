"""The operations `maced` answers: their names, which carry tensors, which are safe to resend, and
`parse_request`, which checks a request's envelope and hands its fields to the op's parser.

Pure standard library. docs/protocol.md is the prose version of the `daemon.wire` package.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from daemon.wire.args import (
    NoArgs,
    adapters_list_args,
    consent_args,
    parse_cancel,
    parse_embed,
    parse_feedback,
    rollback_args,
    user_args,
)
from daemon.wire.errors import ProtocolError
from daemon.wire.fields import MAX_ID_CHARS, request_id_of
from daemon.wire.fleet import fleet_evaluate, fleet_publish, fleet_rollback, fleet_round
from daemon.wire.frames import SUPPORTED_VERSIONS
from daemon.wire.schema import GENERATE_FIELDS, parse_generate

# --- operations --------------------------------------------------------------------------------
OPS = (
    "generate", "cancel", "feedback", "status", "health", "adapters.list", "adapters.rollback",
    "users.consent", "users.export", "users.forget", "embed", "fleet.publish", "fleet.rollback",
    "fleet.status", "fleet.round", "fleet.evaluate",
)
# Ops whose requests carry adapter tensors: their frames may reach `fleet.max_message_bytes`.
TENSOR_OPS = frozenset({"fleet.round", "fleet.evaluate"})
# Safe to send again after a lost reply: repeating them changes nothing (consent sets a value;
# feedback is deduplicated by the store, so a resend is answered `duplicate_feedback`).
IDEMPOTENT_OPS = frozenset({"status", "health", "adapters.list", "users.consent", "users.export",
                            "cancel", "feedback", "embed", "fleet.status", "fleet.evaluate"})


@dataclass(frozen=True)
class Request:
    id: str | int
    op: str
    args: Any  # the op's validated arguments record


def parse_request(message: Mapping[str, Any]) -> Request:
    """Validate the envelope and the op's arguments; raises ProtocolError naming the problem."""
    version = message.get("v")
    # An integer, exactly: 1.0 == 1 and True == 1 in Python, but neither is version 1.
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        raise ProtocolError(
            "unsupported_version",
            f"protocol version {version!r} is not supported; this daemon speaks {list(SUPPORTED_VERSIONS)}",
            details={"supported": list(SUPPORTED_VERSIONS)})
    request_id = request_id_of(message)
    if request_id is None:
        raise ProtocolError("bad_request", f"'id' must be a string of 1-{MAX_ID_CHARS} characters or "
                            "a 64-bit integer")
    op = message.get("op")
    if not isinstance(op, str) or op not in _PARSERS:
        shown = op if isinstance(op, str) and len(op) <= 64 else type(op).__name__
        raise ProtocolError("unknown_op", f"unknown op {shown!r}; known ops: {', '.join(OPS)}")
    fields = {k: v for k, v in message.items() if k not in ("v", "id", "op")}
    parser, allowed = _PARSERS[op]
    unknown = sorted(str(k)[:64] for k in fields if k not in allowed)
    if unknown:
        raise ProtocolError("bad_request", f"op {op!r} has no field(s) {', '.join(unknown)}; "
                            f"allowed: {', '.join(sorted(allowed)) or 'none'}")
    return Request(request_id, op, parser(op, fields))


_PARSERS: dict[str, tuple[Any, frozenset[str]]] = {
    "generate": (parse_generate, GENERATE_FIELDS),
    "cancel": (parse_cancel, frozenset({"target"})),
    "feedback": (parse_feedback, frozenset({"user", "interaction_id", "feedback"})),
    "status": (lambda op, values: NoArgs(), frozenset()),
    "health": (lambda op, values: NoArgs(), frozenset()),
    "adapters.list": (adapters_list_args, frozenset({"user", "app"})),
    "adapters.rollback": (rollback_args, frozenset({"user", "version", "app"})),
    "users.consent": (consent_args, frozenset({"user", "granted", "fleet", "app"})),
    "users.export": (user_args, frozenset({"user", "app"})),
    "users.forget": (user_args, frozenset({"user", "app"})),
    "embed": (parse_embed, frozenset({"input"})),
    "fleet.publish": (fleet_publish, frozenset({"path", "operator_key", "run_id", "round"})),
    "fleet.rollback": (fleet_rollback, frozenset({"version", "operator_key"})),
    "fleet.status": (lambda op, values: NoArgs(), frozenset()),
    "fleet.round": (fleet_round, frozenset({"round", "adapter", "lora_config", "config"})),
    "fleet.evaluate": (fleet_evaluate, frozenset({"adapter", "lora_config", "config"})),
}
assert set(_PARSERS) == set(OPS)
