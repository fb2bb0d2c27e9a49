"""ort_prefetch: the hint written when a session opens, the next start's session opened from it and
taken by an identical open, and every hint or open it must not act on (stale, outside the cache,
corrupt, other options) ignored or dropped before the right session opens."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edge_runtime.backends import ort_prefetch, ort_session

CPU = [("CPUExecutionProvider", {})]  # a provider with options, as pick_providers gives GPU ones
X = {"x": np.arange(3 * 8, dtype=np.float32).reshape(3, 8) / 10}


def _graph(folder, seed=0):
    """A one-MatMul graph with its weight in external data, as exported graphs keep theirs."""
    folder.mkdir(parents=True, exist_ok=True)
    w = np.random.default_rng(seed).standard_normal((8, 4)).astype(np.float32)
    node = helper.make_node("MatMul", ["x", "W"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save_model(model, str(folder / "model.onnx"), save_as_external_data=True,
                    location="model.onnx.data", size_threshold=0)
    return folder / "model.onnx"


@pytest.fixture
def cache(tmp_path):
    onnx_dir = tmp_path / "onnx"
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    yield onnx_dir, str(model)
    ort_prefetch.stop()


def _first_start(onnx_dir, model, graph, **kw):
    """A start that opens `graph` itself (no hint yet) and so writes the hint."""
    ort_prefetch.start(model, onnx_dir).done.wait()
    session = ort_session.open_session(graph, CPU, 1, **kw)
    ort_prefetch.stop()
    return session


def test_hint_written_then_taken(cache, monkeypatch):
    onnx_dir, model = cache
    graph = _graph(onnx_dir / "g1")
    first = _first_start(onnx_dir, model, graph, has_lora_inputs=False)
    hint = json.loads(ort_prefetch.hint_file(onnx_dir, ort_prefetch.model_identity(model)).read_text())
    assert hint["graph"] == str(graph.resolve()) and hint["options"]["has_lora_inputs"] is False
    assert set(hint["stamps"]) == {"model.onnx", "model.onnx.data"} and hint["data"] == "model.onnx.data"

    prefetch = ort_prefetch.start(model, onnx_dir)
    prefetch.done.wait()
    prefetched = prefetch.session
    assert prefetched is not None
    monkeypatch.setattr(ort_prefetch, "create_inference", lambda *a, **k: pytest.fail("opened again"))
    monkeypatch.setattr(ort_prefetch.durable, "write_json", lambda *a, **k: pytest.fail("the hint rewritten"))
    taken = ort_session.open_session(graph, CPU, 1, has_lora_inputs=False)
    assert taken.inference is prefetched[0] and taken.prefetched and prefetch.session is None
    assert not first.prefetched
    np.testing.assert_array_equal(taken.inference.run(None, X)[0], first.inference.run(None, X)[0])


def test_a_prefetched_session_reports_what_a_quiet_open_of_its_graph_measured(cache, monkeypatch):
    # The thread's own before/after counts the start's imports too; the ledger takes the figure the
    # engine's own open measured (noted in the hint), never more than the thread saw.
    onnx_dir, model = cache
    graph = _graph(onnx_dir / "g1")
    ort_prefetch.start(model, onnx_dir).done.wait()
    ort_session.open_session(graph, CPU, 1)
    ort_prefetch.current().note_opened(_graph(onnx_dir / "other"), 5)  # another graph: not this hint's
    ort_prefetch.current().note_opened(graph, 1000)
    ort_prefetch.stop()
    assert ort_prefetch.opened_bytes(onnx_dir, ort_prefetch.model_identity(model)) == 1000
    create = ort_prefetch.create_inference
    monkeypatch.setattr(ort_prefetch, "create_inference", lambda *a, **k: (create(*a, **k)[0], 10**9))
    ort_prefetch.start(model, onnx_dir).done.wait()
    taken = ort_session.open_session(graph, CPU, 1)
    assert taken.prefetched and taken.weights_bytes == 1000


def test_mismatch_drops_the_prefetched_session_first(cache, monkeypatch):
    onnx_dir, model = cache
    graph = _graph(onnx_dir / "g1")
    _first_start(onnx_dir, model, graph)
    prefetch = ort_prefetch.start(model, onnx_dir)
    prefetch.done.wait()
    assert prefetch.session is not None
    events = []
    monkeypatch.setattr(ort_prefetch, "_give_heap_back", lambda: events.append(("trim", prefetch.session)))
    create = ort_prefetch.create_inference
    monkeypatch.setattr(ort_prefetch, "create_inference",
                        lambda *a, **k: events.append(("open", a[1]["num_threads"])) or create(*a, **k))
    ort_session.open_session(graph, CPU, 2)  # another thread count: another session
    assert events == [("trim", None), ("open", 2)]


@pytest.mark.parametrize("spoil", ["rewritten", "outside", "corrupt", "other-model"])
def test_bad_hints_are_ignored(cache, tmp_path, spoil):
    onnx_dir, model = cache
    graph = _graph(onnx_dir / "g1")
    _first_start(onnx_dir, model, graph)
    hint_path = ort_prefetch.hint_file(onnx_dir, ort_prefetch.model_identity(model))
    hint = json.loads(hint_path.read_text())
    if spoil == "rewritten":
        _graph(onnx_dir / "g1", seed=1)
    elif spoil == "outside":
        foreign = _graph(tmp_path / "elsewhere")
        hint["graph"] = str(onnx_dir / ".." / "elsewhere" / "model.onnx")
        hint["stamps"] = ort_prefetch.graph_stamps(foreign)
        hint_path.write_text(json.dumps(hint))
    elif spoil == "corrupt":
        hint_path.write_text("{not json")
    else:
        hint["identity"] = ["path", "/another/model", 1, 2, 3]
        hint_path.write_text(json.dumps(hint))
    prefetch = ort_prefetch.start(model, onnx_dir)
    prefetch.done.wait()
    assert prefetch.session is None
    with pytest.raises((ort_prefetch.HintError, OSError)):
        ort_prefetch.read_hint(onnx_dir, ort_prefetch.model_identity(model))
    assert ort_session.open_session(graph, CPU, 1).inference.run(None, X)[0].shape == (3, 4)


def test_a_rewritten_model_file_is_another_model(cache):
    onnx_dir, model = cache
    before = ort_prefetch.model_identity(model)
    with open(model, "ab") as fh:
        fh.write(b"\0")
    assert ort_prefetch.model_identity(model) != before


def test_start_early_reads_the_command_line_and_the_setting(tmp_path):
    env = {"MACE_CACHE_DIR": str(tmp_path)}
    assert ort_prefetch.start_early(None, [], env) is None  # the model is in the config file
    assert ort_prefetch.start_early("m.gguf", ["engine.onnx_prefetch=false"], env) is None
    assert ort_prefetch.start_early("m.gguf", [], {**env, ort_prefetch.ENV: "0"}) is None
    try:
        prefetch = ort_prefetch.start_early("m.gguf", ["engine.onnx_cache_dir=" + str(tmp_path / "o")], env)
        assert prefetch is not None and prefetch.onnx_dir == tmp_path / "o"
        prefetch.done.wait()
        assert prefetch.session is None  # no hint
    finally:
        ort_prefetch.stop()


def test_settle_stops_a_prefetch_the_config_rules_out(tmp_path):
    from edge_runtime.config import EngineConfig

    try:
        first = ort_prefetch.start("m.gguf", tmp_path / "onnx")
        ort_prefetch.settle(EngineConfig(model="m.gguf", backend="torch", onnx_cache_dir=str(tmp_path / "onnx")))
        assert ort_prefetch.current() is None and first.abandoned
        ort_prefetch.settle(EngineConfig(model="m.gguf", backend="auto", onnx_cache_dir=str(tmp_path / "onnx")))
        assert ort_prefetch.current().identity == ort_prefetch.model_identity("m.gguf")
        ort_prefetch.settle(EngineConfig(model="m.gguf", backend="auto", onnx_prefetch=False))
        assert ort_prefetch.current() is None
    finally:
        ort_prefetch.stop()
