"""The project's import graph, read with `ast` (nothing is imported), for the tests of its shape
(tests/test_layers.py, tests/test_import_circles.py, tests/engine/test_import_graph.py).

How imports count. An edge goes to the module an import names (`from a.b import c` is a.b.c when
that is a module, else a.b), not to the parent packages Python also initialises. Every import
counts, wherever it is: at module level, inside a function (a dependency taken later is still a
dependency) and under `if TYPE_CHECKING:` (a module that names another's types knows it). So a
circle here is a circle of design, not only one that would fail at import time.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("daemon", "edge_runtime", "trt_plugins")


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
# Every import, TYPE_CHECKING ones included: the graph the shape tests read.
EVERY = {m: every for m, (_, every) in GRAPH.items()}


def circles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Strongly connected components of `graph` (module -> modules it imports) with more than one module
    (Tarjan's algorithm, iterative so deep chains cannot overflow the stack)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
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
                    work.append((nxt, iter(sorted(graph[nxt]))))
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


def under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)
