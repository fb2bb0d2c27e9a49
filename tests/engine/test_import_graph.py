"""The scheduler sits below the engine: nothing in edge_runtime/sched/ imports the engine or its
collaborators (tests/test_import_circles.py checks there is no circle at all)."""

from __future__ import annotations

from tests.import_graph import EVERY

ENGINE_SIDE = ("edge_runtime.engine", "edge_runtime.runner", "edge_runtime.commit", "edge_runtime.intake",
               "edge_runtime.loading")


def test_the_sched_package_does_not_import_the_engine_side() -> None:
    graph = EVERY
    assert "edge_runtime.sched.supervisor" in graph and "edge_runtime.runner" in graph
    upward = {name: sorted(d for d in deps if d in ENGINE_SIDE)
              for name, deps in graph.items() if name.startswith("edge_runtime.sched.")}
    assert {name: deps for name, deps in upward.items() if deps} == {}
