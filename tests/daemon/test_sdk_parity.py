"""One SDK core (daemon/sdk/ops.py): the blocking and the asyncio client offer the same operations,
with the same signatures, and both send what the operations table builds."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from daemon.sdk import AsyncClient, Client, ops


def public_methods(cls: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}


def test_both_clients_offer_every_operation_of_the_table() -> None:
    assert set(ops.OPERATIONS) <= public_methods(Client)
    assert set(ops.OPERATIONS) <= public_methods(AsyncClient)
    for name in ("thumbs", "rate", "edit", "rollback"):  # the ones AsyncClient used to lack
        assert name in public_methods(AsyncClient)


def test_the_clients_public_methods_are_the_same() -> None:
    # `close` and `reconnect` differ only in being coroutines; `call` and `request` are the core.
    assert public_methods(Client) == public_methods(AsyncClient)


@pytest.mark.parametrize("name", ops.OPERATIONS)
def test_an_operation_has_the_same_signature_in_both_clients(name: str) -> None:
    sync, asynchronous = getattr(Client, name), getattr(AsyncClient, name)
    assert inspect.iscoroutinefunction(asynchronous) and not inspect.iscoroutinefunction(sync)
    s, a = inspect.signature(sync), inspect.signature(asynchronous)
    assert list(s.parameters.values()) == list(a.parameters.values())
    return_of = {"TokenStream": "AsyncTokenStream"}
    assert return_of.get(str(s.return_annotation), s.return_annotation) == a.return_annotation


class _Recording:
    """Stands in for the transport: records what a client would send and answers `reply`."""

    def __init__(self, reply: dict) -> None:
        self.sent: list[tuple[str, dict, float | None]] = []
        self.reply = reply

    def request(self, op: str, fields: dict | None = None, *, timeout_s: float | None = None) -> dict:
        self.sent.append((op, dict(fields or {}), timeout_s))
        return self.reply

    async def arequest(self, op: str, fields: dict | None = None, *, timeout_s: float | None = None) -> dict:
        return self.request(op, fields, timeout_s=timeout_s)


CASES = [
    ("thumbs", ("u", "ix-1", True), {"candidate": 1}, {}),
    ("rate", ("u", "ix-1", 4), {}, {}),
    ("edit", ("u", "ix-1", "better"), {}, {}),
    ("choose", ("u", "ix-1", 1), {}, {}),
    ("rollback", ("u", 3), {}, {}),
    ("adapters", ("u",), {}, {"adapters": []}),
    ("consent", ("u",), {"fleet": True}, {}),
    ("export", ("u",), {}, {"data": {}}),
    ("forget", ("u",), {}, {"erased": {}}),
    ("embed", (["a"],), {}, {"embeddings": [[1.0]]}),
    ("cancel", ("r-1",), {}, {"cancelled": True}),
    ("health", (), {"timeout_s": 2.0}, {"ok": True}),
    ("fleet_status", (), {}, {}),
    ("fleet_rollback", (), {"version": 2}, {}),
]


@pytest.mark.parametrize("name, args, kwargs, reply", CASES, ids=[c[0] for c in CASES])
def test_both_clients_send_the_same_request_and_read_the_same_result(name, args, kwargs, reply) -> None:
    sync_wire, async_wire = _Recording(reply), _Recording(reply)
    client = Client.__new__(Client)  # no socket: only the operations table and `request` run
    client.request = sync_wire.request  # type: ignore[method-assign]
    aclient = AsyncClient.__new__(AsyncClient)
    aclient.request = async_wire.arequest  # type: ignore[method-assign]
    got = getattr(client, name)(*args, **kwargs)
    agot = asyncio.run(getattr(aclient, name)(*args, **kwargs))
    assert sync_wire.sent == async_wire.sent and len(sync_wire.sent) == 1
    assert got == agot
