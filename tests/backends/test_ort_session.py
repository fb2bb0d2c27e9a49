"""ort_session's switch for ONNX Runtime's weight pre-packing: off, the session says so, and
MatMulNBits then multiplies in float32 instead of its int8-activation kernel."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from edge_runtime.backends.ort_session import open_session  # noqa: E402
from edge_runtime.backends.quantize import dequantize_nbits, pack_nbits  # noqa: E402
from tests.fresh_process import in_fresh_process  # noqa: E402


def test_prepacking_off_gives_the_same_numbers(tmp_path):
    rng = np.random.default_rng(0)
    q = pack_nbits(rng.standard_normal((48, 64)).astype(np.float32), 4)
    node = helper.make_node("MatMulNBits", ["x", "B", "S", "Z"], ["y"], domain="com.microsoft", K=64, N=48, bits=4,
                            block_size=32, accuracy_level=4)
    inits = [numpy_helper.from_array(a, n) for a, n in ((q.packed, "B"), (q.scales, "S"), (q.zero_points, "Z"))]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                            helper.make_opsetid("com.microsoft", 1)], ir_version=10),
                    str(tmp_path / "m.onnx"))
    x = {"x": rng.standard_normal((3, 64)).astype(np.float32)}
    outs = []
    for prepack in (True, False):
        session = open_session(tmp_path / "m.onnx", ["CPUExecutionProvider"], 1, prepack=prepack)
        configs = session.inference.get_session_options()
        try:
            disabled = configs.get_session_config_entry("session.disable_prepacking") == "1"
        except RuntimeError:  # not set
            disabled = False
        assert disabled is not prepack
        outs.append(session.inference.run(None, x)[0])
    # Pre-packed, the int8-activation kernel runs; without it, ONNX Runtime 1.32 multiplies in
    # float32 (accuracy level 4 needs the packed layout): the float product, within rounding.
    want = x["x"] @ dequantize_nbits(q).T
    np.testing.assert_allclose(outs[1], want, rtol=1e-4, atol=1e-4)
    assert 1e-4 < np.abs(outs[0] - want).max() < 0.05 * np.abs(want).max()


def _anon_mib() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("RssAnon")) / 1024


def test_a_long_run_gives_the_arena_it_grew_back(tmp_path):
    """Above SHRINK_ABOVE_TOKENS a run shrinks ONNX Runtime's CPU arena when it ends: the regions
    its intermediates grew (here ~128 MiB) leave the process; a short run keeps the arena as is.
    In a fresh interpreter: resident memory is the measurement, and threads earlier tests left
    allocate beside it in a long test session."""
    in_fresh_process(__name__, "_arena_shrinks", str(tmp_path))


def _arena_shrinks(folder: str) -> None:
    from pathlib import Path

    import edge_runtime.backends.ort_session as ort_session

    tmp_path = Path(folder)

    assert ort_session.run_options(ort_session.SHRINK_ABOVE_TOKENS) is None
    long_run = ort_session.run_options(ort_session.SHRINK_ABOVE_TOKENS + 1)
    assert long_run.get_run_config_entry("memory.enable_memory_arena_shrinkage") == "cpu:0"
    nodes = [helper.make_node("Tile", ["x", "reps"], ["big"]), helper.make_node("Exp", ["big"], ["big2"]),
             helper.make_node("ReduceSum", ["big2"], ["y"], keepdims=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1024])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [helper.make_tensor("reps", TensorProto.INT64, [2], [1, 32])])
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    session = open_session(tmp_path / "m.onnx", ["CPUExecutionProvider"], 1).inference
    x = np.zeros((512, 1024), np.float32)  # two [512, 32768] float32 intermediates: 64 MiB each
    session.run(None, {"x": x[:1]})
    rest = _anon_mib()
    kept = session.run(None, {"x": x}, ort_session.run_options(1))[0]
    grown = _anon_mib()
    shrunk = session.run(None, {"x": x}, long_run)[0]
    after = _anon_mib()
    np.testing.assert_array_equal(kept, shrunk)
    assert grown - rest > 100 and grown - after > 100, (rest, grown, after)


def test_the_mmap_threshold_is_pinned_once_a_session_opens(tmp_path):
    """With the arena on, opening a session pins glibc's mmap threshold (so the arena's shrunk
    regions do not raise it and send later blocks to heaps that keep them)."""
    import ctypes.util

    import edge_runtime.backends.ort_session as ort_session

    if ctypes.util.find_library("c") is None or not hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallopt"):
        pytest.skip("no glibc mallopt here")
    ort_session.pin_mmap_threshold.cache_clear()
    node = helper.make_node("Relu", ["x"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    open_session(tmp_path / "m.onnx", ["CPUExecutionProvider"], 1)
    assert ort_session.pin_mmap_threshold.cache_info().currsize == 1
    assert ort_session.pin_mmap_threshold() is True
