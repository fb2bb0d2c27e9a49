"""How the optimizer steps against how often versions are published, through the daemon's own
fine-tuner in-process (engine thread, feedback store, tiny model): docs/training.md, "Optimizer
steps and versions"."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from daemon.engine_thread import EngineThread
from daemon.finetune.engine_tuner import EngineFineTuner
from daemon.settings import FineTuneSettings
from edge_runtime.feedback import FeedbackStore
from edge_runtime.feedback.config import FeedbackStoreConfig
from edge_runtime.feedback.records import Choice


def _loader(model_dir: Path):
    def load():
        from edge_runtime.engine import Engine

        return Engine.load(str(model_dir), dtype="float32", kv_cache_bytes=8 << 20)
    return load


def _train(model_dir: Path, tmp: Path, pairs: int, pairs_per_version: int, guard: bool = False,
           heldout_fraction: float = 0.0) -> tuple[int, int, list[int], int]:
    """`pairs` choice pairs of one user through the fine-tuner; returns (optimizer steps, pairs
    trained, pairs per published version, candidates refused)."""
    store = FeedbackStore(tmp / "fb.sqlite3", config=FeedbackStoreConfig(heldout_fraction=heldout_fraction,
                                                                        retention_interval_s=None))
    store.set_consent("ada", True)
    for i in range(pairs):
        store.record_interaction("ada", f"r{i}", f"Question {i}?", [f"Answer {i}.", f"No {i}."], model="m")
        store.record_feedback("ada", f"r{i}", Choice(0))

    async def main() -> tuple[int, int, list[int], int]:
        thread = EngineThread(_loader(model_dir), asyncio.get_running_loop())
        await thread.start()
        settings = FineTuneSettings(pairs_per_version=pairs_per_version, guard=guard, guard_prompts=1, guard_tokens=4)
        tuner = EngineFineTuner(thread, store, settings, poll_s=0.05)
        tuner.start()
        deadline = time.monotonic() + 120
        training = pairs - len(store.heldout_pairs("ada"))

        def decided(events: list[dict]) -> int:  # pairs in published or refused candidates
            return sum(len(e.get("pair_ids", [])) for e in events if e["kind"] in ("published", "rejected"))

        events: list[dict] = []
        while time.monotonic() < deadline and decided(events) < training:
            await asyncio.sleep(0.2)
            events = await thread.call(lambda e: e.adapters.events("ada"))
        published = [e.get("pair_ids", []) for e in events if e["kind"] == "published"]
        await tuner.checkpoint()
        thread.stop()
        await thread.join(10)
        return (tuner.optimizer_steps, tuner.pairs_trained, [len(p) for p in published],
                sum(e["kind"] == "rejected" for e in events))

    try:
        return asyncio.run(main())
    finally:
        store.close()


@pytest.mark.parametrize("pairs_per_version, versions", [(1, [1] * 5), (4, [4, 1])])
def test_one_optimizer_step_per_pair_whatever_pairs_per_version(tiny_model_dir: Path, tmp_path: Path,
                                                                pairs_per_version: int, versions: list[int]) -> None:
    """The default (accumulation_steps = 1) steps once per trained pair: 5 pairs give 5 steps
    whether a version is published after every pair or after four (issue #32: with the old
    default of 4, the second setting took one step per version)."""
    steps, trained, published, _ = _train(tiny_model_dir, tmp_path, 5, pairs_per_version)
    assert trained == 5 and steps == 5
    assert published == versions



def test_the_guard_evaluates_a_served_version_once_per_held_out_set(tiny_model_dir: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A version is immutable: the fine-tuner keeps its held-out metrics from the decision that
    published it, so a guarded publish evaluates the candidate only (the served version again
    only when the held-out pairs or the fleet beneath changed; here they never do)."""
    from edge_runtime.train.guard_task import GuardEvaluation

    evaluations: list[object] = []
    stages = GuardEvaluation._pair_stages  # the held-out pairs' stages for one set of weights

    def counted(self, tokens, weights, field, known=None):
        before = len(self.stages)
        out = stages(self, tokens, weights, field, known)
        if len(self.stages) > before:  # rows not known from an earlier evaluation: scored now
            evaluations.append(weights)
        return out

    monkeypatch.setattr(GuardEvaluation, "_pair_stages", counted)
    steps, trained, published, refused = _train(tiny_model_dir, tmp_path, 9, 1, guard=True, heldout_fraction=0.4)
    assert trained == steps and trained >= 3 and len(published) + refused == trained
    # One evaluation per candidate, plus the base's once (it was served before the first).
    assert len(evaluations) == trained + 1


def test_a_stop_before_the_publish_leaves_the_trained_pairs_pending_and_runs_no_guard(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """A pair counts as trained in the store only with the version that carries its update
    (published or refused): at every moment, and after a stop that came between its update and
    that version, every other pair is still pending, so the restarted daemon trains it again
    (its update lived only in the trainer's weights). The stop itself runs no guard: it must fit
    systemd's stop timeout whatever the model's size (a guarded publish on an 8B model at stop
    overran it)."""
    store = FeedbackStore(tmp_path / "fb.sqlite3", config=FeedbackStoreConfig(heldout_fraction=0.0,
                                                                             retention_interval_s=None))
    store.set_consent("ada", True)
    for i in range(6):
        store.record_interaction("ada", f"r{i}", f"Question {i}?", [f"Answer {i}.", f"No {i}."], model="m")
        store.record_feedback("ada", f"r{i}", Choice(0))

    async def main() -> tuple[list[dict], float]:
        thread = EngineThread(_loader(tiny_model_dir), asyncio.get_running_loop())
        await thread.start()
        settings = FineTuneSettings(pairs_per_version=4, guard=True, guard_prompts=1, guard_tokens=4)
        tuner = EngineFineTuner(thread, store, settings, poll_s=0.05)
        tuner.start()
        deadline = time.monotonic() + 120
        while tuner.pairs_trained < 2 and time.monotonic() < deadline:  # mid-batch: none decided
            await asyncio.sleep(0.02)
        assert tuner.pairs_trained >= 2
        events = await thread.call(lambda e: e.adapters.events("ada"))
        decided = {p for e in events if e["kind"] in ("published", "rejected") for p in e.get("pair_ids", [])}
        marked = {p.id for p in await asyncio.to_thread(store.next_pairs, "ada", 64, status="trained")}
        assert marked <= decided  # a crash now would lose no update the store calls trained
        t0 = time.monotonic()
        await tuner.checkpoint()
        stop_s = time.monotonic() - t0
        events = await thread.call(lambda e: e.adapters.events("ada"))
        thread.stop()
        await thread.join(10)
        return events, stop_s

    try:
        events, stop_s = asyncio.run(main())
        decided = {p for e in events if e["kind"] in ("published", "rejected") for p in e.get("pair_ids", [])}
        trained = {p.id for p in store.next_pairs("ada", 64, status="trained")}
        pending = {p.id for p in store.next_pairs("ada", 64)}
    finally:
        store.close()
    assert trained == decided
    assert len(pending) == 6 - len(decided) and len(pending) >= 2
    assert stop_s < 10.0
