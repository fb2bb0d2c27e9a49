"""The daemon's admin side of the shared fleet adapter (issue #20): publish a version from a PEFT
folder on the device, roll back, list. The folder is read and checked against the served model off
the engine thread; the versioned registry work (`Engine.publish_fleet` / `rollback_fleet`) runs on
it. An aggregator's publish names its run and round, and each is served at most once (replays are
refused, `PublishedRounds`). Knows nothing of consent or federated rounds; who may publish is
`operator.py`'s.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon.fleet.device.operator import FleetOperator
from daemon.wire import FleetPublishArgs, FleetRollbackArgs, ProtocolError
from edge_runtime.lora.adapter import load_adapter
from edge_runtime.lora.config import AdapterError
from edge_runtime.lora.registry import FLEET

if TYPE_CHECKING:
    from daemon.engine_thread import EngineThread
    from daemon.fleet.device.rounds import FleetRounds
    from edge_runtime.engine import Engine
    from edge_runtime.lora.weights import LoraWeights
    from edge_runtime.model.config import ModelConfig


async def publish(engine: EngineThread, args: FleetPublishArgs, operator: FleetOperator) -> dict[str, Any]:
    """Make the adapter in `args.path` the fleet's next version, beneath every user's adapter for
    new requests (running ones finish on the version they started with). The operator's only,
    from the publish folder only; with an aggregator's run id and round, refused unless that round
    is newer than the run's last published one."""
    operator.require(args.operator_key, "fleet.publish")
    path = operator.publish_path(args.path)
    if args.run_id is None or args.round is None:
        return await _publish(engine, path)
    rounds = operator.published
    async with rounds.lock:
        rounds.check(args.run_id, args.round)
        result = await _publish(engine, path)
        await asyncio.to_thread(rounds.record, args.run_id, args.round)
        return result


async def _publish(engine: EngineThread, path: Path) -> dict[str, Any]:
    cfg = await engine.call(lambda e: e.adapters.model_cfg)
    weights = await asyncio.to_thread(read_fleet_adapter, path, cfg)
    ref = await engine.call(lambda e: e.publish_fleet(weights, source=str(path)))
    return {"version": ref.version, "serving": ref.version, "rank": weights.settings.rank,
            "target_modules": list(weights.settings.target_modules)}


def read_fleet_adapter(path: Path, cfg: ModelConfig) -> LoraWeights:
    """Read a PEFT LoRA folder and check it fits the served model, or raise `bad_request` naming
    what does not fit (missing files, LoRA variant, targets, layer, shapes)."""
    if not path.is_dir():
        raise ProtocolError("bad_request", f"{path} is not a folder on the daemon's machine", param="path")
    try:
        return load_adapter(path, cfg)
    except AdapterError as exc:
        raise ProtocolError("bad_request", f"{path} cannot be the fleet adapter: {exc}", param="path") from None
    except (KeyError, ValueError, TypeError) as exc:  # a config without "r", a non-numeric rank...
        raise ProtocolError("bad_request", f"{path} is not a PEFT LoRA adapter this runtime reads: "
                            f"adapter_config.json has a missing or malformed field ({type(exc).__name__}: "
                            f"{exc})", param="path") from None


async def rollback(engine: EngineThread, args: FleetRollbackArgs, operator: FleetOperator) -> dict[str, Any]:
    """Retire the fleet's newest version, or every version newer than `args.version` (0: none);
    the operator's only."""
    operator.require(args.operator_key, "fleet.rollback")
    version = args.version
    def roll(e: Engine) -> dict[str, Any]:
        before = e.adapters.versions(FLEET)
        now = e.rollback_fleet(version, reason="fleet rollback requested through the API")
        return {"serving": None if now is None else now.version,
                "retired": [v for v in before if v not in e.adapters.versions(FLEET)]}

    try:
        return await engine.call(roll, parked=roll)  # ParkedEngine has the registry and rollback_fleet
    except AdapterError as exc:
        raise ProtocolError("adapter_unavailable", str(exc), param="version") from None


async def status(engine: EngineThread, rounds: FleetRounds | None = None) -> dict[str, Any]:
    """The fleet version new requests get (None: none) and every version that can be served; with
    `rounds` (fleet rounds on), this device's privacy spent, its budgets and floors."""
    def listing(e: Engine) -> dict[str, Any]:
        registry = e.adapters
        newest = registry.newest(FLEET)
        published = {ev.get("version"): ev for ev in registry.events(FLEET) if ev.get("kind") == "published"}
        versions = [{"version": v, "created_at": published.get(v, {}).get("time"),
                     "source": published.get(v, {}).get("source"),
                     "active": newest is not None and newest.version == v}
                    for v in registry.versions(FLEET)]
        return {"serving": None if newest is None else newest.version, "versions": versions}

    result = await engine.call(listing, parked=listing)  # the registry alone: no reload
    if rounds is not None:
        result["rounds"] = rounds.status()
    return result
