"""A staged task's stage gives the C heap's free pages back when it ends (`staged.TRIM_AFTER_STAGE`):
in the daemon the stages run on the engine thread, whose glibc arena otherwise kept each stage's
freed tensors under the next; stages shorter than `TRIM_MIN_STAGE_S` skip it."""

from __future__ import annotations

from edge_runtime import c_heap
from edge_runtime.train import staged


def _stage(ran: list[str]) -> staged.Stage:
    return staged.Stage(staged.StageKind.FORWARD, "s", lambda: staged.StageEstimate(0.0, 0, 0),
                        lambda: ran.append("ran"))


def test_a_stage_trims_the_heap_after_it_runs(monkeypatch):
    events: list[str] = []
    monkeypatch.setattr(staged, "give_heap_back", lambda: events.append("trim") or True)
    monkeypatch.setattr(staged, "TRIM_MIN_STAGE_S", 0.0)
    stage = _stage(events)
    assert stage.run() >= 0.0 and stage.seconds is not None
    assert events == ["ran", "trim"]


def test_short_stages_and_the_switch_skip_the_trim(monkeypatch):
    events: list[str] = []
    monkeypatch.setattr(staged, "give_heap_back", lambda: events.append("trim") or True)
    monkeypatch.setattr(staged, "TRIM_MIN_STAGE_S", 3600.0)  # no stage here lasts an hour
    _stage(events).run()
    monkeypatch.setattr(staged, "TRIM_MIN_STAGE_S", 0.0)
    monkeypatch.setattr(staged, "TRIM_AFTER_STAGE", False)
    _stage(events).run()
    assert events == ["ran", "ran"]


def test_the_trim_is_glibc_malloc_trim_where_there_is_one():
    assert staged.give_heap_back() is (c_heap._glibc("malloc_trim") is not None)
