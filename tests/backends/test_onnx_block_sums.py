"""The offsets' block sums in the step graph: a reduction over each block of K of the hidden
states [B, S, K] (the head's rows: [T, K]), with no 0/1 matrix for ONNX Runtime to pack per node and read every step."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edge_runtime.backends.onnx_export import export_step
from edge_runtime.backends.onnx_graph import step_writer
from edge_runtime.backends.onnx_spec import GraphSpec, weight_format
from edge_runtime.model.gguf_load import load_llama_gguf
from tests.model.quant_helpers import Q4_K_M_LIKE, tiny_quant_gguf

Q4_SPEC = GraphSpec(**weight_format("q4_1"))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_llama_gguf(tiny_quant_gguf(tmp_path_factory.mktemp("q4_k_m"), Q4_K_M_LIKE)[1])


@pytest.mark.parametrize("shape", [(1, 1, 256), (3, 5, 256), (7, 256)])
def test_block_sums_are_each_blocks_sum(model, shape):
    writer = step_writer(model, Q4_SPEC)
    out = writer.block_sums("x", 256, 32, rank=len(shape))
    assert writer.block_sums("x", 256, 32, rank=len(shape)) == out  # one reduction per input, shared by its linears
    graph = helper.make_graph(writer.g.nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], writer.g.inits)
    proto = helper.make_model(graph, opset_imports=writer.opsets(), ir_version=10)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    got = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, x.reshape(*shape[:-1], 8, 32).sum(-1), rtol=1e-6, atol=1e-5)


def test_the_exported_graph_has_no_block_sum_matrix(model, tmp_path):
    proto = onnx.load(str(export_step(model, Q4_SPEC, cache_dir=tmp_path)), load_external_data=False)
    assert any(n.name.endswith(".offsets") for n in proto.graph.initializer)  # the mix has offsets
    assert not any(n.name.startswith("block_sum_") for n in proto.graph.initializer)
    # Every float MatMul left multiplies block sums by offsets: its weight is an offsets tensor.
    inits = {t.name for t in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type == "MatMul" and node.input[1] in inits:
            assert node.input[1].endswith(".offsets"), node.input[1]
