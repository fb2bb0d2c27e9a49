"""Training goes on while a candidate is judged (issue #32, the 433 s stall of the two-user run): two
users' pairs and their guarded publishes, in process (the daemon's fine-tuner, engine thread and
feedback store on the tiny model). Progress is counted in fine-tune stages, not seconds: between
two finished training items the engine never runs more stages than one guard evaluation has, since
a user's next items train while its candidate (a snapshot) is evaluated and the other user's
items are never held behind it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from daemon.engine_thread import EngineThread
from daemon.finetune.engine_tuner import EngineFineTuner
from daemon.settings import FineTuneSettings
from edge_runtime.feedback import FeedbackStore
from edge_runtime.feedback.config import FeedbackStoreConfig
from edge_runtime.feedback.records import Choice
from edge_runtime.sched.finetune import FineTuneQueue

USERS = ("ada", "bob")


class _GuardQueuedAfterTwoFeeds:
    """The engine thread as the fine-tuner sees it, except that each guard evaluation reaches the
    engine only after the tuner has looked for work twice since the evaluation was prepared: the
    slowest the event loop may be beside the engine thread, made deterministic (no timing)."""

    def __init__(self, thread: EngineThread) -> None:
        self.thread = thread
        self.feeds = 0
        self.tasks: list[asyncio.Task[None]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.thread, name)

    async def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(fn, "__name__", "") != "prepare":
            return await self.thread.call(fn, *args, **kwargs)
        held: list[tuple[Any, Any]] = []

        def holding(engine: Any) -> Any:
            engine.add_finetune = lambda *a, **k: held.append((a, k)) or "held"
            try:
                return fn(engine)
            finally:
                del engine.add_finetune

        out = await self.thread.call(holding)

        async def add_later(since: int = self.feeds) -> None:
            while self.feeds < since + 2:
                await asyncio.sleep(0.01)
            await self.thread.call(lambda e: [e.add_finetune(*a, **k) for a, k in held])
        self.tasks.append(asyncio.get_running_loop().create_task(add_later()))
        return out
PAIRS = 6  # per user, held-out ones included


def _store(path: Path) -> tuple[FeedbackStore, int]:
    store = FeedbackStore(path, config=FeedbackStoreConfig(heldout_fraction=0.3, retention_interval_s=None))
    for user in USERS:
        store.set_consent(user, True)
        for i in range(PAIRS):
            store.record_interaction(user, f"{user}{i}", f"Question {i} from {user}?",
                                     [f"Answer {i} for {user}.", f"No {i}."], model="m")
            store.record_feedback(user, f"{user}{i}", Choice(0))
    train = sum(len(store.next_pairs(user, 64)) for user in USERS)
    return store, train


def test_training_items_finish_while_candidates_are_judged(tiny_model_dir: Path, tmp_path: Path,
                                                           monkeypatch: Any) -> None:
    store, to_train = _store(tmp_path / "fb.sqlite3")
    assert all(store.heldout_pairs(user) for user in USERS), "the guard needs held-out pairs to run"
    # (what ran a stage, its job, its user, whether it ended, whether a training job was queued)
    events: list[tuple[str, str, str, bool, bool]] = []
    after_stage = FineTuneQueue.after_stage

    def recording(self: FineTuneQueue, job: Any, seconds: float, now: float) -> None:
        after_stage(self, job, seconds, now)
        training = any(j.work.trainer is not None for j in self.jobs.values())
        events.append(("guard" if job.work.trainer is None else "train", job.job_id, job.user, job.work.done,
                       training))
    monkeypatch.setattr(FineTuneQueue, "after_stage", recording)

    def load():
        from edge_runtime.engine import Engine

        return Engine.load(str(tiny_model_dir), dtype="float32", kv_cache_bytes=8 << 20)

    async def main() -> dict[str, Any]:
        thread = EngineThread(load, asyncio.get_running_loop())
        await thread.start()
        engine = _GuardQueuedAfterTwoFeeds(thread)
        tuner = EngineFineTuner(engine, store, FineTuneSettings(pairs_per_version=2, guard_prompts=4,
                                                                guard_tokens=8), poll_s=0.05)
        feed = tuner._feed

        async def counted() -> None:
            await feed()
            engine.feeds += 1
        tuner._feed = counted  # type: ignore[method-assign]
        tuner.start()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            s = tuner.status()
            decided = s["versions_published"] + s["versions_rejected"]
            if s["pairs_trained"] >= to_train and s["state"] == "idle" and decided >= 2 * len(USERS):
                break
            await asyncio.sleep(0.05)
        status = tuner.status()
        await tuner.checkpoint()
        thread.stop()
        await thread.join(10)
        return status

    try:
        status = asyncio.run(main())
    finally:
        store.close()
    assert status["pairs_trained"] >= to_train and status["errors"] == 0, status
    spans: dict[str, list[int]] = {}  # each guard evaluation's stages (indices into events)
    for i, (kind, job_id, *_rest) in enumerate(events):
        if kind == "guard":
            spans.setdefault(job_id, []).append(i)
    assert len(spans) >= 2 * len(USERS), "the guard did not run for every publish"
    # A user's next items train while its candidate is judged: every guard evaluation of a user
    # who trained more items afterwards has one of that user's training stages inside its span.
    last_train = {user: max(i for i, (k, _j, u, *_rest) in enumerate(events) if k == "train" and u == user)
                  for user in USERS}
    for stages in spans.values():
        user = events[stages[0]][2]
        if last_train[user] < stages[-1]:
            continue  # nothing of the user's left to train beside its last candidate
        inside = [i for i in range(stages[0], stages[-1]) if events[i][0] == "train" and events[i][2] == user]
        assert inside, f"{user}'s items waited for its candidate's whole evaluation ({len(stages)} stages)"
    # The bound, in stages: a queued training job never waits behind a whole guard evaluation (no
    # run of guard stages while one was queued is as long as the shortest evaluation), so every
    # stretch without a finished item is one training job's stages plus what it shares turns with.
    shortest = min(len(stages) for stages in spans.values())
    run = longest = 0
    for kind, _job, _user, _ended, training in events:
        run = run + 1 if kind == "guard" and training else 0
        longest = max(longest, run)
    assert longest < shortest, (longest, shortest)


def test_a_stretch_without_progress_is_measured_and_warned_once(caplog: Any) -> None:
    from daemon.finetune.progress import ProgressWatch

    now = [0.0]
    watch = ProgressWatch(warn_s=60.0, clock=lambda: now[0])
    now[0] = 100.0
    assert watch.check(busy=False) == 0.0  # idle: no stretch
    now[0] = 130.0
    assert watch.check(busy=True) == 30.0 and watch.warnings == 0
    with caplog.at_level("WARNING", logger="daemon.finetune.progress"):
        now[0] = 170.0
        assert watch.check(busy=True, describe=lambda: "2 item(s) in flight") == 70.0
        now[0] = 200.0
        watch.check(busy=True)
    assert watch.warnings == 1 and "no progress for 70 s" in caplog.text and "2 item(s) in flight" in caplog.text
    watch.progressed()
    now[0] = 210.0
    assert watch.check(busy=True) == 10.0 and watch.longest_s == 100.0
