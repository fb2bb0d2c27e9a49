"""The daemon's operations (generate, feedback, users, adapters, status, health) and the lifecycle
that wires the engine thread, feedback store, telemetry, admission control and fine-tuning hook.

Knows nothing about sockets: the server turns frames into calls here and results into replies.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import psutil

from daemon.admission import AdmissionController, AdmissionSignals, AdmissionState
from daemon.config import DaemonConfig
from daemon.engine_thread import EngineThread
from daemon.finetune import BaseModelOnly, FineTuner
from daemon.metrics import DaemonMetrics
from daemon.privacy import LogPseudonyms
from daemon.protocol import (
    PROTOCOL_VERSION,
    AdaptersListArgs,
    ConsentArgs,
    EmbedArgs,
    FeedbackArgs,
    FleetEvaluateArgs,
    FleetPublishArgs,
    FleetRollbackArgs,
    FleetRoundArgs,
    GenerateArgs,
    NoArgs,
    ProtocolError,
    RollbackArgs,
    UserArgs,
)
from daemon.sdnotify import Notifier, Watchdog
from edge_runtime.errors import MaceError
from edge_runtime.outputs import RequestOutput, TokenEvent

if TYPE_CHECKING:
    from edge_runtime.engine import Engine
    from edge_runtime.feedback import AsyncFeedbackStore, FeedbackStore
    from edge_runtime.telemetry import MemoryBudget, TelemetryReading

log = logging.getLogger(__name__)

VERSION = "0.1.0"


def logprob_record(lp: Any) -> dict[str, Any]:
    """A generated token's log-probability on the wire: the token, its log-probability, its
    bytes, and the alternatives as [token id, log-probability, bytes]."""
    return {"token_id": lp.token_id, "logprob": lp.logprob, "bytes": lp.bytes,
            "top": [[t, v, b] for t, v, b in lp.top]}
# (candidate index, new text, last token id, extra: `logprobs` of the piece's tokens and
# `tool_calls` completed in it, or None)
TokenCallback = Callable[[int, str, "int | None", "dict[str, Any] | None"], None]
# Reasons a generate can end early, as (error code, message for the client).
_ABORTS = {
    "cancelled": ("cancelled", "the request was cancelled by its client"),
    "timeout": ("timeout", "the request ran past its timeout_s"),
    "shutting_down": ("shutting_down", "the daemon is shutting down; the request was stopped"),
    "client_gone": ("cancelled", "the client disconnected"),
}


class GenerateCall:
    """One generate in flight: the front (ZeroMQ server or HTTP gateway) holds it to cancel it;
    the engine thread completes it. `api` names the front in the daemon's metrics."""

    def __init__(self, on_token: TokenCallback | None = None, api: str = "zmq", client: Any = None) -> None:
        self.on_token = on_token
        self.api = api
        self.client = client  # who sent it (a connection or an API key): admission's fairness unit
        self.done: asyncio.Future[tuple[RequestOutput | None, str | None, BaseException | None]] = (
            asyncio.get_running_loop().create_future())
        self.engine_id: str | None = None
        self.cancel_reason: str | None = None
        self.arrived = time.monotonic()
        self.first_token_at: float | None = None
        self.metrics: DaemonMetrics | None = None  # set by Service.generate
        self._last_at: dict[int, float] = {}
        # Streamed with tools offered: per candidate, the text is split into content and calls
        # as it arrives (edge_runtime.chat.CallStreamer); what went out is kept for the result.
        self.streamers: dict[int, Any] = {}
        self.streamed_content: dict[int, list[str]] = {}
        self.streamed_calls: dict[int, list[Any]] = {}

    def on_tokens(self, events: list[TokenEvent]) -> None:
        """One message per candidate per delivery: when the loop falls behind the engine, the
        tokens of several iterations travel together instead of as a backlog of messages."""
        if self.metrics is not None:
            self._observe(events)
        if self.on_token is None:
            return
        texts: dict[int, list[str]] = {}
        last_ids: dict[int, int | None] = {}
        logprobs: dict[int, list[dict[str, Any]]] = {}
        for event in events:
            if event.logprob is not None:
                logprobs.setdefault(event.index, []).append(logprob_record(event.logprob))
            if event.text:  # "" while a multi-byte character is incomplete: nothing to show yet
                texts.setdefault(event.index, []).append(event.text)
                last_ids[event.index] = event.token_id
        for index in sorted(set(texts) | set(logprobs)):
            extra = {"logprobs": logprobs[index]} if index in logprobs else {}
            self._send(index, "".join(texts.get(index, ())), last_ids.get(index), extra)

    def _send(self, index: int, text: str, token_id: int | None, extra: dict[str, Any]) -> None:
        assert self.on_token is not None
        streamer = self.streamers.get(index)
        if streamer is not None:
            pieces = streamer.feed(text)
            text = "".join(v for kind, v in pieces if kind == "content")
            calls = [v for kind, v in pieces if kind == "call"]
            self.streamed_content.setdefault(index, []).append(text)
            if calls:
                self.streamed_calls.setdefault(index, []).extend(calls)
                extra["tool_calls"] = [c.as_openai() for c in calls]
        if text or extra:
            self.on_token(index, text, token_id, extra or None)

    def flush_streams(self) -> None:
        """Deliver what the call streamers still hold (a final `<tool_call>` block, a held-back
        tag prefix that turned out to be text) before the final reply."""
        for index, streamer in self.streamers.items():
            pieces = streamer.finish()
            text = "".join(v for kind, v in pieces if kind == "content")
            calls = [v for kind, v in pieces if kind == "call"]
            self.streamed_content.setdefault(index, []).append(text)
            self.streamed_calls.setdefault(index, []).extend(calls)
            if (text or calls) and self.on_token is not None:
                self.on_token(index, text, None, {"tool_calls": [c.as_openai() for c in calls]} if calls else None)

    def on_finished(self, output: RequestOutput | None, aborted: str | None,
                    error: BaseException | None) -> None:
        if not self.done.done():
            self.done.set_result((output, aborted, error))

    def _observe(self, events: list[TokenEvent]) -> None:
        """TTFT, inter-token gaps and the tokens/s window, as the event loop receives tokens."""
        assert self.metrics is not None
        counts: dict[int, int] = {}
        for event in events:
            if event.token_id is not None:
                counts[event.index] = counts.get(event.index, 0) + 1
        if not counts:
            return
        now = time.monotonic()
        metrics, api = self.metrics, self.api
        if self.first_token_at is None:
            self.first_token_at = now
            metrics.ttft.labels(api).observe(now - self.arrived)
        itl = metrics.itl.labels(api)
        for index, k in counts.items():
            last = self._last_at.get(index)
            self._last_at[index] = now
            if last is not None:  # a candidate's first delivery has no gap before it
                gap = (now - last) / k
                for _ in range(k):
                    itl.observe(gap)
        metrics.tokens_arrived(now, sum(counts.values()))


def load_engine(config: DaemonConfig) -> Engine:
    """The default loader: the configured model (None = the default SmolLM2) on this machine."""
    from edge_runtime.engine import Engine

    # Adapters live beside the feedback store's idea of them: forget() deletes <root>/<user>/.
    return Engine.load(None, config.engine.replace(adapters_root=str(config.adapters_dir)))


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
        self._engine_loader = engine_loader or (lambda: load_engine(config))
        self.notifier = notifier or Notifier({})
        self.watchdog = watchdog or Watchdog(self.notifier, None)
        self.fine_tuner: FineTuner = fine_tuner or BaseModelOnly(None)
        self._custom_tuner = fine_tuner is not None
        self.state = "starting"  # starting, loading, serving, draining, stopped, failed
        self.started_at = time.monotonic()
        self.engine: EngineThread | None = None
        self.fleet_serving: int | None = None  # the fleet version new requests get (status)
        self.fleet_rounds: Any = None  # daemon.fleet_round.FleetRounds once the engine serves
        self.model_name = ""
        self.tool_style = "hermes"  # how the served model writes tool calls (edge_runtime.chat)
        self.store: FeedbackStore | None = None
        self.astore: AsyncFeedbackStore | None = None
        self.admission: AdmissionController | None = None
        self.reading: TelemetryReading | None = None
        self.budget: MemoryBudget | None = None
        self.calls: set[GenerateCall] = set()
        self.generating: Counter[Any] = Counter()  # generates in flight (admission included) per client
        self.ops_in_flight = 0
        self.admission_queued = 0
        self.counters = {"generate": 0, "generate_failed": 0, "interactions_recorded": 0, "embed": 0,
                         "feedback": 0, "cancelled": 0}
        self.metrics = DaemonMetrics()
        self.http: Any = None  # the HTTP gateway when one serves (its summary goes into status)
        self.fatal = asyncio.Event()  # set when the engine is broken: the process must exit
        self.fatal_reason = ""
        self._tasks: list[asyncio.Task[Any]] = []
        self._last_state = AdmissionState.NORMAL

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
                                   on_dead=self._engine_died)
        try:
            engine = await self.engine.start()
        except BaseException:
            self.state = "failed"
            raise
        self.model_name = engine.model_name
        from edge_runtime.chat import tool_style

        self.tool_style = tool_style(engine.tokenizer)
        from edge_runtime.lora.registry import FLEET

        newest_fleet = await self.engine.call(lambda e: e.adapters.newest(FLEET))
        self.fleet_serving = None if newest_fleet is None else newest_fleet.version
        from daemon.fleet_round import FleetRounds

        self.fleet_rounds = FleetRounds(self.engine, self.store, lambda: self.config.fleet, self.config.state_dir,
                                        self._shedding_finetune)
        if not self._custom_tuner:
            from daemon.training import EngineFineTuner

            tuner = EngineFineTuner(self.engine, self.store, self.config.finetune,
                                    pseudonyms=LogPseudonyms.from_state_dir(self.config.state_dir))
            tuner.start()
            self.fine_tuner = tuner
        self.state = "serving"

    def _open_store(self) -> tuple[FeedbackStore, AsyncFeedbackStore]:
        from edge_runtime.feedback import AsyncFeedbackStore, FeedbackStore

        store = FeedbackStore(self.config.db_path, adapters_root=self.config.adapters_dir,
                              config=self.config.feedback_store)
        return store, AsyncFeedbackStore(store)

    def _engine_died(self, exc: BaseException) -> None:
        self.fatal_reason = f"the engine keeps failing: {type(exc).__name__}: {exc}"
        log.critical("%s; exiting so the service manager restarts the daemon", self.fatal_reason)
        self.fatal.set()

    async def shutdown(self, reason: str = "shutting_down") -> None:
        """Stop admitting, let generations finish for drain_timeout_s, cancel the rest with a
        reason, flush the store, checkpoint adapters, stop the engine thread."""
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
            await self.fine_tuner.checkpoint()
        except Exception:
            log.exception("checkpointing adapters failed")
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
            if self.state == "loading" and self.watchdog.enabled:
                # No engine loop yet to ping from; loading a model is progress, not a hang.
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
        from edge_runtime.telemetry import (
            PsutilSource,
            TelemetryUnavailable,
            select_budgeter,
            select_source,
        )

        cfg = self.config.telemetry
        budgeter = select_budgeter(cfg)
        try:
            source = select_source(cfg)
        except (ValueError, TelemetryUnavailable) as exc:
            log.warning("telemetry source unusable (%s); using psutil", exc)
            source = PsutilSource(cfg.interval_s)
        while True:
            try:
                async for reading in source:
                    self.reading = reading
                    self.budget = budgeter.update(reading)
                    assert self.admission is not None
                    decision = self.admission.observe(
                        AdmissionSignals.from_telemetry(reading, self.budget, self.queue_length))
                    self._apply_admission(decision.state)
                log.warning("telemetry source %s ended; switching to psutil", source.name)
            except TelemetryUnavailable as exc:
                log.warning("telemetry source %s unavailable (%s); switching to psutil", source.name, exc)
            source = PsutilSource(cfg.interval_s)

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
    def queue_length(self) -> int:
        waiting = self.engine.snapshot.waiting if self.engine is not None else 0
        return waiting + self.admission_queued

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
        from edge_runtime.sampling import SamplingParams

        limit = self.config.engine.max_prompt_chars
        if isinstance(args.prompt, str):
            chars = len(args.prompt)
        elif args.is_chat:
            chars = sum(len(m["content"] or "") for m in args.prompt)  # type: ignore[index, union-attr]
        else:
            chars = 0  # token ids: the engine checks their count against its context
        if chars > limit:
            raise ProtocolError("bad_request", f"prompt has {chars} characters; the limit is {limit}", param="prompt")
        from edge_runtime.chat import ChatPrompt
        from edge_runtime.constraints import Constraint

        constraint = Constraint(*args.response_format) if args.response_format else None
        params = SamplingParams(**args.sampling_kwargs(self.config.server.default_max_tokens), constraint=constraint)
        prompt: Any = args.prompt
        if args.is_chat:
            prompt = ChatPrompt(tuple(args.prompt), args.tools, args.tool_choice,  # type: ignore[arg-type]
                                args.continue_final_message)
        adapter, label = self.fine_tuner.resolve_adapter(args.user, args.adapter if args.user else "base")
        self.ops_in_flight += 1
        self.generating[call.client] += 1
        timer = None
        if args.timeout_s is not None:  # counted from arrival: admission waits count too
            timer = asyncio.get_running_loop().call_later(args.timeout_s, self.cancel, call, "timeout")
        try:
            await self._admit(call)
            return await self._run_generation(args, prompt, params, adapter, label, call)
        finally:
            if timer is not None:
                timer.cancel()
            self.ops_in_flight -= 1
            self.generating[call.client] -= 1
            if self.generating[call.client] <= 0:
                del self.generating[call.client]

    def _light_client(self, call: GenerateCall) -> bool:
        """A client with no other generate in flight, or fewer than the average client: a
        backlog it did not make must not refuse it (one flooding client would otherwise fail
        everyone else's requests). The server's `max_inflight` still bounds the total."""
        mine = self.generating[call.client] - 1  # not counting this one
        others = sum(self.generating.values()) - 1
        return mine == 0 or mine * len(self.generating) < others

    async def _admit(self, call: GenerateCall) -> None:
        if self.admission is None:
            return
        verdict = self.admission.admit("inference")
        if verdict.action != "allow" and self._light_client(call) and self.admission.device_allows_inference():
            return  # only the backlog says no, and this client's share of it is below average
        if verdict.action == "queue":
            self.admission_queued += 1
            deadline = time.monotonic() + self.config.server.admission_wait_s
            try:
                while verdict.action == "queue" and time.monotonic() < deadline and not call.cancel_reason:
                    await asyncio.sleep(0.05)
                    verdict = self.admission.admit("inference")
            finally:
                self.admission_queued -= 1
            if verdict.action == "queue" and not call.cancel_reason:
                verdict = self.admission.admit("inference")
                if verdict.action == "queue":
                    retry = self.config.admission_config.retry_after_s
                    raise ProtocolError("admission_rejected", f"waited {self.config.server.admission_wait_s:g} s "
                                        f"for admission ({verdict.reason}); retry later", retry_after_s=retry,
                                        details={"state": self.admission.state.value})
        if verdict.action == "reject":
            retry = verdict.retry_after_s or self.config.admission_config.retry_after_s
            raise ProtocolError("admission_rejected", f"the device is under pressure ({verdict.reason}); "
                                f"retry in {retry:g} s", retry_after_s=retry,
                                details={"state": self.admission.state.value, "reason": self.admission.decision.reason})

    async def _run_generation(self, args: GenerateArgs, prompt: Any, params: Any, adapter: Any,
                              label: str | None, call: GenerateCall) -> dict[str, Any]:
        assert self.engine is not None
        if call.cancel_reason is not None:
            code, message = _ABORTS.get(call.cancel_reason, ("cancelled", call.cancel_reason))
            raise ProtocolError(code, message)
        interaction_id = f"ix-{secrets.token_hex(8)}"
        call.engine_id = interaction_id
        tools = args.tools if args.tool_choice != "none" else ()
        if tools and call.on_token is not None:  # the front streams this generation
            from edge_runtime.chat import CallStreamer

            call.streamers = {i: CallStreamer(tools, self.tool_style) for i in range(params.n)}
        self.calls.add(call)
        self.counters["generate"] += 1
        try:
            await self.engine.submit(interaction_id, prompt, params, call, adapter)
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
        candidates = [self._candidate(c, tools, call) for c in output.candidates]
        if aborted is not None:
            self.counters["cancelled"] += 1
            code, message = _ABORTS.get(aborted, ("cancelled", aborted))
            raise ProtocolError(code, message, details={"interaction_id": interaction_id,
                                                        "partial": candidates})
        metrics = output.metrics
        timing: dict[str, float] = {}
        if metrics is not None:
            if metrics.ttft_s is not None:
                timing["ttft_s"] = round(metrics.ttft_s, 6)
            if metrics.finish_time is not None:
                timing["total_s"] = round(metrics.finish_time - metrics.arrival_time, 6)
        result: dict[str, Any] = {
            "interaction_id": interaction_id,
            "model": self.model_name,
            "adapter": output.adapter or label,
            "candidates": candidates,
            "usage": {"prompt_tokens": len(output.prompt_token_ids),
                      "completion_tokens": sum(c["completion_tokens"] for c in candidates),
                      "cached_prompt_tokens": metrics.cached_prompt_tokens if metrics else 0},
            "timing": timing,
            "recorded": False,
        }
        if args.echo:
            result["prompt_text"] = output.prompt
        if args.user is not None and args.record:
            result["recorded"], note = await self._record(args.user, interaction_id, output,
                                                          result["adapter"], timing)
            if note:
                result["record_note"] = note
        return result

    def _candidate(self, c: Any, tools: tuple[dict[str, Any], ...], call: GenerateCall) -> dict[str, Any]:
        """One answer of a generate result: its text, and with tools offered the content and the
        calls apart (exactly as they streamed, when they did)."""
        candidate: dict[str, Any] = {"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                                     "completion_tokens": len(c.token_ids)}
        if c.logprobs is not None:
            candidate["logprobs"] = [logprob_record(lp) for lp in c.logprobs]
        if tools:
            if c.index in call.streamers:
                content = "".join(call.streamed_content.get(c.index, ()))
                calls = call.streamed_calls.get(c.index, [])
            else:
                from edge_runtime.chat import parse_calls

                content, calls = parse_calls(c.text, tools, self.tool_style)
            if calls:
                candidate["text"] = content
                candidate["tool_calls"] = [x.as_openai() for x in calls]
                if c.finish_reason == "stop":
                    candidate["finish_reason"] = "tool_calls"
        return candidate

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
                user, interaction_id, output.prompt, [c.text for c in output.candidates],
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

    async def feedback(self, args: FeedbackArgs) -> dict[str, Any]:
        astore = self._store()
        from edge_runtime.feedback import feedback_from_dict

        feedback = feedback_from_dict(args.feedback)
        self.ops_in_flight += 1
        try:
            ack = await astore.record_feedback(args.user, args.interaction_id, feedback)
        finally:
            self.ops_in_flight -= 1
        self.counters["feedback"] += 1
        self.fine_tuner.on_feedback(args.user, ack.pair_ids)
        return {"feedback_id": ack.feedback_id, "pair_ids": list(ack.pair_ids),
                "unpaired_ids": list(ack.unpaired_ids), "durable": True}

    def _store(self) -> AsyncFeedbackStore:
        self._require("serving", "draining", "loading")
        if self.astore is None:
            if self.config.feedback.enabled:  # store still opening, or already closed
                raise ProtocolError("store_unavailable", "the feedback store is not open")
            raise ProtocolError("not_supported", "the feedback store is disabled in this daemon's config")
        return self.astore

    async def users_consent(self, args: ConsentArgs) -> dict[str, Any]:
        store = self._store()
        changed = False
        if args.granted is not None:
            changed = await store.set_consent(args.user, args.granted)
        if args.fleet is not None:
            changed = await store.set_fleet_consent(args.user, args.fleet) or changed
        state = await store.consent_state(args.user)
        return {"user": args.user, "granted": state.granted, "fleet": state.fleet, "changed": changed}

    async def users_export(self, args: UserArgs) -> dict[str, Any]:
        data = await self._store().export_user(args.user)
        return {"user": args.user, "data": data}

    async def users_forget(self, args: UserArgs) -> dict[str, Any]:
        store = self._store()
        # The engine stops serving the user's adapters before their files go.
        removed = await self.fine_tuner.forget(args.user)
        report = await store.forget(args.user, adapters_removed=removed)
        return {"user": args.user, "erased": asdict(report)}

    async def adapters_list(self, args: AdaptersListArgs) -> dict[str, Any]:
        return {"adapters": await self.fine_tuner.adapters(args.user), "trainer": self.fine_tuner.name}

    async def adapters_rollback(self, args: RollbackArgs) -> dict[str, Any]:
        self._require("serving")
        return await self.fine_tuner.rollback(args.user, args.version)

    # Fleet adapter admin ops (ZeroMQ only: anyone who may connect may call them, as
    # adapters.rollback; the HTTP gateway has no admin role, so it does not offer them).

    async def fleet_publish(self, args: FleetPublishArgs) -> dict[str, Any]:
        from daemon import fleet

        self._require("serving")
        assert self.engine is not None
        result = await fleet.publish(self.engine, args.path)
        self.fleet_serving = result["serving"]
        log.info("fleet adapter version %d published from %s", result["version"], args.path)
        return result

    async def fleet_rollback(self, args: FleetRollbackArgs) -> dict[str, Any]:
        from daemon import fleet

        self._require("serving")
        assert self.engine is not None
        result = await fleet.rollback(self.engine, args.version)
        self.fleet_serving = result["serving"]
        log.info("fleet adapter rolled back: retired %s, serving %s", result["retired"], result["serving"])
        return result

    async def fleet_status(self, args: NoArgs) -> dict[str, Any]:
        from daemon import fleet

        self._require("serving")
        assert self.engine is not None
        result = await fleet.status(self.engine)
        self.fleet_serving = result["serving"]
        return result

    # A round of the federated fleet (ZeroMQ only, like the other fleet ops): the Flower client
    # on this device calls them; nothing in their replies is feedback text.

    async def fleet_round(self, args: FleetRoundArgs) -> dict[str, Any]:
        self._require("serving")
        assert self.fleet_rounds is not None
        return await self.fleet_rounds.run(args)

    async def fleet_evaluate(self, args: FleetEvaluateArgs) -> dict[str, Any]:
        self._require("serving")
        assert self.fleet_rounds is not None
        return await self.fleet_rounds.evaluate(args)

    def health(self) -> dict[str, Any]:
        return {"ok": self.state == "serving", "state": self.state, "model": self.model_name,
                "uptime_s": round(time.monotonic() - self.started_at, 3),
                "admission": self.admission.state.value if self.admission else "off"}

    async def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "daemon": {"version": VERSION, "protocol": PROTOCOL_VERSION, "pid": os.getpid(),
                       "state": self.state, "uptime_s": round(time.monotonic() - self.started_at, 3),
                       "python": sys.version.split()[0], "config_file": str(self.config.file or ""),
                       "counters": dict(self.counters)},
        }
        stats: dict[str, Any] = {}
        latencies: list[float] = []
        if self.engine is not None and self.engine.stats:
            stats = dict(self.engine.stats)
            stats["stats_age_s"] = round(time.monotonic() - self.engine.stats_at, 3)
            latencies = self.engine.stats_latencies_s
        info = self.engine.model_info if self.engine is not None else {}
        out["model"] = {k: stats.get(k) for k in ("model", "backend", "device", "dtype", "max_context")}
        out["model"].update(info)
        out["engine"] = {k: v for k, v in stats.items() if k not in out["model"]}
        out["latency"] = {"iteration_ms": _summary_ms(latencies)}
        snap = self.engine.snapshot if self.engine is not None else None
        out["queues"] = {"engine_waiting": snap.waiting if snap else 0,
                         "engine_running": snap.running if snap else 0,
                         "admission_queued": self.admission_queued,
                         "generates_in_flight": len(self.calls)}
        out["memory"] = self._memory(stats, info)
        out["telemetry"] = self._telemetry()
        out["admission"] = self.admission.status() if self.admission else {"state": "off"}
        out["feedback"] = await self._feedback_stats()
        finetune = self.fine_tuner.status()
        out["finetune"] = finetune
        out["alignment"] = finetune.get("alignment", {})
        if self.http is not None:
            out["http"] = self.http.summary()
        out["adapters"] = {"trainer": self.fine_tuner.name,
                           "users": stats.get("adapter_users", 0),
                           "versions_served": stats.get("adapter_versions", 0),
                           "versions_recorded": out["feedback"].get("adapter_versions", 0),
                           "cached": stats.get("adapters_cached", 0),
                           "fleet_serving": self.fleet_serving}
        if self.fleet_rounds is not None:
            out["fleet"] = self.fleet_rounds.status()
        return out

    def _memory(self, stats: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
        # Until the runtime's MemoryLedger lands, the ledger is what the daemon can account for.
        ledger = {"weights": int(info.get("weights_bytes", 0)), "kv_cache": int(stats.get("kv_cache_bytes", 0)),
                  "adapter_cache": int(stats.get("adapter_cache_bytes", 0) or 0)}
        ledger.update(self.fine_tuner.memory_bytes())
        held = sum(ledger.values())
        memory: dict[str, Any] = {"ledger": ledger, "ledger_bytes": held,
                                  "process_rss_bytes": psutil.Process().memory_info().rss}
        if self.budget is not None:
            memory["budget"] = {"kind": self.budget.kind, "available_mb": round(self.budget.available_mb, 1),
                                "reserve_mb": self.budget.reserve_mb,
                                "headroom_mb": round(self.budget.headroom_mb, 1),
                                "source": self.budget.source,
                                "capacity_bytes": self.budget.ledger_capacity_bytes(held),
                                "describe": self.budget.describe()}
        return memory

    def _telemetry(self) -> dict[str, Any]:
        r = self.reading
        if r is None:
            return {"source": None}
        keys = ("source", "unified_memory", "ram_used_mb", "ram_total_mb", "mem_available_mb",
                "swap_used_mb", "gpu_util_pct", "emc_util_pct", "max_temp_c", "total_power_mw")
        out = {k: getattr(r, k) for k in keys}
        out["age_s"] = round(time.monotonic() - r.t, 3)
        return out

    async def _feedback_stats(self) -> dict[str, Any]:
        if self.astore is None:
            return {"enabled": self.config.feedback.enabled, "open": False}
        try:
            stats = (await self.astore.stats()).as_dict()
        except MaceError as exc:
            return {"enabled": True, "open": False, "error": str(exc)}
        return {"enabled": True, "open": True, **stats}


def _summary_ms(samples_s: list[float]) -> dict[str, Any]:
    if not samples_s:
        return {"samples": 0}
    ms = sorted(s * 1000 for s in samples_s)
    return {"samples": len(ms), "last": round(samples_s[-1] * 1000, 3), "mean": round(statistics.fmean(ms), 3),
            "p50": round(ms[len(ms) // 2], 3), "p99": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 3)}
