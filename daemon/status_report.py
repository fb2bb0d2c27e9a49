"""What the service knows of the device and itself: the stream of telemetry readings and memory
budgets that feeds admission, and the `status` op's report assembled from the service's parts
(engine thread stats, memory ledger, telemetry, admission, feedback store, fine-tuner, fleet).
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import psutil

from daemon import VERSION
from daemon.principals import Principal, split_stored
from daemon.wire import PROTOCOL_VERSION
from edge_runtime.errors import MaceError
from edge_runtime.telemetry import (
    MemoryBudget,
    PsutilSource,
    TelemetryReading,
    TelemetryUnavailable,
    select_budgeter,
    select_source,
)
from edge_runtime.telemetry.config import TelemetryConfig

log = logging.getLogger("daemon.service")

async def status_report(service: Any, who: Principal) -> dict[str, Any]:
    """The `status` op's reply: the daemon, model, engine, latency, queues, memory, telemetry,
    admission, feedback store, fine-tuning, adapters and fleet, as they stand now. `service` is
    the daemon.service.Service (not imported here: it imports this module). An app's report
    names only its own users (counts stay device-wide: they name no one)."""
    out: dict[str, Any] = {
        "daemon": {"version": VERSION, "protocol": PROTOCOL_VERSION, "pid": os.getpid(),
                   "state": service.state, "uptime_s": round(time.monotonic() - service.started_at, 3),
                   "python": sys.version.split()[0], "config_file": str(service.config.file or ""),
                   "counters": dict(service.counters)},
    }
    stats: dict[str, Any] = {}
    latencies: list[float] = []
    if service.engine is not None and service.engine.stats:
        stats = dict(service.engine.stats)
        stats["stats_age_s"] = round(time.monotonic() - service.engine.stats_at, 3)
        latencies = service.engine.stats_latencies_s
    info = service.engine.model_info if service.engine is not None else {}
    out["model"] = {k: stats.get(k) for k in ("model", "backend", "device", "dtype", "max_context")}
    out["model"].update(info)
    out["engine"] = {k: v for k, v in stats.items() if k not in out["model"]}
    # Loaded or given back (engine.keep_alive): the state, unload count and last reload time.
    out["keep_alive"] = service.keep_alive.status()
    out["latency"] = {"iteration_ms": _summary_ms(latencies)}
    snap = service.engine.snapshot if service.engine is not None else None
    out["queues"] = {"engine_waiting": snap.waiting if snap else 0,
                     "engine_running": snap.running if snap else 0,
                     "admission_queued": service.admission_queued,
                     "generates_in_flight": len(service.calls)}
    out["memory"] = _memory(service, stats, info)
    out["telemetry"] = _telemetry(service)
    out["admission"] = service.admission.status() if service.admission else {"state": "off"}
    out["feedback"] = await _feedback_stats(service)
    finetune = service.fine_tuner.status()
    out["finetune"] = finetune
    out["alignment"] = finetune.get("alignment", {})
    if service.http is not None:
        out["http"] = service.http.summary()
    out["adapters"] = {"trainer": service.fine_tuner.name,
                       "users": stats.get("adapter_users", 0),
                       "versions_served": stats.get("adapter_versions", 0),
                       "versions_recorded": out["feedback"].get("adapter_versions", 0),
                       "cached": stats.get("adapters_cached", 0),
                       "fleet_serving": service.fleet_serving}
    if service.fleet_rounds is not None:
        out["fleet"] = service.fleet_rounds.status()
    out["principal"] = {"kind": who.kind, "app": None if who.is_operator else who.app}
    if not who.is_operator:
        _app_view(finetune, who.app)
    return out


def _app_view(finetune: dict[str, Any], app: str) -> None:
    """Fine-tuning's status as an app may see it: its own users' work in progress, by their
    plain ids; the guard's last decision (whose reason names a user) left out."""
    current = finetune.get("current") or {}
    own = {split_stored(u)[1]: rows for u, rows in current.items() if split_stored(u)[0] == app}
    finetune["current"] = own or None
    finetune.pop("last_guard", None)

def _memory(service: Any, stats: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    # Until the runtime's MemoryLedger lands, the ledger is what the daemon can account for.
    weights = int(info.get("weights_bytes", 0)) if service.keep_alive.state == "loaded" else 0
    ledger = {"weights": weights, "kv_cache": int(stats.get("kv_cache_bytes", 0)),
              "adapter_cache": int(stats.get("adapter_cache_bytes", 0) or 0)}
    ledger.update(service.fine_tuner.memory_bytes())
    held = sum(ledger.values())
    memory: dict[str, Any] = {"ledger": ledger, "ledger_bytes": held,
                              "process_rss_bytes": psutil.Process().memory_info().rss}
    if service.budget is not None:
        memory["budget"] = {"kind": service.budget.kind, "available_mb": round(service.budget.available_mb, 1),
                            "reserve_mb": service.budget.reserve_mb,
                            "headroom_mb": round(service.budget.headroom_mb, 1),
                            "source": service.budget.source,
                            "capacity_bytes": service.budget.ledger_capacity_bytes(held),
                            "describe": service.budget.describe()}
    return memory

def _telemetry(service: Any) -> dict[str, Any]:
    r = service.reading
    if r is None:
        return {"source": None}
    keys = ("source", "unified_memory", "ram_used_mb", "ram_total_mb", "mem_available_mb",
            "swap_used_mb", "gpu_util_pct", "emc_util_pct", "max_temp_c", "total_power_mw")
    out = {k: getattr(r, k) for k in keys}
    out["age_s"] = round(time.monotonic() - r.t, 3)
    return out

async def _feedback_stats(service: Any) -> dict[str, Any]:
    if service.astore is None:
        return {"enabled": service.config.feedback.enabled, "open": False}
    try:
        stats = (await service.astore.stats()).as_dict()
    except MaceError as exc:
        return {"enabled": True, "open": False, "error": str(exc)}
    return {"enabled": True, "open": True, **stats}


def _summary_ms(samples_s: list[float]) -> dict[str, Any]:
    if not samples_s:
        return {"samples": 0}
    ms = sorted(s * 1000 for s in samples_s)
    return {"samples": len(ms), "last": round(samples_s[-1] * 1000, 3), "mean": round(statistics.fmean(ms), 3),
            "p50": round(ms[len(ms) // 2], 3), "p99": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 3)}


async def telemetry_readings(cfg: TelemetryConfig) -> AsyncIterator[tuple[TelemetryReading, MemoryBudget]]:
    """Readings and the memory budget each implies, forever: the configured source, then psutil
    whenever a source fails or ends (admission must never lose its signals)."""
    budgeter = select_budgeter(cfg)
    try:
        source = select_source(cfg)
    except (ValueError, TelemetryUnavailable) as exc:
        log.warning("telemetry source unusable (%s); using psutil", exc)
        source = PsutilSource(cfg.interval_s)
    while True:
        try:
            async for reading in source:
                yield reading, budgeter.update(reading)
            log.warning("telemetry source %s ended; switching to psutil", source.name)
        except TelemetryUnavailable as exc:
            log.warning("telemetry source %s unavailable (%s); switching to psutil", source.name, exc)
        source = PsutilSource(cfg.interval_s)
