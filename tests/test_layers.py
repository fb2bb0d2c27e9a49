"""The import structure of `daemon/` over `edge_runtime/` (tests/import_graph.py: every import
counts, wherever it is): no import circle through the daemon, and no import from a lower layer to
a higher one."""

from __future__ import annotations

import pytest

from tests.import_graph import EVERY, GRAPH, MODULES, circles, under


def test_the_graph_reads_the_packages() -> None:
    assert "daemon.service" in GRAPH and "edge_runtime.engine" in GRAPH
    assert "daemon.wire.frames" in GRAPH["daemon.wire.ops"][0]


def test_no_import_circle_runs_through_the_daemon() -> None:
    # edge_runtime's own circles are tests/test_import_circles.py's (with its allow-list).
    daemon_circles = [c for c in circles(EVERY) if any(m.startswith("daemon") for m in c)]
    assert daemon_circles == []


# (who, what it may import from the project, why). Every import counts, wherever it is.
RULES = [
    ("edge_runtime", ("edge_runtime", "trt_plugins"), "the runtime is the lowest layer: it never imports the "
     "daemon (trt_plugins is its TensorRT backend, loaded only where tensorrt exists)"),
    ("trt_plugins", ("trt_plugins", "edge_runtime"), "TensorRT's pieces extend the runtime, never the daemon"),
    ("daemon.wire", ("daemon.wire",), "the wire format is shared with apps: nothing else of the daemon, "
     "no runtime"),
    ("daemon.sdk", ("daemon.wire", "daemon.sdk"), "the SDK needs only the wire format"),
    ("daemon.fleet.offdevice", ("daemon.fleet.offdevice", "daemon.sdk", "daemon.wire", "edge_runtime"),
     "the fleet's Flower processes talk to maced through the SDK, never its internals"),
]


@pytest.mark.parametrize("who, allowed, why", RULES)
def test_a_layer_imports_only_what_lies_beneath_it(who: str, allowed: tuple[str, ...], why: str) -> None:
    bad = sorted((m, t) for m, (_, every) in GRAPH.items() if under(m, who)
                 for t in every if not under(t, *allowed))
    assert bad == [], f"{why}: {bad}"


def test_maced_never_imports_the_off_device_fleet() -> None:
    bad = sorted((m, t) for m, (_, every) in GRAPH.items() if not under(m, "daemon.fleet.offdevice")
                 for t in every if under(t, "daemon.fleet.offdevice"))
    assert bad == []


def test_no_source_file_of_the_daemon_or_the_runtime_passes_500_lines() -> None:
    long = sorted((m, n) for m, p in MODULES.items() if under(m, "daemon", "edge_runtime")
                  and (n := len(p.read_text().splitlines())) > 500)
    assert long == []


def test_the_engines_step_reads_as_the_algorithm_in_at_most_15_lines() -> None:
    import ast

    tree = ast.parse(MODULES["edge_runtime.engine"].read_text())
    step = next(f for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "Engine"
                for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "step")
    assert step.end_lineno - step.lineno + 1 <= 15
