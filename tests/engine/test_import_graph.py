"""The engine's collaborators and the scheduler import without circles (type-only imports
count too): parsed from the source, so no module is imported to check."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "edge_runtime"
# The modules this layout splits the engine into, and the scheduler's package.
CHECKED = ("edge_runtime.engine", "edge_runtime.runner", "edge_runtime.commit", "edge_runtime.intake",
           "edge_runtime.sizing", "edge_runtime.loading", "edge_runtime.kv.compaction_timing",
           "edge_runtime.backends.base", "edge_runtime.sched.")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """Module-level statements, `if TYPE_CHECKING:` blocks included; imports inside functions
    are deliberately lazy and left out."""
    out: list[ast.stmt] = []
    for node in tree.body:
        out.append(node)
        if isinstance(node, (ast.If, ast.Try)):
            out += _top_level(ast.Module(body=node.body + node.orelse, type_ignores=[]))
    return out


def _imports(path: Path, known: set[str]) -> set[str]:
    out = set()
    for node in _top_level(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from edge_runtime.sched import cost_model` names a module, `from x import y` a member of x.
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                out.add(name if name in known else node.module)
        elif isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
    return out & known


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(paths)
    return {name: {m for m in _imports(path, known) if m != name} for name, path in paths.items()}


def _cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    stack = [(start, [start])]
    seen = set()
    while stack:
        node, trail = stack.pop()
        for nxt in graph.get(node, ()):
            if nxt == start:
                return trail + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, trail + [nxt]))
    return None


def test_engine_collaborators_and_the_scheduler_have_no_import_circles() -> None:
    graph = _graph()
    checked = [m for m in graph if m.startswith(CHECKED) or m in CHECKED]
    assert "edge_runtime.sched.task" in checked and "edge_runtime.runner" in checked
    circles = {m: c for m in checked if (c := _cycle_through(graph, m)) is not None}
    assert not circles, "\n".join(" -> ".join(c) for c in circles.values())


def test_the_sched_package_does_not_import_the_engine() -> None:
    graph = _graph()
    upward = {m: sorted(d for d in deps if d.startswith(("edge_runtime.engine", "edge_runtime.runner",
                                                          "edge_runtime.commit", "edge_runtime.intake")))
              for m, deps in graph.items() if m.startswith("edge_runtime.sched.")}
    assert not {m: d for m, d in upward.items() if d}
