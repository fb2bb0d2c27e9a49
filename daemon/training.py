"""Per-user adapters served and trained inside the daemon: the engine's adapter registry for
serving, listing, rollback and erasure, and continual DPO on consented users' pairs.

Until the engine's scheduler packs fine-tune stages into its own iterations, this runs one stage
per engine-thread command and only while inference is idle, so a request waits at most one stage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from daemon.config import FineTuneSettings
from daemon.engine_thread import EngineThread
from daemon.protocol import ProtocolError
from edge_runtime.errors import MaceError

if TYPE_CHECKING:
    from edge_runtime.engine import Engine
    from edge_runtime.feedback import FeedbackStore, PreferencePair
    from edge_runtime.train.staged import DPOFineTuneTask
    from edge_runtime.train.trainer import AdapterTrainer

log = logging.getLogger(__name__)


@dataclass
class _UserProgress:
    trained_pair_ids: list[int] = field(default_factory=list)  # since the last published version


class EngineFineTuner:
    """FineTuner backed by the engine's AdapterRegistry, with idle-time DPO when enabled."""

    name = "idle-dpo"

    def __init__(self, engine: EngineThread, store: FeedbackStore | None, settings: FineTuneSettings,
                 inference_idle: Callable[[], bool], poll_s: float = 0.25) -> None:
        self.engine = engine
        self.store = store
        self.settings = settings
        self.inference_idle = inference_idle
        self.poll_s = poll_s
        self.paused_reason: str | None = None
        self.state = "idle"
        self.current: dict[str, Any] | None = None
        self.pairs_trained = 0
        self.versions_published = 0
        self.versions_rejected = 0
        self.last_loss: float | None = None
        self.last_decision: dict[str, Any] | None = None
        self.errors = 0
        self._trainers: dict[str, AdapterTrainer] = {}  # touched on the engine thread only
        self._progress: dict[str, _UserProgress] = {}
        self._task: DPOFineTuneTask | None = None
        self._forgotten: set[str] = set()
        self._busy_since = time.monotonic()
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = False

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        if self.store is not None and self._loop_task is None:
            self._loop_task = asyncio.create_task(self._train_loop(), name="finetune")

    async def checkpoint(self) -> None:
        """Shutdown: drop a half-done pair (it stays pending) and publish what was trained since
        the last version, so no trained pair is lost with the process."""
        self._stopping = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._task is not None:
            task, self._task = self._task, None
            await self.engine.call(lambda e: task.abandon())
        for user, progress in list(self._progress.items()):
            if progress.trained_pair_ids:
                try:
                    await self._publish(user)
                except Exception:
                    log.exception("checkpointing the adapter of %s failed", user)

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
                for version in registry.versions(name):
                    published = [e for e in registry.events(name)
                                 if e.get("kind") == "published" and e.get("version") == version]
                    info = published[-1] if published else {}
                    out.append({"user": name, "version": version, "created_at": info.get("time"),
                                "pairs": len(info.get("pair_ids", [])),
                                "heldout": info.get("heldout"),
                                "active": newest is not None and newest.version == version})
            return out

        return await self.engine.call(listing)

    async def rollback(self, user: str, version: int) -> dict[str, Any]:
        from edge_runtime.lora.config import AdapterError

        def roll(engine: Engine) -> dict[str, Any]:
            now = engine.rollback_adapter(user, version, reason="rollback requested through the API")
            trainer = self._trainers.get(user)
            if trainer is not None:  # keep training from what is served, not from the retired tip
                self._reset_trainer(engine, user, trainer)
            return {"user": user, "serving": None if now is None else now.version}

        try:
            return await self.engine.call(roll)
        except AdapterError as exc:
            raise ProtocolError("adapter_unavailable", str(exc)) from None

    def status(self) -> dict[str, Any]:
        decision = self.last_decision or {}
        return {
            "available": True, "trainer": self.name, "enabled": self.settings.enabled,
            "state": "paused" if self.paused_reason else self.state, "paused": self.paused_reason,
            "current": self.current, "pairs_trained": self.pairs_trained,
            "versions_published": self.versions_published, "versions_rejected": self.versions_rejected,
            "pairs_per_version": self.settings.pairs_per_version, "last_loss": self.last_loss,
            "errors": self.errors, "last_guard": decision or None,
            "alignment": (decision.get("after") or {}) if decision else {},
        }

    def memory_bytes(self) -> dict[str, int]:
        trainers = list(self._trainers.values())
        task = self._task
        return {"lora_training_state": sum(t.persistent_bytes for t in trainers),
                "finetune_activations": task.held_bytes if task is not None else 0}

    # -- events from the service ----------------------------------------------------------------

    def on_feedback(self, user: str, pair_ids: tuple[int, ...]) -> None:
        self._forgotten.discard(user)

    async def forget(self, user: str) -> None:
        """Before the store erases the user: drop their trainer, running task and every adapter
        version the engine holds, so nothing of theirs is served or trained again."""
        self._forgotten.add(user)
        self._progress.pop(user, None)

        def purge(engine: Engine) -> None:
            task = self._task
            if task is not None and self.current and self.current.get("user") == user:
                task.abandon()
                self._task = None
            self._trainers.pop(user, None)
            forget_user_adapters(engine, user)

        await self.engine.call(purge)

    def pause(self, reason: str) -> None:
        self.paused_reason = reason
        task = self._task
        if task is not None and self.engine.alive:
            # Shed first: activations are the first thing to go when memory or power is short.
            self.engine.call(lambda e: task.abandon())

    def resume(self) -> None:
        self.paused_reason = None

    # -- training -------------------------------------------------------------------------------

    def _may_run(self) -> bool:
        now = time.monotonic()
        if not self.inference_idle():
            self._busy_since = now
            return False
        return (self.settings.enabled and self.paused_reason is None and not self._stopping
                and now - self._busy_since >= self.settings.idle_s)

    async def _train_loop(self) -> None:
        assert self.store is not None
        while True:
            await asyncio.sleep(self.poll_s)
            if not self._may_run():
                continue
            try:
                pairs = await asyncio.to_thread(self.store.next_pairs, None, 16)
                await self._train_round(pairs)
            except asyncio.CancelledError:
                raise
            except Exception:
                # Training is best effort beside serving: log, count, and keep serving.
                self.errors += 1
                self.state = "idle"
                log.exception("fine-tuning round failed")
                await asyncio.sleep(5.0)

    async def _train_round(self, pairs: list[PreferencePair]) -> None:
        assert self.store is not None
        if not pairs:
            for user, progress in list(self._progress.items()):
                if progress.trained_pair_ids:  # nothing left to add: publish what there is
                    await self._publish(user)
            return
        user = pairs[0].user_id
        for pair in (p for p in pairs if p.user_id == user):
            if user in self._forgotten:
                return
            loss = await self._train_pair(user, pair)
            if loss is None:
                return  # interrupted: the pair stays pending
            await asyncio.to_thread(self.store.mark_trained, pair.id, loss)
            progress = self._progress.setdefault(user, _UserProgress())
            progress.trained_pair_ids.append(pair.id)
            self.pairs_trained += 1
            self.last_loss = loss
            if len(progress.trained_pair_ids) >= self.settings.pairs_per_version:
                await self._publish(user)

    async def _train_pair(self, user: str, pair: PreferencePair) -> float | None:
        self.state = "training"
        self.current = {"user": user, "pair_id": pair.id, "stage": None}
        try:
            task = await self.engine.call(lambda e: self._trainer(e, user).task(pair))
            self._task = task
            while not task.done:
                while not self._may_run():
                    if self._stopping or user in self._forgotten:
                        return None
                    await asyncio.sleep(self.poll_s)
                if self._task is not task:
                    return None  # abandoned (paused or erased) meanwhile
                stage = await self.engine.call(lambda e: task.run_next())
                self.current["stage"] = stage.name
            assert task.result is not None
            return float(task.result.loss)
        finally:
            self._task = None
            self.current = None
            self.state = "idle"

    def _trainer(self, engine: Engine, user: str) -> AdapterTrainer:
        trainer = self._trainers.get(user)
        if trainer is None:
            from edge_runtime.train.trainer import AdapterTrainer

            trainer = AdapterTrainer(engine.model, engine.tokenizer)
            self._reset_trainer(engine, user, trainer)
            self._trainers[user] = trainer
        return trainer

    @staticmethod
    def _reset_trainer(engine: Engine, user: str, trainer: AdapterTrainer) -> None:
        import torch

        served = engine.adapters.newest(user)
        if served is not None:
            trainer.reset(engine.adapters.weights(served).to(torch.float32))

    async def _publish(self, user: str) -> None:
        assert self.store is not None
        progress = self._progress.get(user)
        if progress is None or not progress.trained_pair_ids or user in self._forgotten:
            return
        pair_ids = list(progress.trained_pair_ids)
        heldout = await asyncio.to_thread(self.store.heldout_pairs, user)
        self.state = "publishing"

        def publish(engine: Engine) -> tuple[dict[str, Any], Any]:
            from edge_runtime.train.guard import RegressionGuard, publish_guarded

            trainer = self._trainers[user]
            trainer.flush()  # apply a partly accumulated optimizer window before the snapshot
            guard = RegressionGuard() if self.settings.guard else RegressionGuard(min_heldout_pairs=1 << 30)
            decision, ref = publish_guarded(engine.adapters, trainer, user, heldout, guard,
                                            pair_ids=pair_ids)
            path = engine.adapters.path(ref) if ref is not None else None
            return decision.as_dict(), (ref, path)

        try:
            decision, (ref, path) = await self.engine.call(publish)
        finally:
            self.state = "idle"
        progress.trained_pair_ids.clear()
        self.last_decision = decision
        if ref is None:
            self.versions_rejected += 1
            log.info("adapter candidate for %s rejected: %s", user, decision["reason"])
            return
        log.info("published adapter %s trained on %d pair(s)", ref.key, len(pair_ids))
        if path is not None:
            try:
                await asyncio.to_thread(self.store.record_adapter_version, user, ref.version, path, pair_ids)
            except MaceError as exc:
                # The user (or a pair) was erased while training: the store deleted the files;
                # make sure the engine forgets the version too.
                log.warning("adapter %s withdrawn: %s", ref.key, exc)
                await self.forget(user)
                return
        self.versions_published += 1  # counted once the store knows it (what status reports)


def forget_user_adapters(engine: Engine, user: str) -> None:
    """Make the engine forget every adapter version of `user` (cached weights included).

    Uses `AdapterRegistry.forget` when the registry has it; until then it clears the registry's
    per-user tables itself, because a cached version would otherwise keep being served after
    its files were erased.
    """
    registry = engine.adapters
    drop = getattr(registry, "forget", None)
    if callable(drop):
        drop(user)
        return
    from edge_runtime.lora.registry import AdapterRef

    with registry._lock:  # stopgap over the registry's private tables; see the docstring
        for version in range(1, registry._highest.get(user, 0) + 1):
            registry.cache.discard(AdapterRef(user, version))
        for ref in [r for r in registry._memory if r.user == user]:
            del registry._memory[ref]
        for table in (registry._versions, registry._highest, registry._retired, registry._events):
            table.pop(user, None)
