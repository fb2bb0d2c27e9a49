"""The q4_1 graph of a model held as a GGUF's blocks is written from the blocks as they are: its
MatMulNBits initialisers (levels, scales, zero points, offsets) de-quantise to exactly the
blocks' own `dequantize()` (Q4_1/Q4_K's centred offsets within their one float32 rounding), the
embedding's in-graph de-quantisation is exact, and the graph's logits are the torch block
model's with float activations and within the self-check's q4_1 tolerance with int8 ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

ort = pytest.importorskip("onnxruntime")

import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from edge_runtime import Engine  # noqa: E402
from edge_runtime.backends import onnx_spec  # noqa: E402
from edge_runtime.backends.auto import SELF_CHECK_TOLERANCE  # noqa: E402
from edge_runtime.backends.onnx_blocks import block_parts  # noqa: E402
from edge_runtime.backends.onnx_export import export_step  # noqa: E402
from edge_runtime.backends.onnx_graph import step_writer  # noqa: E402
from edge_runtime.backends.onnx_spec import GraphSpec, weight_format  # noqa: E402
from edge_runtime.backends.onnxruntime_backend import OnnxRuntimeBackend  # noqa: E402
from edge_runtime.backends.quantize import NBitsWeight, dequantize_nbits  # noqa: E402
from edge_runtime.model.dense import dense_logits  # noqa: E402
from edge_runtime.model.gguf_load import load_llama_gguf  # noqa: E402
from edge_runtime.model.qweights import QuantWeight  # noqa: E402
from tests.model.quant_helpers import Q4_K_M_LIKE, tiny_quant_gguf  # noqa: E402

Q4_SPEC = GraphSpec(**weight_format("q4_1"))
# llama.cpp's older types, which gguf-py quantises from the tiny model's own weights; a 4-bit
# table with offsets (Q4_1) exercises the tied head's block-sum product.
LEGACY = {"token_embd.weight": "Q4_1", "attn_q.weight": "Q4_0", "attn_k.weight": "Q4_1", "attn_v.weight": "Q5_0",
          "attn_output.weight": "Q5_1", "ffn_gate.weight": "Q4_0", "ffn_up.weight": "Q4_1", "ffn_down.weight": "Q8_0"}
MIXES = {"q4_k_m": (Q4_K_M_LIKE, False), "q8_0_tied": ({}, True), "legacy_tied": (LEGACY, True)}


@pytest.fixture(scope="module", params=list(MIXES))
def gguf(request, tmp_path_factory):
    types, tie = MIXES[request.param]
    return tiny_quant_gguf(tmp_path_factory.mktemp(request.param), types, tie=tie)


def _linear_weights(model) -> dict[str, QuantWeight]:
    out = {"lm_head": model.lm_head_weight()}
    for i, layer in enumerate(model.layers):
        for site in ("qkv", "o", "gate_up", "down"):
            out[f"layers.{i}.{site}"] = getattr(layer, f"{site}_weight")
    return out


def _dequantized(parts) -> np.ndarray:
    out = []
    for part in parts:
        w = dequantize_nbits(part.nbits)
        if part.offsets is not None:
            w = (w.reshape(part.nbits.n, part.blocks, -1) + part.offsets[..., None]).reshape(w.shape)
        out.append(w)
    return np.concatenate(out)


def test_block_parts_de_quantise_exactly(gguf):
    model = load_llama_gguf(gguf[1])
    for name, weight in [*_linear_weights(model).items(), ("embed", model.embed)]:
        want = weight.dequantize().numpy()
        np.testing.assert_array_equal(_dequantized(block_parts(weight, centre=False)), want, err_msg=name)
        centred = block_parts(weight)
        for exact, part in zip(block_parts(weight, centre=False), centred, strict=True):
            np.testing.assert_array_equal(part.nbits.packed, exact.nbits.packed)
            np.testing.assert_array_equal(part.nbits.scales, exact.nbits.scales)
        # the centred offset's one rounding, then the add's: within two ulps of the larger term
        largest = max([np.abs(want).max()] + [np.abs(p.offsets).max() for p in centred if p.offsets is not None])
        bound = 2 * np.spacing(np.float32(largest))
        np.testing.assert_allclose(_dequantized(centred), want, rtol=0, atol=bound, err_msg=name)


def test_exported_matmulnbits_initialisers_are_the_blocks(gguf, tmp_path):
    model = load_llama_gguf(gguf[1])
    proto = onnx.load(str(export_step(model, Q4_SPEC, cache_dir=tmp_path)))  # external data read back
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    assert not any(n.op_type in ("GatherBlockQuantized", "DequantizeLinear") for n in proto.graph.node)
    pieces: dict[str, list[np.ndarray]] = {}
    for node in proto.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        tag = node.input[1].removesuffix(".qweight")
        name = "lm_head" if tag == "embed" else tag.split(".part")[0]
        zero_points = inits[node.input[3]] if len(node.input) > 3 else None
        q = NBitsWeight(inits[node.input[1]], inits[node.input[2]].reshape(-1), zero_points,
                        attrs["N"], attrs["K"], attrs["bits"], attrs["block_size"])
        w = dequantize_nbits(q)
        offsets = inits.get("lm_head.offsets" if tag == "embed" else f"{tag}.offsets")
        if offsets is not None:
            w = (w.reshape(q.n, q.k // q.block_size, -1) + offsets.T[..., None]).reshape(w.shape)
        pieces.setdefault(name, []).append(w)
    weights = _linear_weights(model)
    assert pieces.keys() == weights.keys()
    for name, weight in weights.items():  # exactly the blocks' own (centred where that applies)
        np.testing.assert_array_equal(np.concatenate(pieces[name]), _dequantized(block_parts(weight)), err_msg=name)


def test_the_embedding_is_de_quantised_in_the_graph_exactly(gguf):
    model = load_llama_gguf(gguf[1])
    for flavour in ("ort", "standard"):
        writer = step_writer(model, GraphSpec(**weight_format("q4_1"), flavour=flavour))
        out = writer.embedding("ids")
        graph = helper.make_graph(writer.g.nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 7])],
                                  [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], writer.g.inits)
        proto = helper.make_model(graph, opset_imports=writer.opsets(), ir_version=10)
        ids = np.array([[0, 5, 17, 300, 5, 2, model.cfg.vocab_size - 1]], np.int64)
        got = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0]
        np.testing.assert_array_equal(got, model.embed.embedding(torch.from_numpy(ids)).numpy())


@pytest.mark.parametrize("flavour", ["ort", "standard"])
def test_graph_logits_match_the_torch_block_model(gguf, tmp_path, flavour, monkeypatch):
    folder, path = gguf
    engine = Engine.load(str(folder), dtype="float32", kv_cache_bytes=4 << 20, device="cpu")  # its KV cache
    model = load_llama_gguf(path)
    ids = torch.randint(3, 300, (23,), generator=torch.Generator().manual_seed(0))
    want = dense_logits(model, ids[None])[0]
    spread = (want.max(-1).values - want.min(-1).values)[:, None]

    def error(accuracy_level: int) -> tuple[float, float]:
        monkeypatch.setitem(onnx_spec.WEIGHT_FORMATS, "q4_1", {**weight_format("q4_1"), "accuracy_level": accuracy_level})
        backend = OnnxRuntimeBackend(model, engine.cache, None, quantization="q4_1", flavour=flavour,
                                     cache_dir=tmp_path)
        got = backend.score(ids.tolist())
        return ((got - want).abs() / spread).max().item(), (got.argmax(-1) == want.argmax(-1)).float().mean().item()

    if flavour == "ort":  # float activations (the standard graph's DequantizeLinear is fused into
        assert error(0)[0] < 1e-4  # int8-activation MatMulNBits by ONNX Runtime's optimiser)
    relative, agree = error(4)
    # The K-quant mix's random blocks (`random_k_blocks`) lean one way (all-positive weights), so
    # each output is mostly the input's sum, which int8 activations round; real weights do not.
    tolerance = 0.15 if gguf[1].parent.parent.name.startswith("q4_k_m") else SELF_CHECK_TOLERANCE["q4_1"]
    assert relative <= tolerance and agree >= 0.9, (relative, agree)


@pytest.mark.parametrize("fmt,flavour", [("q4_1", "ort"), ("int8", "standard"), ("none", "ort")])
def test_streamed_export_is_byte_for_byte_onnx_save_model(tiny_model_dir, tmp_path, fmt, flavour):
    """The export writes each initializer to the data file as it is made; the files are what
    saving the whole graph at the end with onnx.save_model's external data gave (float models'
    exports did not change)."""
    from edge_runtime.backends.onnx_graph import build_step_graph

    model = Engine.load(str(tiny_model_dir), dtype="float32", device="cpu").model
    spec = GraphSpec(**weight_format(fmt), flavour=flavour)
    path = export_step(model, spec, cache_dir=tmp_path / "streamed")
    whole = tmp_path / "whole"
    whole.mkdir()
    onnx.save_model(build_step_graph(model, spec), str(whole / "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=1024)
    for name in ("model.onnx", "model.onnx.data"):
        assert (path.parent / name).read_bytes() == (whole / name).read_bytes(), name
