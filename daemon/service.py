"""The daemon's operations (generate, feedback, users, adapters, status, health) and the lifecycle
that wires the engine thread, feedback store, telemetry, admission control and fine-tuning hook.

Knows nothing about sockets: the server turns frames into calls here and results into replies.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import msgspec

from daemon import VERSION
from daemon.admission import AdmissionController, AdmissionSignals, AdmissionState
from daemon.calls import ABORTS, GenerateCall, candidate_record, engine_request, generate_result
from daemon.config import DaemonConfig
from daemon.engine_thread import EngineThread
from daemon.finetune import BaseModelOnly, FineTuner
from daemon.finetune.engine_tuner import EngineFineTuner
from daemon.fleet.device import admin as fleet
from daemon.fleet.device.rounds import FleetRounds
from daemon.inference_gate import InferenceGate
from daemon.keep_alive import LOADING, KeepAlive, memory_pressure, service_holds
from daemon.metrics import DaemonMetrics
from daemon.principals import OPERATOR_LOCAL, Identities, Principal, forbidden, load_identities
from daemon.privacy import LogPseudonyms
from daemon.sdnotify import Notifier, Watchdog
from daemon.status_report import status_report, telemetry_readings
from daemon.user_ops import UserOps, own_names
from daemon.wire import (
    EmbedArgs,
    FleetEvaluateArgs,
    FleetPublishArgs,
    FleetRollbackArgs,
    FleetRoundArgs,
    GenerateArgs,
    NoArgs,
    ProtocolError,
)
from edge_runtime.chat import CallStreamer, tool_style
from edge_runtime.engine import Engine
from edge_runtime.errors import MaceError
from edge_runtime.feedback import AsyncFeedbackStore, FeedbackStore
from edge_runtime.lora.registry import FLEET
from edge_runtime.outputs import RequestOutput
from edge_runtime.telemetry import (
    MemoryBudget,
    TelemetryReading,
)

__all__ = ["VERSION", "GenerateCall", "Service", "load_engine"]

log = logging.getLogger(__name__)

# How long a stop waits for fine-tuning to stop (drain 5 s + calls 3 s + this + the engine
# thread's 5 s stay inside systemd's TimeoutStopSec=30).
FINETUNE_STOP_S = 10.0


def load_engine(config: DaemonConfig) -> Engine:
    """The default loader: the configured model (None = the default SmolLM2) on this machine."""
    # Adapters live beside the feedback store's idea of them: forget() deletes <root>/<user>/.
    return Engine.load(None, config.engine.replace(adapters_root=str(config.adapters_dir),
                                                   prefix_store_dir=str(config.prefix_store_dir)))


class Service:
    """Lifecycle: `await start()` (model loaded, store open) ... `await shutdown()`."""

    def __init__(
        self,
        config: DaemonConfig,
        *,
        engine_loader: Callable[[], Engine] | None = None,
        notifier: Notifier | None = None,
        watchdog: Watchdog | None = None,
        fine_tuner: FineTuner | None = None,
    ) -> None:
        self.config = config
        self.identities: Identities = load_identities(config)
        self.users = UserOps(self)
        self._engine_loader = engine_loader or (lambda: load_engine(config))
        self.notifier = notifier or Notifier({})
        self.watchdog = watchdog or Watchdog(self.notifier, None)
        self.fine_tuner: FineTuner = fine_tuner or BaseModelOnly(None)
        self._custom_tuner = fine_tuner is not None
        self.state = "starting"  # starting, loading, serving, draining, stopped, failed
        self.started_at = time.monotonic()
        self.engine: EngineThread | None = None
        self.fleet_serving: int | None = None  # the fleet version new requests get (status)
        self.fleet_rounds: FleetRounds | None = None  # once the engine serves
        self.fleet_operator: fleet.FleetOperator | None = None  # who may publish / roll back, from where
        self.model_name = ""
        self.tool_style = "hermes"  # how the served model writes tool calls (edge_runtime.chat)
        self.store: FeedbackStore | None = None
        self.astore: AsyncFeedbackStore | None = None
        self.admission: AdmissionController | None = None
        self.reading: TelemetryReading | None = None
        self.budget: MemoryBudget | None = None
        self.calls: set[GenerateCall] = set()
        self.gate = InferenceGate()  # generates in flight per client, admission's waiting room
        self.ops_in_flight = 0
        self.counters = {"generate": 0, "generate_failed": 0, "interactions_recorded": 0, "embed": 0,
                         "feedback": 0, "cancelled": 0}
        self.metrics = DaemonMetrics()
        self.http: Any = None  # the HTTP gateway when one serves (its summary goes into status)
        self.fatal = asyncio.Event()  # set when the engine is broken: the process must exit
        self.fatal_reason = ""
        self._tasks: list[asyncio.Task[Any]] = []
        self._last_state = AdmissionState.NORMAL
        self.keep_alive = KeepAlive(config.keep_alive.keep_alive, holds=lambda: service_holds(self))

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the store, start telemetry and the engine thread; returns once the model serves."""
        loop = asyncio.get_running_loop()
        if self.config.feedback.enabled:
            self.store, self.astore = await asyncio.to_thread(self._open_store)
            if not self._custom_tuner:
                self.fine_tuner = BaseModelOnly(self.store)
        if self.config.admission.enabled:
            self.admission = AdmissionController(self.config.admission_config)
        self._tasks.append(asyncio.create_task(self._tick_loop(), name="tick"))
        if self.config.admission.enabled and self.config.admission.telemetry:
            self._tasks.append(asyncio.create_task(self._telemetry_loop(), name="telemetry"))
        self.state = "loading"
        self.notifier.status(f"loading model {self.config.engine.model or 'default'}")
        self.engine = EngineThread(self._engine_loader, loop, on_alive=self.watchdog.engine_alive,
                                   on_dead=self._engine_died, keep_alive=self.keep_alive)
        try:
            engine = await self.engine.start()
        except BaseException:
            self.state = "failed"
            raise
        self.model_name = engine.model_name
        self.tool_style = tool_style(engine.tokenizer)
        del engine  # the engine thread's is the one reference (engine.keep_alive unloads it)
        newest_fleet = await self.engine.call(lambda e: e.adapters.newest(FLEET))
        self.fleet_serving = None if newest_fleet is None else newest_fleet.version
        self.fleet_rounds = FleetRounds(self.engine, self.store, lambda: self.config.fleet, self.config.state_dir,
                                        self._shedding_finetune, lambda: self.config.fleet_terms)
        self.fleet_operator = fleet.FleetOperator(self.config.state_dir, self.config.fleet_terms.publish_dir)
        if not self._custom_tuner:
            tuner = EngineFineTuner(self.engine, self.store, self.config.finetune,
                                    pseudonyms=LogPseudonyms.from_state_dir(self.config.state_dir))
            tuner.start()
            self.engine.on_release(tuner.release_model)
            self.fine_tuner = tuner
        self.state = "serving"

    def _open_store(self) -> tuple[FeedbackStore, AsyncFeedbackStore]:
        store = FeedbackStore(self.config.db_path, adapters_root=self.config.adapters_dir,
                              config=self.config.feedback_store)
        return store, AsyncFeedbackStore(store)

    def _engine_died(self, exc: BaseException) -> None:
        self.fatal_reason = f"the engine keeps failing: {type(exc).__name__}: {exc}"
        log.critical("%s; exiting so the service manager restarts the daemon", self.fatal_reason)
        self.fatal.set()

    async def shutdown(self, reason: str = "shutting_down") -> None:
        """Stop admitting, let generations finish for drain_timeout_s, cancel the rest with a
        reason, stop fine-tuning (nothing unpublished is published), stop the engine thread,
        flush the store."""
        if self.state in ("draining", "stopped"):
            return
        self.state = "draining"
        drain_s = self.config.server.drain_timeout_s
        self.notifier.stopping(f"draining {len(self.calls)} generation(s) for up to {drain_s:g} s")
        log.info("draining: %d generation(s) in flight, waiting up to %.1f s", len(self.calls), drain_s)
        await self._wait(lambda: not self.calls, drain_s)
        for call in list(self.calls):
            self.cancel(call, reason)
        # Cancelled generations still record their interaction and reply: let them.
        await self._wait(lambda: self.ops_in_flight == 0, 3.0)
        try:
            # Bounded: it waits for the engine thread between two forwards, which a large model's
            # forward (or a calibration shape) can make long, and systemd stops waiting at 30 s.
            # Nothing is lost past the bound: unpublished items are still pending in the store.
            await asyncio.wait_for(self.fine_tuner.checkpoint(), FINETUNE_STOP_S)
        except asyncio.TimeoutError:
            log.warning("fine-tuning did not stop within %.0f s; exiting without it", FINETUNE_STOP_S)
        except Exception:
            log.exception("stopping fine-tuning failed")
        if self.engine is not None:
            self.engine.stop(reason)
            if not await self.engine.join(5.0):
                log.error("the engine thread did not stop within 5 s")
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.store is not None:
            # Acknowledged feedback is committed already; closing drains writes still queued.
            await asyncio.to_thread(self.store.close)
        self.state = "stopped"
        log.info("stopped")

    @staticmethod
    async def _wait(done: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def reload(self, config: DaemonConfig) -> None:
        """Apply the settings that are safe to change at run time (see config.RELOADABLE)."""
        self.config = config
        self.identities = load_identities(config)  # checked already by main's reload
        self.keep_alive.keep_alive_s = config.keep_alive.keep_alive
        if hasattr(self.fine_tuner, "settings"):
            self.fine_tuner.settings = config.finetune  # type: ignore[attr-defined]
        if self.admission is not None:
            current = self.admission.config
            for key in ("min_dwell_s", "stale_after_s", "retry_after_s", "power_budget_mw"):
                setattr(current, key, getattr(config.admission_config, key))

    # -- background -----------------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        period = min(0.5, self.watchdog.period_s / 4)
        last_status = 0.0
        while True:
            self.watchdog.loop_alive()
            if (self.state == "loading" or self.keep_alive.state == LOADING) and self.watchdog.enabled:
                # No engine loop to ping from; loading a model (again) is progress, not a hang.
                self.watchdog.notifier.send("WATCHDOG=1")
            if self.admission is not None:
                if self.config.admission.telemetry:
                    decision = self.admission.tick()
                else:
                    decision = self.admission.observe(AdmissionSignals(queue_length=self.queue_length))
                self._apply_admission(decision.state)
            now = time.monotonic()
            if self.state == "serving" and now - last_status >= 10.0:
                last_status = now
                self.notifier.status(self.status_line())
            await asyncio.sleep(period)

    async def _telemetry_loop(self) -> None:
        async for reading, budget in telemetry_readings(self.config.telemetry):
            self.reading, self.budget = reading, budget
            assert self.admission is not None
            decision = self.admission.observe(AdmissionSignals.from_telemetry(reading, budget, self.queue_length))
            self._apply_admission(decision.state)
            self.keep_alive.pressure = memory_pressure(self.admission)

    def _apply_admission(self, state: AdmissionState) -> None:
        if state is self._last_state:
            return
        if state.level >= AdmissionState.SHED_FINETUNE.level > self._last_state.level:
            self.fine_tuner.pause(self.admission.decision.reason if self.admission else state.value)
        elif state is AdmissionState.NORMAL:
            self.fine_tuner.resume()
        self._last_state = state

    def _shedding_finetune(self) -> str | None:
        """Why fine-tuning is shed now (admission at shed_finetune or worse), or None."""
        if self._last_state.level >= AdmissionState.SHED_FINETUNE.level:
            return self.admission.decision.reason if self.admission else self._last_state.value
        return None

    @property
    def admission_queued(self) -> int:
        return self.gate.queued

    @property
    def queue_length(self) -> int:
        waiting = self.engine.snapshot.waiting if self.engine is not None else 0
        return waiting + self.gate.queued

    def status_line(self) -> str:
        admission = self.admission.state.value if self.admission else "off"
        return (f"serving {self.model_name}: {len(self.calls)} generating, "
                f"{self.queue_length} queued, admission {admission}")

    # -- operations -----------------------------------------------------------------------------

    def _require(self, *states: str) -> None:
        if self.state in states:
            return
        if self.state in ("starting", "loading"):
            raise ProtocolError("not_ready", "the model is still loading; retry shortly", retry_after_s=1.0)
        if self.state == "failed":
            raise ProtocolError("model_unavailable", "the model failed to load; see the daemon's log")
        raise ProtocolError("shutting_down", "the daemon is shutting down")

    def cancel(self, call: GenerateCall, reason: str) -> None:
        """Stop a generate wherever it is (admission queue or engine); idempotent."""
        if call.cancel_reason is not None or call.done.done():
            return
        call.cancel_reason = reason
        if call.engine_id is not None and self.engine is not None:
            self.engine.abort(call.engine_id, reason)

    async def generate(self, args: GenerateArgs, call: GenerateCall) -> dict[str, Any]:
        """Run one generate for any front; its outcome and timings go into the metrics."""
        call.metrics = self.metrics
        outcome = "internal"
        result: dict[str, Any] | None = None
        try:
            result = await self._generate(args, call)
            outcome = "ok"
            return result
        except (ProtocolError, MaceError) as exc:
            outcome = exc.code
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            usage = result["usage"] if result is not None else {}
            self.metrics.finished(call.api, outcome, time.monotonic() - call.arrived,
                                  usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))

    async def _generate(self, args: GenerateArgs, call: GenerateCall) -> dict[str, Any]:
        self._require("serving")
        prompt, params = engine_request(args, self.config.engine.max_prompt_chars,
                                        self.config.server.default_max_tokens)
        plain = args.user
        if plain is not None:  # from here on the user is the stored id of the caller's app's user
            args = msgspec.structs.replace(args, user=self.users.stored(call.principal, None, plain))
        with own_names(args.user or "", plain or ""):  # errors name the user as the app does
            adapter, label = self.fine_tuner.resolve_adapter(args.user, args.adapter if args.user else "base")
        self.gate.check(call, args, self.config.limits)
        self.ops_in_flight += 1
        self.gate.enter(call, args.n)
        timer = None
        if args.timeout_s is not None:  # counted from arrival: admission waits count too
            timer = asyncio.get_running_loop().call_later(args.timeout_s, self.cancel, call, "timeout")
        try:
            await self.gate.admit(self.admission, call, self.config.server.admission_wait_s,
                                  self.config.admission_config.retry_after_s)
            with own_names(args.user or "", plain or ""):
                result = await self._run_generation(args, prompt, params, adapter, label, call)
            if plain is not None and isinstance(result["adapter"], str):  # "<stored>@3" as the app knows it
                result["adapter"] = result["adapter"].replace(str(args.user), plain, 1)
            return result
        finally:
            if timer is not None:
                timer.cancel()
            self.ops_in_flight -= 1
            self.gate.leave(call)

    async def _run_generation(self, args: GenerateArgs, prompt: Any, params: Any, adapter: Any,
                              label: str | None, call: GenerateCall) -> dict[str, Any]:
        assert self.engine is not None
        if call.cancel_reason is not None:
            code, message = ABORTS.get(call.cancel_reason, ("cancelled", call.cancel_reason))
            raise ProtocolError(code, message)
        interaction_id = f"ix-{secrets.token_hex(8)}"
        call.engine_id = interaction_id
        tools = args.tools if args.tool_choice != "none" else ()
        if tools and call.on_token is not None:  # the front streams this generation
            call.streamers = {i: CallStreamer(tools, self.tool_style) for i in range(params.n)}
        self.calls.add(call)
        self.counters["generate"] += 1
        try:
            await self.engine.submit(interaction_id, prompt, params, call, adapter, owner=args.user or "",
                                     scope=call.cache_scope)
            output, aborted, error = await call.done
        except MaceError:
            self.counters["generate_failed"] += 1
            raise
        finally:
            self.calls.discard(call)
        if error is not None or output is None:
            self.counters["generate_failed"] += 1
            raise ProtocolError("internal", str(error or "the engine returned no output"))
        if aborted is None:
            call.flush_streams()
        candidates = [candidate_record(c, tools, call, self.tool_style) for c in output.candidates]
        if aborted is not None:
            self.counters["cancelled"] += 1
            code, message = ABORTS.get(aborted, ("cancelled", aborted))
            raise ProtocolError(code, message, details={"interaction_id": interaction_id,
                                                        "partial": candidates})
        result = generate_result(interaction_id, self.model_name, output.adapter or label, output, candidates)
        timing = result["timing"]
        if args.echo:
            result["prompt_text"] = output.prompt
        if args.user is not None and args.record:
            result["recorded"], note = await self._record(args.user, interaction_id, output,
                                                          result["adapter"], timing)
            if note:
                result["record_note"] = note
        return result

    async def _record(self, user: str, interaction_id: str, output: RequestOutput, label: str | None,
                      timing: dict[str, float]) -> tuple[bool, str]:
        """Store the interaction so feedback can refer to it; only with the user's consent."""
        if self.astore is None:
            return False, "the feedback store is disabled"
        version = None
        if label and "@" in label and label.rsplit("@", 1)[1].isdigit():
            version = int(label.rsplit("@", 1)[1])
        try:
            await self.astore.record_interaction(
                # The answers the user saw, after the prompt they follow once their thinking is
                # dropped (docs/thinking.md): a pair never trains on the think block.
                user, interaction_id, output.answer_prompt or output.prompt, [c.text for c in output.candidates],
                model=self.model_name or "unknown", adapter_version=version, timings=timing)
        except MaceError as exc:
            if exc.code != "consent_required":
                log.warning("interaction %s not recorded: %s", interaction_id, exc)
            return False, str(exc)
        self.counters["interactions_recorded"] += 1
        return True, ""

    async def embed(self, args: EmbedArgs) -> dict[str, Any]:
        """Embeddings of the inputs (edge_runtime/embeddings.py), computed on the engine thread
        between iterations. Admission's reject and queue states refuse them (retry later)."""
        self._require("serving")
        assert self.engine is not None
        if self.admission is not None:
            verdict = self.admission.admit("inference")
            if verdict.action != "allow":
                retry = verdict.retry_after_s or self.config.admission_config.retry_after_s
                raise ProtocolError("admission_rejected", f"the device is under pressure ({verdict.reason}); "
                                    f"retry in {retry:g} s", retry_after_s=retry)
        inputs = list(args.inputs)
        self.ops_in_flight += 1
        try:
            vectors, tokens = await self.engine.call(lambda engine: engine.embed(inputs))
        finally:
            self.ops_in_flight -= 1
        self.counters["embed"] += 1
        return {"model": self.model_name, "embeddings": vectors, "usage": {"prompt_tokens": tokens}}

    def _store(self) -> AsyncFeedbackStore:
        self._require("serving", "draining", "loading")
        if self.astore is None:
            if self.config.feedback.enabled:  # store still opening, or already closed
                raise ProtocolError("store_unavailable", "the feedback store is not open")
            raise ProtocolError("not_supported", "the feedback store is disabled in this daemon's config")
        return self.astore

    # Fleet adapter admin ops (ZeroMQ only; the operator's alone, docs/security.md).

    @staticmethod
    def _operator(who: Principal, right: str) -> None:
        if not who.is_operator:
            raise forbidden(who, right)

    async def fleet_publish(self, args: FleetPublishArgs, who: Principal) -> dict[str, Any]:
        self._operator(who, "publish fleet adapters")
        self._require("serving")
        assert self.engine is not None and self.fleet_operator is not None
        result = await fleet.publish(self.engine, args, self.fleet_operator)
        self.fleet_serving = result["serving"]
        log.info("fleet adapter version %d published from %s", result["version"], args.path)
        return result

    async def fleet_rollback(self, args: FleetRollbackArgs, who: Principal) -> dict[str, Any]:
        self._operator(who, "roll back the fleet adapter")
        self._require("serving")
        assert self.engine is not None and self.fleet_operator is not None
        result = await fleet.rollback(self.engine, args, self.fleet_operator)
        self.fleet_serving = result["serving"]
        log.info("fleet adapter rolled back: retired %s, serving %s", result["retired"], result["serving"])
        return result

    async def fleet_status(self, args: NoArgs, who: Principal) -> dict[str, Any]:
        self._require("serving")
        assert self.engine is not None
        result = await fleet.status(self.engine, self.fleet_rounds if self.config.fleet.enabled else None)
        self.fleet_serving = result["serving"]
        return result

    # A round of the federated fleet (ZeroMQ only, like the other fleet ops): the Flower client
    # on this device calls them; nothing in their replies is feedback text.

    async def fleet_round(self, args: FleetRoundArgs, who: Principal) -> dict[str, Any]:
        self._operator(who, "run fleet rounds")
        self._require("serving")
        assert self.fleet_rounds is not None
        return await self.fleet_rounds.run(args)

    async def fleet_evaluate(self, args: FleetEvaluateArgs, who: Principal) -> dict[str, Any]:
        self._operator(who, "evaluate fleet adapters")
        self._require("serving")
        assert self.fleet_rounds is not None
        return await self.fleet_rounds.evaluate(args)

    def health(self) -> dict[str, Any]:
        return {"ok": self.state == "serving", "state": self.state, "model": self.model_name,
                "uptime_s": round(time.monotonic() - self.started_at, 3),
                "admission": self.admission.state.value if self.admission else "off",
                "model_state": self.keep_alive.state}

    async def status(self, who: Principal = OPERATOR_LOCAL) -> dict[str, Any]:
        """The whole report for the operator; an app's leaves out every user but its own."""
        return await status_report(self, who)
