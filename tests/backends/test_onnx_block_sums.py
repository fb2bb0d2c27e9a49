"""The offsets' block sums in the step graph: each block of K of the hidden states [B, S, K] (the
head's rows: [T, K]) times a column of ones, the same bits as the 0/1 [K, K / block] matrix they
replace, whatever the rows and wherever x lies in memory, with no such matrix in the graph."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edge_runtime.backends.onnx_export import export_step
from edge_runtime.backends.onnx_graph import step_writer
from edge_runtime.backends.onnx_spec import GraphSpec, weight_format
from edge_runtime.model.gguf_load import load_llama_gguf
from tests.model.quant_helpers import Q4_K_M_LIKE, tiny_quant_gguf

Q4_SPEC = GraphSpec(**weight_format("q4_1"))
K = 2048


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_llama_gguf(tiny_quant_gguf(tmp_path_factory.mktemp("q4_k_m"), Q4_K_M_LIKE)[1])


def _session(nodes, inits, out: str, rank: int) -> ort.InferenceSession:
    shape = ["B", "S", K][-rank:]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])


def _writers_block_sums(model, rank: int, known: bool = True) -> ort.InferenceSession:
    """The writer's block sums of x; `known`: told x's rank (else read from x's shape)."""
    writer = step_writer(model, Q4_SPEC)
    out = writer.block_sums("x", K, 32, rank=rank if known else None)
    assert writer.block_sums("x", K, 32, rank=rank if known else None) == out  # one per input, shared
    return _session(writer.g.nodes, writer.g.inits, out, rank)


def _zero_one_matmul(rank: int) -> ort.InferenceSession:
    """The block sums as graph versions up to 12 wrote them."""
    mat = np.kron(np.eye(K // 32, dtype=np.float32), np.ones((32, 1), np.float32))
    return _session([helper.make_node("MatMul", ["x", "mat"], ["y"])], [numpy_helper.from_array(mat, "mat")], "y", rank)


def _at(values: np.ndarray, shift: int) -> np.ndarray:
    """`values` copied `shift` floats past an aligned start (another address mod 16 bytes)."""
    buf = np.empty(values.size + 16, np.float32)
    buf[shift:shift + values.size] = values.ravel()
    return buf[shift:shift + values.size].reshape(values.shape)


@pytest.mark.parametrize("known", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, K), (3, 5, K), (16, 1, K), (1, 40, K), (7, K), (1, K)])
def test_block_sums_are_the_zero_one_matmuls_bits_at_any_address(model, shape, known):
    ours, before = _writers_block_sums(model, len(shape), known), _zero_one_matmul(len(shape))
    x = (np.random.default_rng(len(shape) * 100 + shape[0]).standard_normal(shape) * 3).astype(np.float32)
    want = before.run(None, {"x": x})[0]
    assert want.shape == (*shape[:-1], K // 32)
    np.testing.assert_allclose(want, x.reshape(*shape[:-1], K // 32, 32).sum(-1), rtol=1e-5, atol=1e-4)
    for shift in range(4):
        np.testing.assert_array_equal(ours.run(None, {"x": _at(x, shift)})[0], want)


def test_a_rows_block_sums_are_the_same_bits_alone_and_in_a_batch(model):
    ours = _writers_block_sums(model, 3)
    x = np.random.default_rng(7).standard_normal((16, 1, K)).astype(np.float32)
    batch = ours.run(None, {"x": x})[0]
    for rows in (1, 2, 5):
        np.testing.assert_array_equal(ours.run(None, {"x": np.ascontiguousarray(x[:rows])})[0], batch[:rows])


def test_the_exported_graph_has_no_block_sum_matrix(model, tmp_path):
    proto = onnx.load(str(export_step(model, Q4_SPEC, cache_dir=tmp_path)), load_external_data=False)
    assert any(n.name.endswith(".offsets") for n in proto.graph.initializer)  # the mix has offsets
    assert not any(n.name.startswith("block_sum_") for n in proto.graph.initializer)
    assert not any(n.op_type == "ReduceSum" for n in proto.graph.node)
    # Every float MatMul by an initializer multiplies block sums by offsets, or a block by ones.
    inits = {t.name: t for t in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type == "MatMul" and node.input[1] in inits and not node.input[1].endswith(".offsets"):
            ones = numpy_helper.to_array(inits[node.input[1]])  # small: stored in the graph itself
            assert ones.shape == (32, 1) and (ones == 1).all(), node.input[1]
