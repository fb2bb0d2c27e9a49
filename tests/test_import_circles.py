"""No import circle among the modules of edge_runtime/ and trt_plugins/: every `import` and
`from ... import` counts, those under `if TYPE_CHECKING:` too (a type-only circle still ties the
two modules' designs together)."""

from __future__ import annotations

from tests.import_graph import EVERY, circles, under

PACKAGES = ("edge_runtime", "trt_plugins")
KNOWN: list[tuple[str, ...]] = []


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]


def test_no_import_circles():
    graph = {m: {t for t in deps if under(t, *PACKAGES)} for m, deps in EVERY.items() if under(m, *PACKAGES)}
    assert [c for c in circles(graph) if c not in KNOWN] == []
