"""One table of error codes (daemon/wire/errors.py): every typed error of the runtime and the daemon
has its row, and each code reaches a ZeroMQ client and an HTTP client alike, with its HTTP status."""

from __future__ import annotations

import ast
import asyncio
import importlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import zmq.asyncio

from daemon.config import load_config
from daemon.fronts.http.handlers import Gateway
from daemon.fronts.zmq_server import Server
from daemon.principals import Identities
from daemon.sdk import AsyncClient, RemoteError
from daemon.wire import ERROR_CODES, ERRORS, HTTP_STATUS
from edge_runtime.errors import MaceError

REPO = Path(__file__).resolve().parents[2]


def typed_errors() -> list[type[MaceError]]:
    """Every class under edge_runtime/ and daemon/ that derives from MaceError, found by reading
    the sources (so a module nobody imported yet is not missed), then imported."""
    bases: dict[str, tuple[str, list[str]]] = {}
    for package in ("edge_runtime", "daemon"):
        for path in (REPO / package).rglob("*.py"):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    names = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                    bases[node.name] = (module, names)

    def derives(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name == "MaceError":
            return True
        if name not in bases or name in seen:
            return False
        return any(derives(b, seen | {name}) for b in bases[name][1])

    found = [getattr(importlib.import_module(module), name) for name, (module, _) in sorted(bases.items())
             if name != "MaceError" and derives(name)]
    return [MaceError, *found]


TYPED = typed_errors()


def test_the_table_finds_the_runtimes_errors() -> None:
    names = {cls.__name__ for cls in TYPED}
    assert {"InsufficientMemory", "UnknownPair", "ConsentRequired", "AdapterError", "EngineFailed"} <= names


def test_every_typed_error_has_its_row_and_travels_over_zeromq() -> None:
    codes = {e.code for e in ERRORS}
    assert len(codes) == len(ERRORS)
    missing = sorted({cls.code for cls in TYPED} - codes)
    assert missing == []
    assert all(cls.code in ERROR_CODES for cls in TYPED)  # none is an HTTP-only code
    assert set(HTTP_STATUS) == codes


class _RaisingService:
    """Enough of daemon.service.Service for the ZeroMQ server: every op raises what it is given."""

    state = "serving"
    identities = Identities()

    def __init__(self) -> None:
        self.raise_next: BaseException | None = None
        self.users = self  # the user-data ops (daemon.user_ops.UserOps) raise alike

    def __getattr__(self, op: str) -> object:
        async def run(args: object, principal: object = None) -> dict:
            assert self.raise_next is not None
            raise self.raise_next

        return run


def test_each_typed_error_reaches_a_zeromq_client_with_its_code(tmp_path) -> None:
    config = load_config(None, {"MACE_STATE_DIR": str(tmp_path), "MACE_SERVER_IPC": str(tmp_path / "s.sock")})

    async def run() -> dict[str, str]:
        service = _RaisingService()
        server = Server(config, service, zmq.asyncio.Context())  # type: ignore[arg-type]
        endpoint = server.bind()[0]
        serving = asyncio.create_task(server.serve())
        seen = {}
        try:
            async with AsyncClient(endpoint, timeout_s=10, retries=0) as client:
                for cls in TYPED:
                    service.raise_next = cls(f"a {cls.__name__}")
                    with pytest.raises(RemoteError) as info:
                        await client.choose("alice", "ix-1", 0)
                    seen[cls.__name__] = info.value.code
        finally:
            serving.cancel()
            await server.close()
        return seen

    seen = asyncio.run(run())
    assert seen == {cls.__name__: cls.code for cls in TYPED}
    assert seen["InsufficientMemory"] == "insufficient_memory" and seen["UnknownPair"] == "unknown_pair"


@pytest.mark.parametrize("cls", TYPED, ids=lambda cls: cls.__name__)
def test_each_typed_error_reaches_an_http_client_with_its_code_and_status(cls: type[MaceError]) -> None:
    gateway = Gateway(SimpleNamespace(config=None))  # type: ignore[arg-type]

    async def handler(request: object) -> None:
        raise cls(f"a {cls.__name__}")

    response = asyncio.run(gateway.answering_errors(handler)(None))  # type: ignore[arg-type]
    assert response.status_code == HTTP_STATUS[cls.code]
    assert json.loads(response.body)["error"]["code"] == cls.code
