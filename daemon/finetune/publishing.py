"""Publishing a user's trained adapter through the regression guard, inside the daemon: the guard's
evaluation (held-out log-probs, the degeneration check's greedy answers) is queued on the engine as
a background fine-tune job, so the scheduler packs its stages beside serving instead of one long
call holding the engine thread; the verdict and the publish (or refusal) are one short call after.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from daemon.finetune.trainers import reset_trainer

if TYPE_CHECKING:
    from edge_runtime.engine import Engine
    from edge_runtime.sched.finetune import FineTuneJob
    from edge_runtime.train.guard import RegressionGuard
    from edge_runtime.train.guard_task import GuardEvaluation

log = logging.getLogger(__name__)


class GuardedPublishing:
    """`EngineFineTuner`'s publish step (a mixin: it reads the tuner's engine, store, settings,
    trainers and progress)."""

    engine: Any
    store: Any
    settings: Any
    names: Any
    last_decision: dict[str, Any] | None
    versions_published: int
    versions_rejected: int
    errors: int
    publishing: str | None
    guard_seconds: float
    _trainers: dict[str, Any]
    _progress: dict[str, Any]
    _forgotten: set[str]
    _stopping: bool
    _generation: dict[str, int]
    _served_rows: dict[str, tuple[tuple[Any, ...], dict[Any, tuple[float, ...]]]]

    _look_at: float
    watch: Any
    _publish_tasks: dict[str, asyncio.Task[None]]

    async def forget(self, user: str) -> bool: ...

    def _publish_soon(self, user: str) -> None:
        """Publish `user`'s trained items in a task of its own: the guard's evaluation takes a
        while beside serving, and meanwhile other users' finished items are recorded and their
        next batches queued, and so is the user's own once the candidate's snapshot is taken
        (`frozen` until then)."""
        if user in self._publish_tasks:
            return
        progress = self._progress.get(user)
        if progress is not None:
            progress.frozen = True  # no new update until the candidate's snapshot is taken
        task = asyncio.get_running_loop().create_task(self._publish(user), name="finetune-publish")
        self._publish_tasks[user] = task

        def done(task: asyncio.Task[None], user: str = user) -> None:
            self._publish_tasks.pop(user, None)
            progress = self._progress.get(user)
            if progress is not None:
                progress.frozen = False
            self._look_at = 0.0  # the user's next batch may go now
            if not task.cancelled() and task.exception() is not None:
                self.errors += 1
                log.error("publishing the adapter of %s failed", self.names.tag(user), exc_info=task.exception())
        task.add_done_callback(done)

    async def _cancel_publishing(self) -> None:
        """Shutdown: stop the publishes under way (their items stay trained; checkpoint publishes them)."""
        tasks = list(self._publish_tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _guard(self) -> RegressionGuard:
        from edge_runtime.train.guard import RegressionGuard

        s = self.settings
        if not s.guard:
            return RegressionGuard(min_heldout_pairs=1 << 30, min_heldout_unpaired=1 << 30)
        return RegressionGuard(degeneration_prompts=s.guard_prompts, degeneration_tokens=s.guard_tokens,
                               kl_budget=s.guard_kl_budget, distinct_2_drop=s.guard_distinct_2_drop,
                               max_heldout_pairs=s.guard_pairs)

    async def _publish(self, user: str) -> None:
        progress = self._progress.get(user)
        if progress is None or not progress.trained or user in self._forgotten or progress.publishing:
            return
        # Every item trained so far, none in flight (`_publish_soon` is called then and `frozen`
        # keeps new ones out until the snapshot): exactly the updates in the candidate.
        items = list(progress.trained)
        progress.judged = set(items)
        pair_ids = [row for kind, row in items if kind == "pair"]
        unpaired_ids = [row for kind, row in items if kind == "unpaired"]
        progress.publishing = True
        self.publishing = user
        generation = self._generation.get(user, 0)
        try:
            outcome = await self._guarded(user, pair_ids, unpaired_ids, generation)
        finally:
            progress.publishing = progress.frozen = False
            progress.judged = set()
            self.publishing = None
        if outcome is None:
            if self._generation.get(user, 0) != generation:  # a rollback replaced the weights:
                progress.trained.clear()  # their updates are gone; still pending, trained again
            return  # cancelled (erasure, shutdown) or failed: the items stay trained, published later
        decision, ref, path = outcome
        self.watch.progressed()
        losses = [(item, progress.trained.pop(item, 0.0)) for item in items]
        if decision.get("trainer_reset"):
            progress.trained.clear()  # trained meanwhile on the refused candidate: still pending, trained again
        if not await self._record_trained(user, losses):
            return
        self.last_decision = decision
        if ref is None:
            self.versions_rejected += 1
            log.info("adapter candidate for %s rejected: %s", self.names.tag(user),
                     self.names.scrub(decision["reason"], user))
            return
        log.info("published adapter %s trained on %d pair(s) and %d unpaired example(s)",
                 self.names.adapter(user, ref.version), len(pair_ids), len(unpaired_ids))
        if path is not None:
            from edge_runtime.errors import MaceError

            try:
                await asyncio.to_thread(self.store.record_adapter_version, user, ref.version, path, pair_ids,
                                        unpaired_ids)
            except MaceError as exc:
                # The user (or a pair) was erased while training: the store deleted the files;
                # make sure the engine forgets the version too.
                log.warning("adapter %s withdrawn: %s", self.names.adapter(user, ref.version), self.names.scrub(exc, user))
                await self.forget(user)
                return
        self.versions_published += 1  # counted once the store knows it (what status reports)

    async def _record_trained(self, user: str, losses: list[tuple[tuple[str, int], float]]) -> bool:
        """The candidate is decided (published or refused): its items leave the pending ones,
        with their losses. False when the user was erased meanwhile."""
        from edge_runtime.errors import MaceError

        pairs = [(row, loss) for (kind, row), loss in losses if kind == "pair"]
        unpaired = [(row, loss) for (kind, row), loss in losses if kind != "pair"]
        try:
            if pairs:
                await asyncio.to_thread(self.store.mark_trained_batch, pairs)
            for row, loss in unpaired:
                await asyncio.to_thread(self.store.mark_unpaired_trained, row, loss)
        except MaceError as exc:  # erased between the update and now
            log.info("items of %s not recorded as trained: %s", self.names.tag(user), self.names.scrub(exc, user))
            return False
        return True

    async def _guarded(self, user: str, pair_ids: list[int], unpaired_ids: list[int],
                       generation: int) -> tuple[Any, Any, Any] | None:
        """Evaluate the user's candidate in the background, then publish or refuse it. None: the
        evaluation was cancelled or failed, or a rollback (`generation` moved on) replaced the
        weights it was trained on; nothing published."""
        heldout = await asyncio.to_thread(self.store.heldout_pairs, user)
        heldout_unpaired = await asyncio.to_thread(self.store.heldout_unpaired, user)
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[str | None] = loop.create_future()

        def ended_with(job: FineTuneJob) -> None:
            def settle() -> None:
                if not ended.done():
                    ended.set_result(job.error)
            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the loop is closed: the process is exiting
                pass

        def prepare(engine: Engine) -> tuple[GuardEvaluation, tuple[Any, ...], bool]:
            from edge_runtime.train.guard import guard_evaluation

            trainer = self._trainers[user]
            served = engine.adapters.newest(user)
            key = (None if served is None else served.version, trainer.fleet_key)
            known = self._served_rows.get(user)
            # The served version's rows on the pairs an earlier evaluation scored under it: only a
            # held-out pair new since then is scored again (a version and the base are immutable).
            evaluation = guard_evaluation(engine.adapters, trainer, user, heldout, self._guard(),
                                          served_rows=known[1] if known and known[0] == key else None,
                                          heldout_unpaired=heldout_unpaired)
            if evaluation.done:
                return evaluation, key, False
            engine.add_finetune(evaluation, user=user, on_done=ended_with)
            return evaluation, key, True

        evaluation, key, queued = await self.engine.call(prepare)
        progress = self._progress.get(user)
        if progress is not None:
            # The candidate is a snapshot now: the user's next items may train meanwhile, on the
            # trainer that goes on from it (docs/training.md, "Liveness").
            progress.frozen = False
            self._look_at = 0.0
        if queued:
            error = await ended
            if error is not None:
                if error != "cancelled":
                    self.errors += 1
                    log.warning("the guard's evaluation for %s failed: %s", self.names.tag(user),
                                self.names.scrub(error, user))
                return None
        self.guard_seconds += evaluation.seconds

        def finish(engine: Engine) -> tuple[Any, Any, Any] | None:
            from edge_runtime.train.guard import conclude

            if self._generation.get(user, 0) != generation:
                # A rollback landed after the evaluation ended: publishing now would put the
                # candidate over the version rolled back to. Checked here, on the engine thread
                # where the rollback itself runs, so nothing can land between check and publish.
                return None
            trainer = self._trainers[user]
            engine.adapters.set_retention(self.settings.keep_versions)  # applied by the publish
            decision, ref = conclude(engine.adapters, trainer, user, evaluation, pair_ids=pair_ids,
                                     unpaired_ids=unpaired_ids)
            if ref is not None and decision.after is not None:
                self._served_rows[user] = ((ref.version, key[1]), dict(evaluation.pair_rows["after"]))
            elif decision.before is not None:
                known = self._served_rows.get(user)
                rows = dict(known[1]) if known and known[0] == key else {}
                self._served_rows[user] = (key, rows | evaluation.pair_rows["before"])
            out = decision.as_dict() | {"guard_s": round(evaluation.seconds, 3),
                                        "guard_stages": len(evaluation.stages),
                                        "guard_pairs": evaluation.judged_pairs}
            degeneration = decision.degeneration
            if ref is None and degeneration is not None and evaluation.guard.degenerated(degeneration):
                # Corrections drawn from a collapse answer the collapse: train on from the
                # served version, with fresh optimizer state, as after a rollback. Updates queued
                # or trained on the candidate meanwhile go with it (their items stay pending).
                engine.cancel_finetune(user=user)
                self._generation[user] = self._generation.get(user, 0) + 1
                reset_trainer(engine, user, trainer, base_if_none=True)
                out["trainer_reset"] = True
            return out, ref, engine.adapters.path(ref) if ref is not None else None

        return await self.engine.call(finish)
