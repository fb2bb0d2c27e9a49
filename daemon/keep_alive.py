"""Giving memory back when idle (`engine.keep_alive`, docs/keep_alive.md): when an idle engine is
unloaded, the figures `status` and `/metrics` show, the parked stand-in that answers adapter
commands while no model is loaded, and handing freed heap back to the OS. The engine thread
(daemon/engine_thread.py) does the unloading and reloading; nothing here touches a live engine.
"""

from __future__ import annotations

import gc
import logging
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psutil

from edge_runtime.c_heap import give_heap_back
from edge_runtime.lora.registry import FLEET

if TYPE_CHECKING:
    from daemon.admission import AdmissionController
    from edge_runtime.engine import Engine
    from edge_runtime.lora.registry import AdapterRef, AdapterRegistry

log = logging.getLogger(__name__)

LOADED, UNLOADING, UNLOADED, LOADING = "loaded", "unloading", "unloaded", "loading"
MODEL_STATES = (LOADED, UNLOADING, UNLOADED, LOADING)
# Engine stats that stay true while the model is away (what is served, not what is held).
_FACTS = ("model", "backend", "device", "dtype", "max_context", "block_size", "policy")


@dataclass
class KeepAlive:
    """The keep-alive policy and its figures. `keep_alive_s`: seconds an idle engine stays
    loaded (0: unload as soon as idle; negative: never). `holds()` says why the model must stay
    although the engine has nothing queued (requests being admitted, fine-tuning between its
    jobs); `pressure` is set from telemetry when device memory is short (unload once idle,
    whatever `keep_alive_s` says, unless it is negative). The engine thread writes the figures;
    the event loop reads them (plain values, replaced whole)."""

    keep_alive_s: float = 300.0
    holds: Callable[[], str | None] = lambda: None
    pressure: str | None = None
    clock: Callable[[], float] = time.monotonic
    state: str = LOADED
    unloads: int = 0
    pressure_unloads: int = 0
    reloads: int = 0
    reload_failures: int = 0
    last_reload_s: float | None = None
    last_unload_s: float | None = None
    last_unload_reason: str = ""
    rss_before_unload_bytes: int | None = None
    rss_after_unload_bytes: int | None = None
    unloaded_at: float | None = None
    released_engine_referenced: bool = False  # the unloaded engine outlived its unload (a leak)
    refused: str = ""  # why this engine is never unloaded (e.g. adapters that live only in memory)
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return self.keep_alive_s >= 0 and not self.refused

    def held(self) -> str | None:
        """Why the model must stay loaded now, or None; a check that fails holds it."""
        try:
            return self.holds()
        except Exception:  # read across threads: never let it take the engine loop down
            log.exception("checking what holds the model failed; keeping it loaded")
            return "the check failed"

    def unload_reason(self, idle_s: float) -> str | None:
        """Why an engine idle for `idle_s` seconds (nothing queued, nothing held) is unloaded
        now, or None to keep it."""
        if not self.enabled:
            return None
        if self.pressure:
            return f"device memory pressure ({self.pressure})"
        if idle_s >= self.keep_alive_s:
            return f"idle for {idle_s:.1f} s (keep_alive {self.keep_alive_s:g} s)"
        return None

    def unloaded(self, reason: str, seconds: float, rss_before: int, rss_after: int, referenced: bool) -> None:
        self.unloads += 1
        self.pressure_unloads += reason.startswith("device memory pressure")
        self.last_unload_s, self.last_unload_reason = seconds, reason
        self.rss_before_unload_bytes, self.rss_after_unload_bytes = rss_before, rss_after
        self.released_engine_referenced = referenced
        self.unloaded_at = self.clock()
        self.state = UNLOADED
        self._remember({"event": "unloaded", "reason": reason, "seconds": round(seconds, 3),
                        "rss_before_bytes": rss_before, "rss_after_bytes": rss_after})

    def reloaded(self, seconds: float, error: str | None = None) -> None:
        if error is None:
            self.reloads += 1
            self.last_reload_s = seconds
            self.unloaded_at = None
            self.state = LOADED
        else:
            self.reload_failures += 1
            self.state = UNLOADED
        self._remember({"event": "reloaded" if error is None else "reload_failed",
                        "seconds": round(seconds, 3), **({"error": error} if error else {})})

    def _remember(self, event: dict[str, Any]) -> None:
        self.history = [*self.history[-15:], {"t": round(self.clock(), 3), **event}]

    def status(self) -> dict[str, Any]:
        """`status`'s `keep_alive` section (and the /metrics gauges read from it)."""
        now = self.clock()
        return {"state": self.state, "keep_alive_s": self.keep_alive_s, "enabled": self.enabled,
                "refused": self.refused or None, "pressure": self.pressure,
                "unloaded_for_s": None if self.unloaded_at is None else round(now - self.unloaded_at, 3),
                "unloads": self.unloads, "pressure_unloads": self.pressure_unloads,
                "reloads": self.reloads, "reload_failures": self.reload_failures,
                "last_reload_s": _rounded(self.last_reload_s), "last_unload_s": _rounded(self.last_unload_s),
                "last_unload_reason": self.last_unload_reason or None,
                "rss_before_unload_bytes": self.rss_before_unload_bytes,
                "rss_after_unload_bytes": self.rss_after_unload_bytes,
                "released_engine_referenced": self.released_engine_referenced,
                "history": list(self.history)}


class ParkedEngine:
    """What an unloaded engine leaves behind: its adapter registry (the files under the state
    directory; its weight cache emptied), so listing, rollback and erasure work with no model
    loaded. Nothing runs on it and nothing is queued in it; a command that needs more reloads
    the model (EngineThread.call without `parked`)."""

    def __init__(self, adapters: AdapterRegistry, finetune_paused: str | None) -> None:
        self.adapters = adapters
        self.finetune_paused = finetune_paused  # handed to the engine that is loaded next
        self.requests: dict[str, Any] = {}

    def rollback_adapter(self, user: str, to_version: int | None = None, reason: str = "") -> AdapterRef | None:
        return self.adapters.rollback(user, to_version, reason)

    def rollback_fleet(self, to_version: int | None = None, reason: str = "") -> AdapterRef | None:
        return self.adapters.rollback(FLEET, to_version, reason)

    def cancel_finetune(self, job_id: str | None = None, *, user: str | None = None) -> int:
        return 0  # an engine is unloaded only with no fine-tune job queued

    def pause_finetune(self, reason: str) -> None:
        self.finetune_paused = reason

    def resume_finetune(self) -> None:
        self.finetune_paused = None


class ModelSlot:
    """The engine thread's one reference to its engine, and what unloading and loading it again
    do to it (called on the engine thread only). `release_hooks` run before an unload lets go."""

    def __init__(self, load: Callable[[], Engine], keep_alive: KeepAlive) -> None:
        self.load = load
        self.keep_alive = keep_alive
        self.engine: Engine | None = None
        self.parked: ParkedEngine | None = None
        self.release_hooks: list[Callable[[], None]] = []
        self.frozen = False  # maced moved what it loaded out of the collector's reach (gc.freeze)

    def adopt(self, engine: Engine) -> None:
        self.engine = engine

    def can_unload(self) -> bool:
        """False, and keep-alive refused for good, where unloading would lose what only the engine
        holds: adapters that live in memory alone (no adapters_root to load them from again)."""
        engine = self.engine
        if engine is not None and engine.adapters.root is None:
            self.keep_alive.refused = "its adapters live only in memory (no adapters_root)"
            log.warning("engine.keep_alive is off: this engine's %s", self.keep_alive.refused)
            return False
        return engine is not None

    def unload(self, reason: str) -> None:
        """Let go of the engine (model, graphs, KV slab, prefix and adapter caches) and hand the
        memory back to the OS; its adapter registry stays, parked. The caller holds no reference."""
        keep_alive = self.keep_alive
        keep_alive.state = UNLOADING
        start = time.monotonic()
        rss_before = process_rss_bytes()
        engine = self.engine
        assert engine is not None
        for hook in self.release_hooks:
            try:
                hook()
            except Exception:  # a hook that fails costs memory, never the engine
                log.exception("a release hook failed before unloading the model")
        engine.prefixes.close()  # its queued prefix blocks reach the disk; a reload reads them back
        adapters = engine.adapters
        adapters.cache.shrink(0)
        self.parked = ParkedEngine(adapters, engine.finetune_stats().get("finetune_paused"))
        gone = weakref.ref(engine)
        self.engine = None
        del engine
        self.frozen = gc.get_freeze_count() > 0
        return_freed_memory()
        referenced = gone() is not None
        if referenced:
            log.warning("the unloaded engine is still referenced somewhere: its memory was not returned")
        rss_after = process_rss_bytes()
        seconds = time.monotonic() - start
        keep_alive.unloaded(reason, seconds, rss_before, rss_after, referenced)
        log.info("model unloaded (%s) in %.2f s: resident memory %.0f -> %.0f MiB", reason, seconds,
                 rss_before / 2**20, rss_after / 2**20)

    def reload(self) -> Engine | None:
        """Load the model again (commands arriving meanwhile wait in the engine thread's queue);
        None if that fails (the parked registry stays)."""
        keep_alive = self.keep_alive
        keep_alive.state = LOADING
        start = time.monotonic()
        try:
            engine = self.load()
        except Exception as exc:
            seconds = time.monotonic() - start
            keep_alive.reloaded(seconds, error=f"{type(exc).__name__}: {exc}")
            log.error("loading the model again failed after %.2f s: %s", seconds, exc)
            return_freed_memory()
            return None
        if self.frozen:  # as maced does after its start: the model's objects stay out of full collections
            gc.freeze()
        parked, self.parked = self.parked, None
        if parked is not None and parked.finetune_paused:
            engine.pause_finetune(parked.finetune_paused)
        unloaded_s = keep_alive.status()["unloaded_for_s"]
        seconds = time.monotonic() - start
        keep_alive.reloaded(seconds)
        log.info("model loaded again in %.2f s (it had been unloaded for %s s)", seconds, unloaded_s)
        return engine


def model_facts(engine: Engine) -> dict[str, Any]:
    """Facts about the loaded model that never change (read once, on the engine thread)."""
    from edge_runtime.memory import MemoryKind
    from edge_runtime.sizing import parameter_count

    # The ledger's weights: the model as this process holds it (a GGUF's blocks, read a layer at a
    # time where a graph serves) plus the backend's own copy (ONNX Runtime's pre-packed weights).
    weights = engine.ledger.held(MemoryKind.WEIGHTS)
    choice = engine.backend_choice
    return {"weights_bytes": int(weights), "parameters": parameter_count(engine.model),
            "backend_requested": choice.requested, "quantization": choice.quantization,
            "backend_reason": choice.reason}


def parked_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """The engine stats published while unloaded: the facts of what is served, nothing held."""
    kept = {k: stats[k] for k in _FACTS if k in stats}
    return {**kept, "requests_in_flight": 0, "kv_blocks_total": 0, "kv_blocks_used": 0,
            "kv_cache_bytes": 0, "adapter_cache_bytes": 0, "adapters_cached": 0}


def process_rss_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


def return_freed_memory() -> bool:
    """Collect the engine's reference cycles, hand CUDA's cached blocks back to the driver, and
    ask glibc to return free heap to the OS: without `malloc_trim` the arenas that held the
    weights' staging copies and the KV slab's pages stay resident after they are freed.
    Returns whether `malloc_trim` ran (glibc only)."""
    # maced freezes what it loaded (daemon/main.py: full collections stop scanning the model),
    # and the engine's reference cycles are among it: unfreeze to collect them, freeze the rest again.
    frozen = gc.get_freeze_count() > 0
    if frozen:
        gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return give_heap_back()


def memory_pressure(admission: AdmissionController | None) -> str | None:
    """The figures when device memory headroom alone puts admission at `queue` or worse (its
    memory rung, with its hysteresis), else None: an idle model is then unloaded early, the
    cheapest relief there is. Not at `shed_finetune` (4 GiB on the Jetson defaults): a shared
    machine sits there for long spells, and every request after an idle moment would reload."""
    if admission is None:
        return None
    from daemon.admission import AdmissionState

    headroom = admission.signals.memory_headroom_mb
    rung = admission.config.memory_headroom_mb.get(AdmissionState.QUEUE)
    if headroom is None or rung is None:
        return None
    holding = admission.state.level >= AdmissionState.QUEUE.level
    if not rung.crossed(headroom, holding):
        return None
    limit = rung.enter if headroom < rung.enter else rung.exit  # the bound it is under, leaving included
    return f"memory headroom {headroom:.0f} MiB < {limit:.0f} MiB"


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def service_holds(service: Any) -> str | None:
    """What on the service's side needs the model although the engine has nothing queued:
    generates and embeddings being admitted or answered, fine-tuning between its jobs, a fleet
    round; and a start or a shutdown in progress. `service` is daemon.service.Service (which
    imports this module)."""
    if service.state != "serving":
        return f"the daemon is {service.state}"
    if service.ops_in_flight or service.calls:
        return "requests in flight"
    if (tuning := service.fine_tuner.holds_model()) is not None:
        return tuning
    if service.fleet_rounds is not None and service.fleet_rounds.busy:
        return "a fleet round"
    return None
