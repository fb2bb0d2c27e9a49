"""The import structure of `daemon/` over `edge_runtime/`, read with `ast` (nothing is imported):
no import circle through the daemon, and no import from a lower layer to a higher one.

How imports count. An edge goes to the module an import names (`from a.b import c` is a.b.c when
that is a module, else a.b), not to the parent packages Python also initialises. Every import
counts, wherever it is: at module level, inside a function (a dependency taken later is still a
dependency) and under `if TYPE_CHECKING:` (a module that names another's types knows it). So a
circle here is a circle of design, not only one that would fail at import time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("daemon", "edge_runtime")

def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))}


MODULES = all_modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(name: str, current: str, is_package: bool, level: int) -> str:
    if level == 0:
        return name
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports_of(module: str) -> tuple[set[str], set[str]]:
    """(imports that run, every import including TYPE_CHECKING ones), as project module names."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    runs: set[str] = set()
    every: set[str] = set()

    def targets(node: ast.Import | ast.ImportFrom) -> set[str]:
        found = set()
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = _resolve(node.module or "", module, is_package, node.level)
            names = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                names.append(sub if sub in MODULES else base)
        for name in names:
            while name and name not in MODULES and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in MODULES and name != module:
                found.add(name)
        return found

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found = targets(child)
                every.update(found)
                if not typing_only:
                    runs.update(found)
            elif isinstance(child, ast.If) and _is_type_checking(child):
                visit(child, True)
            else:
                visit(child, typing_only)

    visit(tree, False)
    return runs, every


GRAPH = {m: imports_of(m) for m in MODULES}


def circles() -> list[tuple[str, ...]]:
    """Strongly connected components of the graph of every import, with more than one module
    (Tarjan's algorithm, iterative so deep chains cannot overflow the stack)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []
    counter = 0
    for root in sorted(GRAPH):
        if root in index:
            continue
        work = [(root, iter(sorted(GRAPH[root][1])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(GRAPH[nxt][1]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(tuple(sorted(component)))
    return sorted(found)


def test_the_graph_reads_the_packages() -> None:
    assert "daemon.service" in GRAPH and "edge_runtime.engine" in GRAPH
    assert "daemon.wire.frames" in GRAPH["daemon.wire.ops"][0]


def test_no_import_circle_runs_through_the_daemon() -> None:
    # edge_runtime's own circles are tests/test_import_circles.py's (with its allow-list).
    daemon_circles = [c for c in circles() if any(m.startswith("daemon") for m in c)]
    assert daemon_circles == []


def _under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


# (who, what it may import from the project, why). Every import counts, wherever it is.
RULES = [
    ("edge_runtime", ("edge_runtime",), "the runtime is the lowest layer: it never imports the daemon"),
    ("daemon.wire", ("daemon.wire",), "the wire format is shared with apps: nothing else of the daemon, "
     "no runtime"),
    ("daemon.sdk", ("daemon.wire", "daemon.sdk"), "the SDK needs only the wire format"),
    ("daemon.fleet.offdevice", ("daemon.fleet.offdevice", "daemon.sdk", "daemon.wire", "edge_runtime"),
     "the fleet's Flower processes talk to maced through the SDK, never its internals"),
]


@pytest.mark.parametrize("who, allowed, why", RULES)
def test_a_layer_imports_only_what_lies_beneath_it(who: str, allowed: tuple[str, ...], why: str) -> None:
    bad = sorted((m, t) for m, (_, every) in GRAPH.items() if _under(m, who)
                 for t in every if not _under(t, *allowed))
    assert bad == [], f"{why}: {bad}"


def test_maced_never_imports_the_off_device_fleet() -> None:
    bad = sorted((m, t) for m, (_, every) in GRAPH.items() if not _under(m, "daemon.fleet.offdevice")
                 for t in every if _under(t, "daemon.fleet.offdevice"))
    assert bad == []


def test_no_source_file_of_the_daemon_passes_500_lines() -> None:
    long = sorted((m, n) for m, p in MODULES.items() if _under(m, "daemon")
                  and (n := len(p.read_text().splitlines())) > 500)
    assert long == []
