"""The engine's own thread: it owns the (not thread-safe) Engine, takes commands from a queue,
runs iterations, and hands tokens and finished requests back to the event loop in one batch per
iteration. Nothing else may touch the Engine. With a keep-alive (daemon/keep_alive.py) it also
unloads the idle engine and loads it again for the next command that needs it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from daemon.engine_handoff import GenerationSink, Tokens, run_batch, settle
from daemon.keep_alive import KeepAlive, ModelSlot, ParkedEngine, model_facts, parked_stats
from edge_runtime.errors import MaceError, RequestFailed, UnknownRequest
from edge_runtime.outputs import RequestOutput, TokenEvent

if TYPE_CHECKING:
    from edge_runtime.engine import Engine, Prompt
    from edge_runtime.sampling import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")
# A queued command: what to run on the engine, its future (None: nobody waits), and what to run
# instead while the model is unloaded (None: the command needs the model, which is reloaded).
_Command = tuple[Callable[[Any], Any], "asyncio.Future[Any] | None", "Callable[[ParkedEngine], Any] | None"]

# After this many failing iterations in a row the engine counts as broken: the daemon exits
# non-zero and systemd restarts it, rather than answering every request with an error forever.
MAX_CONSECUTIVE_STEP_FAILURES = 3
# A background cost calibration measures its next shape only after the engine has been idle this
# long: a client sending its next request right after a reply (a chat app, a benchmark, an agent's
# tool loop) never waits behind a calibration shape (up to a few hundred milliseconds each).
CALIBRATION_QUIET_S = 0.5


class EngineFailed(MaceError):
    """The engine raised while running a batch; requests in that batch are lost."""

    code = "internal"


@dataclass
class EngineSnapshot:
    """Counters the event loop may read at any time (replaced whole, never mutated)."""

    waiting: int = 0
    running: int = 0
    in_flight: int = 0
    iterations: int = 0
    last_iteration_s: float = 0.0
    at: float = field(default_factory=time.monotonic)


class EngineThread:
    """Runs `load()` then the iteration loop on a dedicated thread.

    Loop-side methods return asyncio futures resolved on the loop. `on_alive` is called from the
    engine thread after every iteration and at least every `idle_wait_s` when idle (the systemd
    watchdog hangs off it); `on_dead` runs on the loop if the engine stops working. With a
    `keep_alive`, an engine idle for its time is unloaded (`on_release` hooks run first, on the
    engine thread) and `load()` runs again for the next command that needs the model.
    """

    def __init__(
        self,
        load: Callable[[], Engine],
        loop: asyncio.AbstractEventLoop,
        *,
        on_alive: Callable[[], None] = lambda: None,
        on_dead: Callable[[BaseException], None] = lambda exc: None,
        idle_wait_s: float = 0.25,
        calibration_quiet_s: float = CALIBRATION_QUIET_S,
        keep_alive: KeepAlive | None = None,
    ) -> None:
        self._loop = loop
        self._on_alive = on_alive
        self._on_dead = on_dead
        self._idle_wait_s = idle_wait_s
        self._calibration_quiet_s = calibration_quiet_s
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._ready: asyncio.Future[Engine] | None = loop.create_future()
        self._stopping = False
        self.keep_alive = keep_alive or KeepAlive(keep_alive_s=-1.0)
        self._slot = ModelSlot(load, self.keep_alive)  # the one reference to the engine
        # Engine-thread-only state below.
        self._sinks: dict[str, GenerationSink] = {}
        self._events: dict[str, list[TokenEvent]] = {}
        self._outbox: list[Callable[[], None] | Tokens] = []
        # Handed to the loop: the engine thread appends, the loop swaps it out. A wake-up is
        # scheduled only when it was empty, so a busy loop gets one batch of many iterations
        # (and each stream one message for several tokens) instead of falling further behind.
        self._mailbox: list[Callable[[], None] | Tokens] = []
        self._mailbox_lock = threading.Lock()
        self.latencies_s: deque[float] = deque(maxlen=512)  # written by the engine thread only
        self.lost_requests = 0  # requests answered by the reply invariant's check (should stay 0)
        self.snapshot = EngineSnapshot()
        self.model_info: dict[str, Any] = {}
        # Published by the engine thread every `stats_every_s` (replaced whole, never mutated), so
        # `status` never waits behind a long iteration.
        self.stats: dict[str, Any] = {}
        self.stats_latencies_s: list[float] = []
        self.stats_at = 0.0
        self.stats_every_s = 0.5

    # -- loop side ------------------------------------------------------------------------------

    def start(self) -> asyncio.Future[Engine]:
        ready = self._ready
        assert ready is not None, "started twice"
        self._thread.start()
        return ready

    def on_release(self, hook: Callable[[], None]) -> None:
        """Run `hook()` on the engine thread before an unload lets go of the engine: whoever
        keeps something built on the model (a trainer) drops it there."""
        self._slot.release_hooks.append(hook)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request_id: str, prompt: Prompt, params: SamplingParams, sink: GenerationSink,
               adapter: Any = None, owner: str = "", scope: str = "") -> asyncio.Future[None]:
        """Queue a request (`owner`: whose prompt it is; `scope`: whose prefix cache it shares);
        the future fails with the engine's BadRequest if it is refused."""
        def command(engine: Engine) -> None:
            kwargs: dict[str, Any] = {"adapter": adapter} if adapter is not None else {}
            if owner:
                kwargs["owner"] = owner
            if scope:
                kwargs["scope"] = scope
            engine.add_request(prompt, params, request_id=request_id, on_token=self._collect, **kwargs)
            self._sinks[request_id] = sink

        return self._post(command)

    def abort(self, request_id: str, reason: str) -> asyncio.Future[bool]:
        """Stop a request; its sink finishes with `aborted=reason`. False if it had finished."""
        def command(engine: Engine) -> bool:
            try:
                output = engine.abort(request_id)
            except UnknownRequest:
                return False
            self._finish(request_id, output, reason, None)
            return True

        return self._post(command, parked=lambda parked: False)  # unloaded: nothing in flight

    def call(self, fn: Callable[[Engine], T], *,
             parked: Callable[[ParkedEngine], T] | None = None) -> asyncio.Future[T]:
        """Run `fn(engine)` between iterations (for stats and adapter hooks). While the model
        is unloaded, `parked(ParkedEngine)` runs instead if given (adapter listing, rollback,
        erasure: what needs no model); otherwise the model is loaded again first."""
        return self._post(fn, parked)

    def stop(self, reason: str = "shutting_down") -> None:
        """Abort what is left (sinks finish with `aborted=reason`) and end the thread."""
        def command(engine: Engine) -> None:
            for request_id in list(engine.requests):
                try:
                    self._finish(request_id, engine.abort(request_id), reason, None)
                except UnknownRequest:
                    pass
            self._stopping = True

        def parked(engine: ParkedEngine) -> None:
            self._stopping = True

        if self._thread.is_alive():
            self._commands.put((command, None, parked))
        else:
            self._stopping = True

    async def join(self, timeout_s: float) -> bool:
        await asyncio.to_thread(self._thread.join, timeout_s)
        return not self._thread.is_alive()

    def _post(self, fn: Callable[[Engine], T],
              parked: Callable[[ParkedEngine], T] | None = None) -> asyncio.Future[T]:
        future: asyncio.Future[T] = self._loop.create_future()
        if self._stopping or not self._thread.is_alive():
            future.set_exception(EngineFailed("the engine is not running"))
            return future
        self._commands.put((fn, future, parked))
        return future

    # -- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        ready, self._ready = self._ready, None
        assert ready is not None
        try:
            engine = self._slot.load()
        except BaseException as exc:
            log.error("loading the model failed: %s", exc)
            self._stopping = True
            self._loop.call_soon_threadsafe(settle, ready, None, exc)
            return
        try:
            self.model_info = model_facts(engine)
        except Exception:  # informational only
            log.exception("reading model facts failed")
        self._adopt(engine)
        self._loop.call_soon_threadsafe(settle, ready, engine, None)
        del engine, ready  # from here the slot holds the thread's one reference (an unload drops it)
        try:
            self._serve()
        except BaseException as exc:  # the loop itself broke: the daemon must exit and restart
            log.critical("the engine loop died: %s: %s", type(exc).__name__, exc, exc_info=exc)
            self._stopping = True
            self._outbox.append(lambda exc=exc: self._on_dead(exc))
        finally:
            # Whatever ended the loop, every request admitted gets its one final reply.
            self._fail_sinks(EngineFailed("the engine has stopped"))
            self._flush()
            self._reject_leftovers()
            if self._slot.engine is not None:  # an unloaded engine closed its store as it went
                self._slot.engine.prefixes.close()  # queued prefix blocks reach the disk before exit

    def _adopt(self, engine: Engine) -> None:
        """Serve `engine` from now on: its stats published, its tokens handed on mid-iteration."""
        self._slot.adopt(engine)
        self._publish_stats(engine, force=True)
        # Tokens of an iteration that also runs fine-tune stages go out before those stages.
        engine.on_tokens_emitted = self._flush

    def _serve(self) -> None:
        """The iteration loop. `Engine.step()` fails a request that breaks it alone and raises
        only for failures no request caused; only those count toward `MAX_CONSECUTIVE_STEP_FAILURES`."""
        failures = 0
        busy_at = time.monotonic()  # when the engine last had a generation to run
        used_at = busy_at  # ... or anything held the model (keep-alive counts from here)
        commanded_at = busy_at  # when commands last ran: a calibration shape waits for quiet after them too
        was_idle = True
        while not self._stopping:
            engine = self._slot.engine
            if engine is None:  # unloaded: wait for a command that needs the model
                engine = self._serve_unloaded()
                if engine is None:
                    break
                failures, busy_at, used_at = 0, time.monotonic(), time.monotonic()
            self._on_alive()
            # Idle with a cost calibration still to run: once the engine has been quiet for
            # `calibration_quiet_s`, one shape of it per turn (a command arriving meanwhile stops
            # the shape after its current forward); until then the queue is waited on.
            calibrating = getattr(engine, "calibrating", False)
            quiet_s = time.monotonic() - max(busy_at, commanded_at)
            if engine.has_unfinished() or not calibrating:
                ran = self._drain(engine, block=not engine.has_unfinished())
            else:
                ran = self._drain(engine, block=quiet_s < self._calibration_quiet_s,
                                  timeout_s=self._calibration_quiet_s - quiet_s)
            if ran:
                commanded_at = time.monotonic()
            if engine.has_unfinished():  # commands that start no generation (status...) keep it quiet
                busy_at = used_at = time.monotonic()
            elif calibrating and not engine.requests and not self._stopping \
                    and time.monotonic() - max(busy_at, commanded_at) >= self._calibration_quiet_s:
                # Replies of this turn's commands go out first: at the 8B shape a cached start's
                # first command (the fleet adapter's newest version) waited 84 s behind shapes.
                self._flush()
                engine.calibrate_step(interrupted=lambda: not self._commands.empty())
            if engine.has_unfinished() and not self._stopping:
                ran += 1
                try:
                    finished = engine.step()
                except Exception as exc:
                    failures += 1
                    log.exception("engine iteration failed (%d in a row)", failures)
                    self._fail_all(engine, exc)
                    if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                        self._stopping = True
                        self._outbox.append(lambda exc=exc: self._on_dead(exc))
                else:
                    failures = 0
                    if engine.last_iteration_s:
                        self.latencies_s.append(engine.last_iteration_s)
                    for output in finished:
                        error = RequestFailed(output.error) if output.error else None
                        self._finish(output.request_id, output, None, error)
                self._check_replies(engine)
            self.snapshot = EngineSnapshot(
                len(engine.scheduler.waiting), len(engine.scheduler.running), len(engine.requests),
                engine.iterations, engine.last_iteration_s)
            # Idle after work (a step, or commands such as a publication) publishes at once: the
            # loop may now block on its queue, and a status read meanwhile must not pair the
            # tuner's fresh counts with a snapshot from before the work (a tiny model's whole
            # fine-tune job can start and finish inside one iteration).
            idle = not engine.has_unfinished()
            self._publish_stats(engine, force=idle and (not was_idle or ran > 0))
            was_idle = idle
            self._flush()
            if not engine.has_unfinished() and self._commands.empty() and not self._stopping \
                    and self.keep_alive.enabled:
                # A background calibration holds it too (cached once done; else each reload calibrates).
                if self.keep_alive.held() is not None or (calibrating and not self.keep_alive.pressure):
                    used_at = time.monotonic()
                elif (reason := self.keep_alive.unload_reason(time.monotonic() - used_at)) is not None:
                    del engine  # the slot's is then the last reference, which the unload drops
                    self._unload(reason)
        self._drain(self._slot.engine or self._slot.parked, block=False)  # calls that raced with stop()

    # -- keep-alive: unloading and reloading (engine thread) ------------------------------------

    def _unload(self, reason: str) -> None:
        if not self._slot.can_unload():
            return
        engine = self._slot.engine
        assert engine is not None
        self.stats = parked_stats(self.stats)
        self.snapshot = EngineSnapshot(iterations=engine.iterations)
        engine.on_tokens_emitted = None
        del engine
        self._slot.unload(reason)

    def _serve_unloaded(self) -> Engine | None:
        """While unloaded: run the commands that need no model on the parked registry; the first
        that needs the model loads it again, runs, and the engine is returned. None once stopping."""
        failures = 0
        while not self._stopping:
            self._on_alive()
            self._flush()
            try:
                fn, future, parked = self._commands.get(timeout=self._idle_wait_s)
            except queue.Empty:
                continue
            engine = self._slot.reload() if parked is None else None
            if engine is not None:
                self._adopt(engine)
                self._execute(engine, (fn, future, parked))
                return engine
            failures += parked is None
            self._execute(self._slot.parked, (fn, future, parked or _reload_failed))
            if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                exc = EngineFailed(f"the model could not be loaded again {failures} times in a row")
                self._stopping = True
                self._outbox.append(lambda exc=exc: self._on_dead(exc))
        return None

    def _publish_stats(self, engine: Engine, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.stats_at >= self.stats_every_s:
            self.stats_at = now
            try:
                self.stats = engine.stats()
            except Exception:  # status is a view; it must never take the engine loop down
                log.exception("reading engine stats failed")
            self.stats_latencies_s = list(self.latencies_s)

    def _drain(self, engine: Engine, block: bool, timeout_s: float | None = None) -> int:
        """Run the queued commands, waiting for a first one when `block` (at most `timeout_s`,
        and never longer than `idle_wait_s`, so the watchdog keeps beating); how many ran."""
        wait_s = self._idle_wait_s if timeout_s is None else max(0.0, min(timeout_s, self._idle_wait_s))
        try:
            command = self._commands.get(timeout=wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return 0
        ran = 0
        while True:
            self._execute(engine, command)
            ran += 1
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return ran

    def _execute(self, engine: Engine | ParkedEngine | None, command: _Command) -> None:
        fn, future, parked = command
        if engine is None or isinstance(engine, ParkedEngine):  # unloaded: the form that needs no model
            fn = parked or _stopped
        try:
            value = fn(engine)
        except Exception as exc:  # handed to the caller, who decides what it means
            if future is None:
                log.exception("engine command failed")
            else:
                self._outbox.append(lambda exc=exc: settle(future, None, exc))
        else:
            if future is not None:
                self._outbox.append(lambda: settle(future, value, None))

    def _collect(self, event: TokenEvent) -> None:
        self._events.setdefault(event.request_id, []).append(event)

    def _finish(self, request_id: str, output: RequestOutput | None, aborted: str | None,
                error: BaseException | None) -> None:
        sink = self._sinks.pop(request_id, None)
        events = self._events.pop(request_id, None)
        if sink is None:
            return
        if events:
            self._outbox.append(Tokens(sink, events))
        self._outbox.append(lambda: sink.on_finished(output, aborted, error))

    def _fail_all(self, engine: Engine, exc: Exception) -> None:
        error = EngineFailed(f"the engine failed while running this request: {type(exc).__name__}: {exc}")
        for request_id in list(engine.requests):
            try:
                engine.abort(request_id)
            except Exception:  # the scheduler may be inconsistent now; drop it regardless
                engine.requests.pop(request_id, None)
        self._fail_sinks(error)

    def _fail_sinks(self, error: BaseException) -> None:
        """Finish every request still waiting for its reply (including any the engine already
        let go of before it raised) with `error`."""
        for request_id in list(self._sinks):
            self._finish(request_id, None, None, error)

    def _check_replies(self, engine: Engine) -> None:
        """The invariant: a request with a sink is in flight in the engine. One that is not
        would never get its final reply; answer it now and say so loudly (a bug to fix)."""
        if len(self._sinks) <= len(engine.requests) and all(r in engine.requests for r in self._sinks):
            return
        lost = [r for r in self._sinks if r not in engine.requests]
        self.lost_requests += len(lost)
        log.error("invariant broken: %d request(s) left the engine without a final reply; answering "
                  "them with an error", len(lost))
        for request_id in lost:
            self._finish(request_id, None, None, EngineFailed("the engine lost this request (a bug); it was not completed"))

    def _flush(self) -> None:
        for request_id, events in self._events.items():
            sink = self._sinks.get(request_id)
            if sink is not None and events:
                self._outbox.append(Tokens(sink, events))
        self._events = {}
        if not self._outbox:
            return
        batch, self._outbox = self._outbox, []
        with self._mailbox_lock:
            wake = not self._mailbox
            self._mailbox.extend(batch)
        if wake:
            try:
                self._loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop is closed: the process is exiting anyway
                pass

    def _deliver(self) -> None:
        """On the loop: run everything the engine thread handed over, tokens merged per stream."""
        with self._mailbox_lock:
            batch, self._mailbox = self._mailbox, []
        merged: dict[int, Tokens] = {}
        items: list[Callable[[], None] | Tokens] = []
        for item in batch:
            if isinstance(item, Tokens):
                first = merged.get(id(item.sink))
                if first is not None:  # same stream, later iteration: ride along, order kept
                    first.events.extend(item.events)
                    continue
                merged[id(item.sink)] = item = Tokens(item.sink, list(item.events))
            elif merged:
                # A finish (or a command result) seals the streams before it: their tokens
                # must reach the client before their final reply.
                merged.clear()
            items.append(item)
        run_batch(items)

    def _reject_leftovers(self) -> None:
        """Commands queued after the thread stopped still get an answer."""
        stopped = EngineFailed("the engine has stopped")
        while True:
            try:
                _, future, _ = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None:
                try:
                    self._loop.call_soon_threadsafe(settle, future, None, stopped)
                except RuntimeError:
                    return


def _stopped(engine: Any) -> None:
    raise EngineFailed("the engine has stopped")


def _reload_failed(engine: Any) -> None:
    raise EngineFailed("the model could not be loaded again (see the daemon's log); retry later")
