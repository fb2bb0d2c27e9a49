"""The SDK's one table of operations: for each method both clients offer, the request it sends
(op and fields) and how its result is read. Builds and reads messages only; never does I/O, so
`Client` and `AsyncClient` differ in how they wait, not in what they say.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from daemon.sdk.results import GenerateResult
from daemon.wire.tensors import tensors_from_wire, tensors_to_wire


def _as_is(result: dict[str, Any]) -> Any:
    return result


@dataclass(frozen=True)
class Call:
    """One request to send and the reader of its result. `timeout_s` None: the client's own."""

    op: str
    fields: dict[str, Any]
    read: Callable[[dict[str, Any]], Any] = _as_is
    timeout_s: float | None = None


def _key(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda result: result[name]


def generate_fields(prompt: str | None, messages: list[dict[str, str]] | None,
                    params: dict[str, Any]) -> dict[str, Any]:
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt= or messages=")
    fields = {"prompt": prompt} if prompt is not None else {"messages": messages}
    fields.update({k: v for k, v in params.items() if v is not None})
    return fields


def generate(prompt: str | None, messages: list[dict[str, str]] | None, timeout_s: float,
             params: dict[str, Any]) -> Call:
    # The daemon stops the request itself at timeout_s; the client waits a second longer for
    # the reply that says so.
    return Call("generate", generate_fields(prompt, messages, {"timeout_s": timeout_s, **params}),
                GenerateResult.from_reply, timeout_s + 1.0)


def stream_fields(prompt: str | None, messages: list[dict[str, str]] | None,
                  params: dict[str, Any]) -> dict[str, Any]:
    return {**generate_fields(prompt, messages, params), "stream": True}


def cancel(request_id: str) -> Call:
    return Call("cancel", {"target": request_id}, lambda result: bool(result.get("cancelled")))


def embed(texts: str | list[str] | list[int] | list[list[int]]) -> Call:
    return Call("embed", {"input": texts}, _key("embeddings"))


def feedback(user: str, interaction_id: str, kind: str, values: dict[str, Any]) -> Call:
    return Call("feedback", {"user": user, "interaction_id": interaction_id, "feedback": {"kind": kind, **values}})


def choose(user: str, interaction_id: str, chosen: int) -> Call:
    return feedback(user, interaction_id, "choice", {"chosen": chosen})


def thumbs(user: str, interaction_id: str, up: bool, candidate: int) -> Call:
    return feedback(user, interaction_id, "thumbs", {"candidate": candidate, "up": up})


def rate(user: str, interaction_id: str, stars: int, candidate: int) -> Call:
    return feedback(user, interaction_id, "rating", {"candidate": candidate, "stars": stars})


def edit(user: str, interaction_id: str, text: str, candidate: int) -> Call:
    return feedback(user, interaction_id, "edit", {"candidate": candidate, "text": text})


def status() -> Call:
    return Call("status", {})


def health(timeout_s: float | None) -> Call:
    return Call("health", {}, timeout_s=timeout_s)


def _app(app: str | None) -> dict[str, str]:
    """Another app's user, named by the operator (docs/security.md); absent for one's own."""
    return {} if app is None else {"app": app}


def adapters(user: str | None, app: str | None = None) -> Call:
    return Call("adapters.list", {**({"user": user} if user else {}), **_app(app)}, _key("adapters"))


def rollback(user: str, version: int, app: str | None = None) -> Call:
    return Call("adapters.rollback", {"user": user, "version": version, **_app(app)})


def fleet_publish(path: str) -> Call:
    # The daemon reads the folder on its own machine; a relative path would be read from its
    # working folder, not the caller's.
    return Call("fleet.publish", {"path": os.path.abspath(path)})


def fleet_rollback(version: int | None) -> Call:
    return Call("fleet.rollback", {} if version is None else {"version": version})


def fleet_status() -> Call:
    return Call("fleet.status", {})


def _with_delta(reply: dict[str, Any]) -> dict[str, Any]:
    return {**reply, "delta": tensors_from_wire(reply.get("delta") or {})}


def fleet_round(round: int, adapter: dict[str, Any], lora_config: dict[str, Any],
                config: dict[str, Any] | None, timeout_s: float | None) -> Call:
    fields = {"round": round, "adapter": tensors_to_wire(adapter), "lora_config": lora_config,
              **({"config": config} if config else {})}
    return Call("fleet.round", fields, _with_delta, timeout_s)


def fleet_evaluate(adapter: dict[str, Any], lora_config: dict[str, Any], config: dict[str, Any] | None,
                   timeout_s: float | None) -> Call:
    fields = {"adapter": tensors_to_wire(adapter), "lora_config": lora_config,
              **({"config": config} if config else {})}
    return Call("fleet.evaluate", fields, timeout_s=timeout_s)


def consent(user: str, granted: bool | None, fleet: bool | None, app: str | None = None) -> Call:
    # Only the consents being set, so old daemons (no `fleet`) keep answering calls without it.
    values = {k: v for k, v in (("granted", granted), ("fleet", fleet)) if v is not None}
    return Call("users.consent", {"user": user, **values, **_app(app)})


def export(user: str, app: str | None = None) -> Call:
    return Call("users.export", {"user": user, **_app(app)}, _key("data"))


def forget(user: str, app: str | None = None) -> Call:
    return Call("users.forget", {"user": user, **_app(app)}, _key("erased"))


# Every operation method of `Client` and `AsyncClient` (tests/daemon/test_sdk_parity.py checks both
# offer each one with the same signature). `stream` sends `stream_fields`; the rest build a Call.
OPERATIONS = ("generate", "stream", "cancel", "embed", "feedback", "choose", "thumbs", "rate", "edit",
              "status", "health", "adapters", "rollback", "fleet_publish", "fleet_rollback", "fleet_status",
              "fleet_round", "fleet_evaluate", "consent", "export", "forget")
