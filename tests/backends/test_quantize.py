"""Weight-only quantisation: the packed blocks are laid out as ONNX Runtime's MatMulNBits reads
them (a one-node graph multiplies exactly by our dequantised weight), and the block grids keep
their promised error bounds."""

from __future__ import annotations

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from edge_runtime.backends.quantize import (  # noqa: E402
    dequantize_nbits,
    dequantize_q4_offsets,
    pack_nbits,
    pack_q4_offsets,
)


def _matmul_nbits(x: np.ndarray, q, accuracy_level: int = 0) -> np.ndarray:
    inits = [numpy_helper.from_array(q.packed, "B"), numpy_helper.from_array(q.scales, "S")]
    inputs = ["x", "B", "S"]
    if q.zero_points is not None:
        inits.append(numpy_helper.from_array(q.zero_points, "Z"))
        inputs.append("Z")
    node = helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=q.k, N=q.n, bits=q.bits,
                            block_size=q.block_size, accuracy_level=accuracy_level)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("bits,symmetric", [(4, False), (4, True), (8, True)])
def test_matmul_nbits_multiplies_by_our_dequantized_weight(bits, symmetric):
    rng = np.random.default_rng(bits)
    weight = rng.standard_normal((48, 96)).astype(np.float32) * 0.1
    x = rng.standard_normal((3, 96)).astype(np.float32)
    q = pack_nbits(weight, bits, symmetric=symmetric)
    expected = x @ dequantize_nbits(q).T
    np.testing.assert_allclose(_matmul_nbits(x, q), expected, rtol=1e-4, atol=1e-4)
    # the grid's error bound: half a step of the block's scale
    step = q.scales.reshape(48, -1).repeat(q.block_size, axis=1)
    assert np.all(np.abs(dequantize_nbits(q) - weight) <= step / 2 + 1e-6)


def test_eight_bit_symmetric_blocks_reproduce_a_q8_0_grid_exactly():
    rng = np.random.default_rng(0)
    scales = rng.random((16, 2), dtype=np.float32) * 0.01 + 1e-3
    levels = rng.integers(-127, 128, (16, 2, 32))
    levels[:, :, 0] = 127  # Q8_0 blocks reach +-127 by construction
    weight = (levels * scales[..., None]).astype(np.float32).reshape(16, 64)
    q = pack_nbits(weight, 8, symmetric=True)
    np.testing.assert_allclose(dequantize_nbits(q), weight, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bits,symmetric,k", [(4, False, 96), (4, False, 160), (4, True, 96), (8, True, 96)])
def test_gather_block_quantized_reads_our_tied_table_like_matmul_nbits(bits, symmetric, k):
    """The tied embedding / LM head is one packed table: GatherBlockQuantized (embedding rows,
    zero points as [rows, packed blocks]) and MatMulNBits (the head, the same zero points flat)
    must both read our dequantised weight, an odd number of blocks per row included."""
    rng = np.random.default_rng(k + bits)
    table = rng.standard_normal((40, k)).astype(np.float32) * 0.05
    q = pack_nbits(table, bits, symmetric=symmetric)
    inits = [numpy_helper.from_array(q.packed.reshape(q.n, q.k * bits // 8), "T"),
             numpy_helper.from_array(q.scales.reshape(q.n, -1), "S")]
    inputs = ["T", "ids", "S"]
    if q.zero_points is not None:
        inits.append(numpy_helper.from_array(q.zero_points.reshape(q.n, -1), "Z"))
        inputs.append("Z")
    node = helper.make_node("GatherBlockQuantized", inputs, ["rows"], domain="com.microsoft", bits=bits,
                            block_size=q.block_size, gather_axis=0, quantize_axis=1)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
                              [helper.make_tensor_value_info("rows", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.array([0, 7, 39, 7], np.int64)
    np.testing.assert_allclose(session.run(None, {"ids": ids})[0], dequantize_nbits(q)[ids], rtol=1e-6, atol=1e-7)
    x = rng.standard_normal((2, k)).astype(np.float32)
    np.testing.assert_allclose(_matmul_nbits(x, q), x @ dequantize_nbits(q).T, rtol=1e-4, atol=1e-4)


def _q4_1_grid(n: int, k: int, seed: int = 0) -> np.ndarray:
    """A weight as a Q4_1 GGUF holds it after de-quantising: d * q + m per block of 32, with d
    and m in float16 and each block reaching q = 0 and q = 15 (llama.cpp's min/max blocks)."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (n, k // 32, 32))
    q[..., 3], q[..., 17] = 0, 15
    d = (rng.random((n, k // 32)) * 0.02 + 1e-4).astype(np.float16).astype(np.float32)
    m = (-rng.random((n, k // 32)) * 0.15).astype(np.float16).astype(np.float32)
    return (d[..., None] * q + m[..., None]).reshape(n, k).astype(np.float32)


def test_offset_blocks_recover_a_q4_1_grid_exactly_and_bound_any_other_weight():
    weight = _q4_1_grid(24, 128)
    np.testing.assert_array_equal(dequantize_q4_offsets(pack_q4_offsets(weight)), weight)
    rng = np.random.default_rng(1)
    other = rng.standard_normal((24, 128)).astype(np.float32)
    packed = pack_q4_offsets(other)
    step = packed.nbits.scales.reshape(24, -1).repeat(32, axis=1)
    assert np.all(np.abs(dequantize_q4_offsets(packed) - other) <= step / 2 + 1e-6)
    # zero-range blocks (a bias-like constant row) are held exactly too
    flat = np.full((2, 64), 0.25, np.float32)
    np.testing.assert_array_equal(dequantize_q4_offsets(pack_q4_offsets(flat)), flat)


@pytest.mark.parametrize("flavour", ["ort", "standard"])
@pytest.mark.parametrize("shape", [(5, 96), (2, 3, 96)])
def test_the_graphs_offset_linear_multiplies_by_the_q4_1_weight(tiny_model_dir, flavour, shape):
    """What the q4_1 format writes for a linear (the 4-bit product plus block sums times the
    offsets; a 2-D token batch and a 3-D [rows, tokens] one) equals x @ W^T for W on a Q4_1
    grid, with float activations (accuracy level 0)."""
    import torch

    from edge_runtime.backends.onnx_graph import step_writer
    from edge_runtime.backends.onnx_spec import GraphSpec
    from edge_runtime.model.config import ModelConfig
    from edge_runtime.model.llama import LlamaModel

    with torch.device("meta"):
        shell = LlamaModel(ModelConfig.from_dir(tiny_model_dir))
    writer = step_writer(shell, GraphSpec(quantization="int4", offsets=True, flavour=flavour,
                                                                accuracy_level=0))
    weight = _q4_1_grid(40, 96, seed=2)
    y = writer.linear("x", torch.from_numpy(weight), None, "proj")
    y2 = writer.linear("x", torch.from_numpy(weight[::-1].copy()), None, "proj2")  # shares x's block sums
    graph = helper.make_graph(writer.g.nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in (y, y2)],
                              writer.g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    options = ort.SessionOptions()  # ONNX Runtime would fuse DequantizeLinear + MatMul into an
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # int8-activation MatMulNBits
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    got, got2 = session.run(None, {"x": x})
    np.testing.assert_allclose(got, x @ weight.T, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got2, x @ weight[::-1].T, rtol=1e-4, atol=1e-4)
    ones = writer.g.const([[1.0]] * 32, np.float32)  # each block of x times a column of ones
    assert sum(node.op_type == "MatMul" and node.input[1] == ones for node in writer.g.nodes) == 1  # shared
