"""A rollback that lands after the guard's evaluation ended but before its publish call must not be
published over: the publish checks the user's rollback epoch on the engine thread, where the
rollback runs (daemon/finetune/publishing.py). In-process: the daemon's fine-tuner, engine thread
and feedback store on the tiny model."""

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


class _RollbackBeforeThirdPublish:
    """The engine thread as the fine-tuner sees it, except that the third publish call waits for
    a rollback to version 1 first: exactly the window between the evaluation's end and the
    publish (deterministic, no timing)."""

    def __init__(self, thread: EngineThread) -> None:
        self.thread = thread
        self.tuner: EngineFineTuner | None = None
        self.finishes = 0
        self.newest_after: int | None = None
        self.outcome: Any = "not reached"

    def __getattr__(self, name: str) -> Any:
        return getattr(self.thread, name)

    async def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(fn, "__name__", "") != "finish":
            return await self.thread.call(fn, *args, **kwargs)
        self.finishes += 1
        if self.finishes != 3:
            return await self.thread.call(fn, *args, **kwargs)
        assert self.tuner is not None
        rolled = await self.tuner.rollback("ada", 1)
        assert rolled["serving"] == 1
        self.outcome = await self.thread.call(fn, *args, **kwargs)
        newest = await self.thread.call(lambda e: e.adapters.newest("ada"))
        self.newest_after = None if newest is None else newest.version
        return self.outcome


def test_a_rollback_between_the_evaluation_and_the_publish_is_not_published_over(tiny_model_dir: Path,
                                                                                  tmp_path: Path) -> None:
    store = FeedbackStore(tmp_path / "fb.sqlite3", config=FeedbackStoreConfig(heldout_fraction=0.0,
                                                                             retention_interval_s=None))
    store.set_consent("ada", True)
    for i in range(4):
        store.record_interaction("ada", f"r{i}", f"Question {i}?", [f"Answer {i}.", f"No {i}."], model="m")
        store.record_feedback("ada", f"r{i}", Choice(0))

    def load():
        from edge_runtime.engine import Engine

        return Engine.load(str(tiny_model_dir), dtype="float32", kv_cache_bytes=8 << 20)

    async def main() -> tuple[_RollbackBeforeThirdPublish, list[dict]]:
        thread = EngineThread(load, asyncio.get_running_loop())
        await thread.start()
        engine = _RollbackBeforeThirdPublish(thread)
        tuner = EngineFineTuner(engine, store, FineTuneSettings(pairs_per_version=1, guard=False), poll_s=0.05)
        engine.tuner = tuner
        tuner.start()
        deadline = time.monotonic() + 180
        while engine.newest_after is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await tuner.checkpoint()
        events = await thread.call(lambda e: e.adapters.events("ada"))
        thread.stop()
        await thread.join(10)
        return engine, events

    try:
        engine, events = asyncio.run(main())
    finally:
        store.close()
    assert engine.finishes >= 3, "the third publish was never reached"
    # The candidate trained on the replaced weights was dropped, not published over version 1.
    assert engine.outcome is None
    assert engine.newest_after == 1
    kinds = [e["kind"] for e in events]
    assert "published" in kinds and any("roll" in k for k in kinds)
