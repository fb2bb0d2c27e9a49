"""The first fine-tune job's stage-cost profile shows in `macectl status` (issue #28: at the 8B
shape it ran for minutes while the state said `idle`): in process, the profile held until the
status has said `profiling`, so nothing here waits on a guess of how long it takes."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

from daemon.engine_thread import EngineThread
from daemon.finetune.engine_tuner import EngineFineTuner
from daemon.metrics import _FINETUNE_STATES
from daemon.settings import FineTuneSettings
from edge_runtime.feedback import FeedbackStore
from edge_runtime.feedback.config import FeedbackStoreConfig
from edge_runtime.feedback.records import Choice


def test_status_says_profiling_while_the_stage_costs_are_measured(tiny_model_dir: Path, tmp_path: Path,
                                                                   monkeypatch: Any) -> None:
    from edge_runtime.engine import Engine

    store = FeedbackStore(tmp_path / "fb.sqlite3", config=FeedbackStoreConfig(heldout_fraction=0.0,
                                                                              retention_interval_s=None))
    store.set_consent("ada", True)
    store.record_interaction("ada", "i0", "Question?", ["Answer.", "No."], model="m")
    store.record_feedback("ada", "i0", Choice(0))
    entered, release = threading.Event(), threading.Event()
    stage_costs = Engine.stage_costs

    def held(self: Engine, settings: Any = None) -> Any:
        entered.set()
        release.wait(120)
        return stage_costs(self, settings)
    monkeypatch.setattr(Engine, "stage_costs", held)

    def load() -> Engine:
        return Engine.load(str(tiny_model_dir), dtype="float32", kv_cache_bytes=8 << 20,
                           cost_cache_dir=str(tmp_path / "costs"))

    async def main() -> tuple[dict[str, Any], dict[str, Any], float]:
        thread = EngineThread(load, asyncio.get_running_loop())
        await thread.start()
        tuner = EngineFineTuner(thread, store, FineTuneSettings(pairs_per_version=8), poll_s=0.05)
        tuner.start()
        deadline = time.monotonic() + 120  # a failure bound only: the loops below wait on states
        while not entered.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        during = tuner.status()
        release.set()
        while tuner.profile_seconds is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # until the profile returned: its job is then queued
        after = tuner.status()  # read after the profile's end, not before it
        thread.stop()
        await thread.join(10)
        assert tuner.profile_seconds is not None, "the profile did not return in 120 s"
        return during, after, tuner.profile_seconds

    try:
        during, after, profile_seconds = asyncio.run(main())
    finally:
        release.set()
        store.close()
    assert during["state"] == "profiling" and during["profile_s"] >= 0.0, during
    # status rounds to 0.1 s, and the tiny model's profile can take less than 0.05 s
    assert after["state"] != "profiling" and after["profile_s"] >= 0.0, after
    assert after["profile_s"] == round(profile_seconds, 1) and profile_seconds > 0.0, after
    assert "profiling" in _FINETUNE_STATES  # the /metrics gauge has the state too
