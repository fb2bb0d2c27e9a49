"""Per-user adapters served and trained inside the daemon: the engine's adapter registry for
serving, listing, rollback and erasure, and continual DPO on consented users' pairs and KTO on
their unpaired examples (lone thumbs, ratings).

Training is the engine's own work, not a side loop: each preference pair ready for a user
becomes a staged fine-tune task (`AdapterTrainer.task(pair)`) handed to `Engine.add_finetune`,
and the engine's scheduler (MACE by default) packs its stages into iterations beside decode
steps and prefill chunks, within the latency budget and the memory ledger. This module decides
which pairs to hand over, records finished pairs in the store, and publishes a new adapter
version through the regression guard once a user has `pairs_per_version` trained pairs (the
guard's evaluation runs as background stages too: publishing.py).

A user's pairs and unpaired examples (each an "item": one staged task, DPO or KTO) go to the
engine in batches of at most `pairs_per_version` items; the next batch waits until the current
one has finished and its candidate has been snapshotted for the guard (not for the verdict), so a
candidate is never taken in the middle of an update and holds exactly the items it is recorded with.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from daemon.config import FineTuneSettings
from daemon.engine_thread import EngineThread
from daemon.finetune.progress import ProgressWatch
from daemon.finetune.publishing import GuardedPublishing
from daemon.finetune.trainers import cancel_all, reset_trainer, train_on_served_fleet
from daemon.privacy import LogPseudonyms
from daemon.wire import ProtocolError
from edge_runtime.errors import MaceError

if TYPE_CHECKING:
    from edge_runtime.engine import Engine
    from edge_runtime.feedback import FeedbackStore, PreferencePair, UnpairedExample
    from edge_runtime.sched.finetune import FineTuneJob
    from edge_runtime.train.trainer import AdapterTrainer

log = logging.getLogger(__name__)

# A training item: ("pair", pair id) or ("unpaired", unpaired example id).
Item = tuple[str, int]
PAIR, UNPAIRED = "pair", "unpaired"

# A pair whose update fails this many times is left pending in the store and not retried by
# this process (a broken pair must not keep the engine busy forever).
MAX_ATTEMPTS = 3


@dataclass
class _UserProgress:
    # Trained since the last version (in order), with their losses: still pending in the store
    # until that version is published or refused, so a stop or a crash before then trains them again.
    trained: dict[Item, float] = field(default_factory=dict)
    in_flight: dict[Item, str] = field(default_factory=dict)  # item -> engine job id
    publishing: bool = False
    # From the decision to publish until the candidate's snapshot is taken: no update may start
    # (the snapshot holds exactly the items in `judged`). After it, the next items train while
    # the guard evaluates, on the trainer that goes on from the candidate.
    frozen: bool = False
    judged: set[Item] = field(default_factory=set)  # the items of the candidate being evaluated

    def unjudged(self) -> int:
        """Items trained since the candidate under evaluation (all trained ones when none is)."""
        return sum(1 for item in self.trained if item not in self.judged)


@dataclass(frozen=True)
class _Done:
    """A fine-tune job's end, handed from the engine thread to the event loop."""

    user: str
    item: Item
    job_id: str
    loss: float | None
    error: str | None
    stages: int
    seconds: float
    generation: int  # the trainer's generation when the job was queued (a reset bumps it)
    stepped: bool = False  # its optimizer stage applied an AdamW step


class EngineFineTuner(GuardedPublishing):
    """FineTuner backed by the engine: its AdapterRegistry serves, its scheduler trains."""

    name = "engine"

    def __init__(self, engine: EngineThread, store: FeedbackStore | None, settings: FineTuneSettings,
                 poll_s: float = 0.25, pseudonyms: LogPseudonyms | None = None) -> None:
        self.engine = engine
        self.names = pseudonyms or LogPseudonyms.ephemeral()  # how the log names users
        self.store = store
        self.settings = settings
        self.poll_s = poll_s
        self.paused_reason: str | None = None
        self.pairs_queued = 0  # handed to the engine, in total
        self.pairs_trained = 0
        self.unpaired_trained = 0
        self.pairs_cancelled = 0
        self.optimizer_steps = 0  # AdamW steps taken, all users (docs/training.md)
        self.versions_published = 0
        self.versions_rejected = 0
        self.last_loss: float | None = None
        self.last_decision: dict[str, Any] | None = None
        self.errors = 0
        self.publishing: str | None = None  # the user whose candidate is being guarded now
        self.guard_seconds = 0.0  # the guard's evaluations, stage time summed (background stages)
        self._publish_tasks: dict[str, asyncio.Task[None]] = {}  # user -> its publish under way
        self._trainers: dict[str, AdapterTrainer] = {}  # touched on the engine thread only
        self._stage_costs: Any = None  # engine thread only
        # The first job's stage-cost profile (engine thread; read by status): when it began, and
        # how long the last one took (at the 8B shape read in place, minutes: issue #28).
        self.profiling_since: float | None = None
        self.profile_seconds: float | None = None
        self._progress: dict[str, _UserProgress] = {}
        self._attempts: dict[Item, int] = {}
        self._forgotten: set[str] = set()
        self._generation: dict[str, int] = {}  # per user; bumped when the trainer is reset
        # Served version's held-out log-prob rows by (version, fleet) and pair: immutable, so kept.
        self._served_rows: dict[str, tuple[tuple[Any, ...], dict[Any, tuple[float, ...]]]] = {}
        self._done: asyncio.Queue[_Done] = asyncio.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._look_at = 0.0  # when the store is read for pending pairs next (monotonic)
        self._stopping = False
        self.watch = ProgressWatch()  # seconds without a trained item or decided candidate (status)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.store is not None and self._loop_task is None:
            self._loop_task = asyncio.create_task(self._train_loop(), name="finetune")

    async def checkpoint(self) -> None:
        """Shutdown: cancel the queued updates and the publishes under way. Nothing is published
        unguarded, and no guard runs against the stop's deadline: items trained since the last
        version are still pending in the store and are trained again, from the served version,
        after the restart (the cost: at most one batch of updates done twice)."""
        self._stopping = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        await self._cancel_publishing()
        if self.engine.alive:
            try:
                await self.engine.call(cancel_all, parked=lambda parked: 0)
            except MaceError:
                pass  # the engine is gone: nothing is queued any more
        await self._handle_done()
        for progress in self._progress.values():
            progress.in_flight.clear()
            progress.trained.clear()

    # -- serving --------------------------------------------------------------------------------

    def resolve_adapter(self, user: str | None, choice: str | int) -> tuple[Any, str | None]:
        if user is None or choice == "base":
            return None, None
        if choice == "latest":
            return user, None  # the engine pins the newest version at admission
        from edge_runtime.lora.registry import AdapterRef

        return AdapterRef(user, int(choice)), f"{user}@{choice}"

    async def adapters(self, user: str | None) -> list[dict[str, Any]]:
        def listing(engine: Engine) -> list[dict[str, Any]]:
            registry = engine.adapters
            out = []
            for name in ([user] if user else registry.users()):
                newest = registry.newest(name)
                # The event log is a file read: once per user, the last publish per version.
                published = {e.get("version"): e for e in registry.events(name) if e.get("kind") == "published"}
                for version in registry.versions(name):
                    info = published.get(version, {})
                    out.append({"user": name, "version": version, "created_at": info.get("time"),
                                "pairs": len(info.get("pair_ids", [])),
                                "unpaired": len(info.get("unpaired_ids", [])),
                                "heldout": info.get("heldout"),
                                "active": newest is not None and newest.version == version})
            return out

        return await self.engine.call(listing, parked=listing)

    async def rollback(self, user: str, version: int) -> dict[str, Any]:
        from edge_runtime.lora.config import AdapterError

        def roll(engine: Engine) -> dict[str, Any]:
            now = engine.rollback_adapter(user, version, reason="rollback requested through the API")
            trainer = self._trainers.get(user)
            if trainer is not None:
                # Keep training from what is served, not from the retired tip: updates queued
                # on the old weights are cancelled (their pairs stay pending and are trained
                # again from the rolled-back version).
                engine.cancel_finetune(user=user)
                self._generation[user] = self._generation.get(user, 0) + 1
                reset_trainer(engine, user, trainer)
            return {"user": user, "serving": None if now is None else now.version}

        try:
            out = await self.engine.call(roll, parked=roll)
        except AdapterError as exc:  # adapter_unavailable, or adapter_trimmed (retention)
            raise ProtocolError(exc.code, str(exc)) from None
        progress = self._progress.get(user)
        if progress is not None and not progress.publishing:
            # Their updates went with the replaced weights; still pending, they are trained again.
            progress.trained.clear()
        return out

    def status(self) -> dict[str, Any]:
        decision = self.last_decision or {}
        stats = self.engine.stats  # the engine thread's last published snapshot
        in_flight = {user: [f"{kind}:{row}" for kind, row in sorted(p.in_flight)]
                     for user, p in self._progress.items() if p.in_flight}
        since = self.profiling_since
        profile_s = (self.profile_seconds or 0.0) if since is None else time.monotonic() - since
        if self.paused_reason:
            state = "paused"
        elif self.publishing:
            state = "publishing"
        elif since is not None:
            state = "profiling"
        elif in_flight:
            state = "training"
        else:
            state = "idle"
        return {
            "available": True, "trainer": self.name, "enabled": self.settings.enabled,
            "state": state, "paused": self.paused_reason,
            "policy": stats.get("policy"),
            "current": in_flight or None,
            "pairs_queued": sum(len(p) for p in in_flight.values()),
            "pairs_trained": self.pairs_trained, "unpaired_trained": self.unpaired_trained,
            "pairs_cancelled": self.pairs_cancelled, "optimizer_steps": self.optimizer_steps,
            "stages_run": stats.get("finetune_stages_run", 0),
            "finetune_seconds": stats.get("finetune_seconds", 0.0),
            # restarts: a job's activations shed and its pass begun again; stalling: queued jobs
            # restarted >= max_restarts / 2 times; stalled: jobs failed at max_restarts (issue #32)
            "restarts": stats.get("finetune_restarts", 0),
            "stalling_jobs": stats.get("finetune_stalling", 0),
            "stalled_jobs": stats.get("finetune_stalled", 0),
            "max_restarts": stats.get("finetune_max_restarts"),
            "restarts_by_job": {job["job_id"]: job["restarts"] for job in stats.get("finetune_jobs", ())
                                if job.get("restarts")} or None,
            # Seconds since an item was trained or a candidate decided, while work is under way
            # (0 otherwise); the longest such stretch; stretches past 60 s (each logged once).
            "since_progress_s": round(self.watch.check(self._busy() and not self.paused_reason, self._describe), 1),
            "longest_stall_s": round(self.watch.longest_s, 1), "stall_warnings": self.watch.warnings,
            "versions_published": self.versions_published, "versions_rejected": self.versions_rejected,
            "pairs_per_version": self.settings.pairs_per_version, "last_loss": self.last_loss,
            "profile_s": round(profile_s, 1),
            "errors": self.errors, "last_guard": decision or None, "guard_seconds": round(self.guard_seconds, 3),
            "alignment": (decision.get("after") or {}) if decision else {},
        }

    def _busy(self) -> bool:
        return any(p.in_flight or p.publishing for p in self._progress.values())

    def _describe(self) -> str:
        stats = self.engine.stats
        return (f"{sum(len(p.in_flight) for p in self._progress.values())} item(s) in flight, "
                f"{sum(p.publishing for p in self._progress.values())} candidate(s) being judged, "
                f"{stats.get('finetune_stages_run', 0)} stages and {stats.get('finetune_seconds', 0.0):.0f} s "
                f"of fine-tuning so far, {stats.get('finetune_restarts', 0)} restart(s)")

    def holds_model(self) -> str | None:
        """Training holds the model (engine.keep_alive) from an item's queueing to its publication."""
        busy = any(p.in_flight or p.publishing or p.trained for p in self._progress.values())
        return "fine-tuning in progress" if busy else None

    def release_model(self) -> None:
        """Engine thread, before an unload: trainers are built on the model (made again from the served adapter)."""
        self._trainers.clear()
        self._stage_costs = None

    def memory_bytes(self) -> dict[str, int]:
        memory = self.engine.stats.get("memory") or {}
        return {"lora_training_state": int(memory.get("optimizer_bytes", 0)),
                "finetune_activations": int(memory.get("activations_bytes", 0))}

    # -- events from the service ----------------------------------------------------------------

    def on_feedback(self, user: str, pair_ids: tuple[int, ...]) -> None:
        self._forgotten.discard(user)
        self._look_at = 0.0  # new pairs: look at the store on the next turn

    async def forget(self, user: str) -> bool:
        """Before the store erases the user: cancel their queued updates, drop their trainer and
        every adapter version the engine holds, so nothing of theirs is served or trained again."""
        self._forgotten.add(user)
        self._progress.pop(user, None)

        def purge(engine: Engine) -> bool:
            engine.cancel_finetune(user=user)
            self._trainers.pop(user, None)
            self._served_rows.pop(user, None)  # numbering restarts after an erasure
            root = engine.adapters.root
            had_folder = root is not None and (root / user).exists()
            engine.adapters.forget(user)  # versions, retire markers, events; in-flight rows finish
            return had_folder and not (root / user).exists()

        return await self.engine.call(purge, parked=purge)

    def pause(self, reason: str) -> None:
        """Admission says shed fine-tuning: the engine stops scheduling stages and gives the
        activations back (queued updates stay queued and resume later)."""
        self.paused_reason = reason
        if self.engine.alive:
            self.engine.call(lambda e: e.pause_finetune(reason), parked=lambda p: p.pause_finetune(reason))

    def resume(self) -> None:
        self.paused_reason = None
        self._look_at = 0.0
        if self.engine.alive:
            self.engine.call(lambda e: e.resume_finetune(), parked=lambda p: p.resume_finetune())

    # -- training -------------------------------------------------------------------------------

    async def _train_loop(self) -> None:
        # Until checkpoint() sets _stopping, not only until cancelled: before 3.12, wait_for can
        # swallow a cancel that lands as the queue hands over an item (CPython bpo-42130), and the
        # shutdown then waited its 10 s bound for a loop that went on polling.
        while not self._stopping:
            try:
                try:
                    first = await asyncio.wait_for(self._done.get(), self.poll_s)
                except asyncio.TimeoutError:
                    first = None
                await self._handle_done(first)
                self.watch.check(self._busy() and self.paused_reason is None, self._describe)
                now = time.monotonic()
                if first is not None:
                    self._look_at = 0.0  # a batch may have ended: look for the next one
                if self.settings.enabled and not self._stopping and now >= self._look_at:
                    # Otherwise the store is read only every few seconds (pairs of users that
                    # were busy, settings re-enabled by a reload).
                    self._look_at = now + 5.0
                    await self._feed()
            except asyncio.CancelledError:
                raise
            except Exception:
                # Training is best effort beside serving: log, count, and keep serving.
                self.errors += 1
                log.exception("fine-tuning round failed")
                await asyncio.sleep(5.0)

    async def _handle_done(self, first: _Done | None = None) -> None:
        """Record finished updates in the store; publish users whose batch is complete."""
        done = [first] if first is not None else []
        while not self._done.empty():
            done.append(self._done.get_nowait())
        touched: set[str] = set()
        for item in done:
            progress = self._progress.get(item.user)
            if progress is None or item.user in self._forgotten:
                continue  # erased meanwhile
            progress.in_flight.pop(item.item, None)
            touched.add(item.user)
            if item.error is None and item.generation != self._generation.get(item.user, 0):
                # Finished on weights a rollback has since replaced: its update is gone, so
                # the pair stays pending and is trained again.
                item = _Done(item.user, item.item, item.job_id, None, "cancelled", item.stages,
                             item.seconds, item.generation)
            if item.error is not None:
                if item.error == "cancelled":
                    self.pairs_cancelled += 1
                else:
                    self.errors += 1
                    self._attempts[item.item] = self._attempts.get(item.item, 0) + 1
                    log.warning("fine-tuning %s %d of %s failed: %s", *item.item, self.names.tag(item.user),
                                self.names.scrub(item.error, item.user))
                continue
            # Recorded in the store with its version (publishing.py), not now: until then the
            # update lives only in the trainer's weights.
            progress.trained[item.item] = float(item.loss) if item.loss is not None else 0.0
            self.watch.progressed()
            self.optimizer_steps += item.stepped
            if item.item[0] == PAIR:
                self.pairs_trained += 1
            else:
                self.unpaired_trained += 1
            self.last_loss = item.loss
        for user in touched:
            progress = self._progress.get(user)
            if (progress is not None and not progress.in_flight and not self._stopping
                    and not progress.publishing and progress.unjudged() >= self.settings.pairs_per_version):
                self._publish_soon(user)

    async def _feed(self) -> None:
        """Hand pairs and unpaired examples ready for training to the engine: per user, a batch
        of up to `pairs_per_version` items (oldest first), once the previous batch is done. With
        nothing left to train, a user's trained-but-unpublished items are published."""
        assert self.store is not None
        if self.paused_reason is not None:
            return
        # A user whose batch is in flight, or whose candidate is about to be snapshotted, waits;
        # one whose candidate is being evaluated does not (the snapshot is a copy).
        busy = {u for u, p in self._progress.items() if p.in_flight or p.frozen}
        trained = {key for p in self._progress.values() for key in p.trained}  # pending in the store
        pairs = await asyncio.to_thread(self.store.next_pairs, None, 64)
        unpaired = await asyncio.to_thread(self.store.next_unpaired, None, 64)
        records: list[tuple[Item, PreferencePair | UnpairedExample]] = sorted(
            [((PAIR, p.id), p) for p in pairs] + [((UNPAIRED, e.id), e) for e in unpaired],
            key=lambda r: (r[1].created_at, r[0]))
        batches: dict[str, list[tuple[Item, PreferencePair | UnpairedExample]]] = {}
        for key, record in records:
            user = record.user_id
            if (user in busy or user in self._forgotten or key in trained
                    or self._attempts.get(key, 0) >= MAX_ATTEMPTS):
                continue  # (trained: pending until its version is decided)
            progress = self._progress.setdefault(user, _UserProgress())
            room = self.settings.pairs_per_version - progress.unjudged()
            if room <= 0:
                continue  # a whole batch is trained: it is published (below, or after the verdict under way)
            batch = batches.setdefault(user, [])
            if len(batch) < room:
                batch.append((key, record))
        if batches:
            await self._queue(batches)
        waiting = {r.user_id for key, r in records if key not in trained}
        for user, progress in list(self._progress.items()):
            if (not progress.in_flight and not progress.publishing and user not in self._publish_tasks
                    and progress.trained and (user not in waiting
                                              or progress.unjudged() >= self.settings.pairs_per_version)):
                # Nothing left to add, or a batch trained while the previous candidate was judged.
                self._publish_soon(user)

    async def _queue(self, batches: dict[str, list[tuple[Item, PreferencePair | UnpairedExample]]]) -> None:
        loop = self._loop
        assert loop is not None
        done_queue = self._done

        def queue(engine: Engine) -> dict[str, dict[Item, str]]:
            queued: dict[str, dict[Item, str]] = {}
            for user, items in batches.items():
                progress = self._progress.get(user)
                # The guard under way scores the candidate on the trainer's fleet version: a new
                # fleet version goes beneath the adapter once no evaluation reads it.
                trainer = self._trainer(engine, user, fleet=progress is None or not progress.publishing)
                generation = self._generation.get(user, 0)
                for key, record in items:
                    def finished(job: FineTuneJob, user: str = user, key: Item = key,
                                 generation: int = generation) -> None:
                        result = getattr(job.work, "result", None)
                        loss = float(result.loss) if result is not None and job.error is None else None
                        stepped = bool(getattr(job.work, "stepped", False)) and job.error is None
                        item = _Done(user, key, job.job_id, loss, job.error, job.stages_run, job.seconds,
                                     generation, stepped)
                        try:
                            loop.call_soon_threadsafe(done_queue.put_nowait, item)
                        except RuntimeError:  # the loop is closed: the process is exiting
                            pass

                    # No score stages: MACE ranks the job by the adapter's expected loss (its
                    # recent items'), which spares a third of the update's compute. An unpaired
                    # example becomes a staged KTO task (trainer.task dispatches on the record).
                    job_id = engine.add_finetune(trainer.task(record, score=False), user=user, on_done=finished)
                    queued.setdefault(user, {})[key] = job_id
            return queued

        queued = await self.engine.call(queue)
        for user, jobs in queued.items():
            self._progress.setdefault(user, _UserProgress()).in_flight.update(jobs)
            self.pairs_queued += len(jobs)

    def _trainer(self, engine: Engine, user: str, fleet: bool = True) -> AdapterTrainer:
        trainer = self._trainers.get(user)
        if trainer is None:
            from edge_runtime.train.optim import OptimizerSettings
            from edge_runtime.train.trainer import AdapterTrainer, DPOSettings

            if self._stage_costs is None:
                # This machine's stage costs (profiled once, then cached in the state dir), so
                # the scheduler prices stages as they really run here.
                self.profiling_since = time.monotonic()
                try:
                    self._stage_costs = engine.stage_costs()
                finally:
                    self.profile_seconds = time.monotonic() - self.profiling_since
                    self.profiling_since = None
            trainer = AdapterTrainer(engine.model, engine.tokenizer, costs=self._stage_costs, dpo=DPOSettings(
                beta=self.settings.beta, rpo_alpha=self.settings.rpo_alpha,
                optimizer=OptimizerSettings(learning_rate=self.settings.learning_rate)))
            reset_trainer(engine, user, trainer)
            self._trainers[user] = trainer
        if fleet:
            train_on_served_fleet(engine, trainer)
        return trainer
