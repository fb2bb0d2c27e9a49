"""The probe of GroupQueryAttention's `local_window_size` convention, and that the "ort" graph of
a sliding-window model carries the window the probe says gives transformers' attention."""

from __future__ import annotations

import pytest

pytest.importorskip("onnxruntime")

from edge_runtime.backends import gqa_window  # noqa: E402
from edge_runtime.backends.onnx_graph import build_step_graph  # noqa: E402
from edge_runtime.backends.onnx_spec import GraphSpec, with_gqa_window  # noqa: E402
from edge_runtime.backends.onnxruntime_backend import OnnxRuntimeBackend  # noqa: E402
from edge_runtime.model.testing import make_tiny_model_dir  # noqa: E402
from tests.backends.helpers import ort_device  # noqa: E402


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("mistral"), model_type="mistral", config={"sliding_window": 8})


@pytest.fixture
def fresh_probe():
    gqa_window.window_counts_current_token.cache_clear()
    yield
    gqa_window.window_counts_current_token.cache_clear()


def _windows(proto) -> set[int]:
    return {a.i for n in proto.graph.node if n.op_type == "GroupQueryAttention" for a in n.attribute
            if a.name == "local_window_size"}


@pytest.mark.parametrize("window", [2, 4, 6])
def test_the_probe_counts_the_keys_a_window_attends_to_at_prompt_and_decode(window):
    counts_current = gqa_window.window_counts_current_token()
    expected = window if counts_current else window + 1
    assert gqa_window.keys_attended(window) == expected
    assert gqa_window.keys_attended(window, past=True) == expected


def test_the_installed_onnxruntime_counts_the_current_token():
    # onnxruntime 1.32 (this venv): a window of w keys, the query's own included.
    assert gqa_window.window_counts_current_token() is True
    assert gqa_window.local_window_size(8) == 8
    assert gqa_window.local_window_size(None) == -1


def test_an_older_convention_gets_one_key_less_in_the_attribute(monkeypatch, fresh_probe):
    monkeypatch.setattr(gqa_window, "keys_attended", lambda w, providers=(), past=False: w + 1)
    assert gqa_window.window_counts_current_token() is False
    assert gqa_window.local_window_size(8) == 7


def test_prompt_and_decode_disagreeing_is_an_error(monkeypatch, fresh_probe):
    monkeypatch.setattr(gqa_window, "keys_attended", lambda w, providers=(), past=False: w + int(past))
    with pytest.raises(RuntimeError, match="cannot run on its 'ort' graph"):
        gqa_window.window_counts_current_token()


def test_the_graph_carries_the_probed_window(mistral_dir, tmp_path):
    from edge_runtime import Engine

    engine = Engine.load(str(mistral_dir), dtype="float32", kv_cache_bytes=1 << 20, device=ort_device())
    for counts_current, attribute in ((True, 8), (False, 7)):
        spec = GraphSpec(gqa_window_counts_current=counts_current, lora=False)
        assert _windows(build_step_graph(engine.model, spec)) == {attribute}
    with pytest.raises(ValueError, match="gqa_window_counts_current"):
        build_step_graph(engine.model, GraphSpec(lora=False))
    # The backend probes its own providers; a model without a window needs no probe.
    backend = OnnxRuntimeBackend(engine.model, engine.cache, None, cache_dir=tmp_path, kv_layout="paged")
    assert backend.spec.gqa_window_counts_current is gqa_window.window_counts_current_token()
    assert with_gqa_window(GraphSpec(flavour="standard"), engine.model).gqa_window_counts_current is None
