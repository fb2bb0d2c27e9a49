"""Publishing and rolling back the fleet adapter from a folder on the device, through `macectl fleet`
against a real daemon (tiny model): what new requests are served changes, status shows the version,
and folders that do not fit the model are refused naming what is wrong."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from daemon.sdk import AsyncClient, RemoteError
from edge_runtime.lora import LoraSettings, LoraWeights
from edge_runtime.lora.adapter import write_adapter
from edge_runtime.model.config import ModelConfig
from tests.daemon.test_cli import macectl

PROMPT = "The fleet adapter changes"


def _adapter(folder: Path, cfg: ModelConfig, *, seed: int, rank: int = 4, scale: float = 2.0) -> Path:
    """A PEFT folder whose B is not zero, so the adapter really changes the model's answers."""
    weights = LoraWeights.init(cfg, LoraSettings(rank=rank), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    for key, b in weights.b.items():
        weights.b[key] = torch.randn(b.shape, generator=gen) * scale
    folder.mkdir(parents=True)
    write_adapter(folder, weights)
    return folder


def _staging(daemon) -> Path:  # type: ignore[no-untyped-def]
    """The folder fleet.publish reads from (fleet.publish_dir's default)."""
    return daemon.state_dir / "fleet-staging"


def _key(daemon) -> str:  # type: ignore[no-untyped-def]
    """The operator key: publish and rollback are the operator's (tests/security/test_fleet_publish.py)."""
    return (daemon.state_dir / "fleet" / "operator.key").read_text().strip()


def _greedy(client, user: str | None = None) -> str:  # type: ignore[no-untyped-def]
    return client.generate(PROMPT, max_tokens=8, ignore_eos=True, user=user).text


def test_publish_and_rollback_through_macectl_change_what_requests_are_served(
    start_daemon: Callable, tiny_model: Path, tmp_path: Path
) -> None:
    daemon = start_daemon(extra_args=["--set", "finetune.enabled=false"])
    ep, cfg = daemon.endpoint, ModelConfig.from_dir(tiny_model)
    key = ("--operator-key", str(daemon.state_dir / "fleet" / "operator.key"))
    tmp_path = _staging(daemon)
    with daemon.client() as c:
        base = _greedy(c)
        assert c.status()["adapters"]["fleet_serving"] is None
        assert macectl(ep, "fleet", "status").stdout.strip() == "no fleet adapter is served"

        first = macectl(ep, "fleet", "publish", str(_adapter(tmp_path / "round1", cfg, seed=1)), *key)
        assert first.returncode == 0, first.stderr
        assert first.stdout.startswith("fleet adapter version 1 published (rank 4")
        with_v1 = _greedy(c)
        assert with_v1 != base and _greedy(c, user="nobody-trained") == with_v1  # beneath every user
        second = macectl(ep, "fleet", "publish", str(_adapter(tmp_path / "round2", cfg, seed=2)), "--json", *key)
        assert json.loads(second.stdout)["version"] == 2
        with_v2 = _greedy(c)
        assert with_v2 not in (base, with_v1)
        assert c.status()["adapters"]["fleet_serving"] == 2
        status = json.loads(macectl(ep, "fleet", "status", "--json").stdout)
        assert status["serving"] == 2 and [v["version"] for v in status["versions"]] == [1, 2]
        assert status["versions"][0]["source"] == str(tmp_path / "round1")
        assert re.search(r"fleet adapter\W+version 2", macectl(ep, "status").stdout)

        back = macectl(ep, "fleet", "rollback", *key)
        assert back.stdout.strip() == "retired fleet version(s) 2; serving fleet version 1"
        assert _greedy(c) == with_v1 and c.status()["adapters"]["fleet_serving"] == 1
        none = json.loads(macectl(ep, "fleet", "rollback", "--to", "0", "--json", *key).stdout)
        assert none == {"serving": None, "retired": [1]}
        assert _greedy(c) == base
        nothing = macectl(ep, "fleet", "rollback", *key)
        assert nothing.returncode == 1 and "adapter_unavailable" in nothing.stderr


def _write_config(folder: Path, **changes: object) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("breakage, says", [
    ("missing", "is not a folder"),
    ("empty", "is not a complete PEFT adapter"),
    ("rank", "have shapes"),
    ("targets", "lacks"),
    ("dora", "use_dora"),
    ("no_rank", "missing or malformed field"),
])
def test_folders_that_do_not_fit_the_model_are_refused_naming_what_is_wrong(
    shared_daemon, tiny_model: Path, tmp_path: Path, breakage: str, says: str  # type: ignore[no-untyped-def]
) -> None:
    cfg = ModelConfig.from_dir(tiny_model)
    folder = _staging(shared_daemon) / f"{tmp_path.name}-{breakage}"
    if breakage == "empty":
        folder.mkdir()
    elif breakage != "missing":
        _adapter(folder, cfg, seed=3)
        if breakage == "rank":
            _write_config(folder, r=8)
        elif breakage == "targets":
            _write_config(folder, target_modules=["q_proj"])
        elif breakage == "dora":
            _write_config(folder, use_dora=True)
        else:
            config = json.loads((folder / "adapter_config.json").read_text())
            del config["r"]
            (folder / "adapter_config.json").write_text(json.dumps(config))
    run = macectl(shared_daemon.endpoint, "fleet", "publish", str(folder), "--operator-key",
                  str(shared_daemon.state_dir / "fleet" / "operator.key"))
    assert run.returncode == 1 and "bad_request" in run.stderr and says in run.stderr, run.stderr
    with shared_daemon.client() as c:
        with pytest.raises(RemoteError) as info:
            c.fleet_publish(str(folder), _key(shared_daemon))
        assert info.value.param == "path"
        assert c.fleet_status() == {"serving": None, "versions": []}  # nothing was published


def test_a_relative_path_is_refused_by_the_protocol(shared_daemon) -> None:  # type: ignore[no-untyped-def]
    with shared_daemon.client() as c:
        with pytest.raises(RemoteError) as info:
            c.request("fleet.publish", path="round1")
        assert info.value.code == "bad_request" and info.value.param == "path"


def test_the_async_client_has_the_fleet_ops(shared_daemon) -> None:  # type: ignore[no-untyped-def]
    async def run() -> tuple[dict, str]:
        async with AsyncClient(shared_daemon.endpoint, timeout_s=30) as client:
            status = await client.fleet_status()
            try:
                await client.fleet_rollback(0, _key(shared_daemon))
            except RemoteError as exc:
                return status, exc.code
            return status, ""

    assert asyncio.run(run()) == ({"serving": None, "versions": []}, "adapter_unavailable")


def test_a_published_fleet_version_is_served_again_after_a_restart(
    start_daemon: Callable, tiny_model: Path, tmp_path: Path
) -> None:
    first = start_daemon(extra_args=["--set", "finetune.enabled=false"])
    with first.client() as c:
        c.fleet_publish(str(_adapter(_staging(first) / "round1", ModelConfig.from_dir(tiny_model), seed=1)),
                        _key(first))
        with_v1 = _greedy(c)
    code, _ = first.stop()
    assert code == 0, first.log()
    second = start_daemon(extra_args=["--set", "finetune.enabled=false", "--state-dir", str(first.state_dir)])
    with second.client() as c:
        assert c.status()["adapters"]["fleet_serving"] == 1
        assert c.fleet_status()["serving"] == 1 and _greedy(c) == with_v1
