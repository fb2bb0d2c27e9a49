"""The GGUF block reader against gguf-py's own de-quantisation, bit for bit, for every block type
it reads: random well-formed blocks written with gguf-py's GGUFWriter, and edge values (d = 0,
largest 6-bit scales and minimums, float16 subnormals and extremes, every level at its lowest and
highest, the 5- and 6-bit formats' high bits all set or all clear). Each is held in about the
file's own bytes."""

from __future__ import annotations

import zlib

import gguf
import numpy as np
import pytest
import torch

from edge_runtime.errors import ModelNotAvailable
from edge_runtime.model.gguf_blocks import BLOCK_TYPES, GgufBlockReader, head_order
from edge_runtime.model.qweights import QuantWeight

# Where each type keeps its float16 fields (byte offsets in a block).
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# Where each type keeps its levels (low nibbles and high bits), as a byte range of a block.
LEVEL_BYTES = {"Q4_0": slice(2, None), "Q4_1": slice(4, None), "Q5_0": slice(2, None), "Q5_1": slice(4, None),
               "Q8_0": slice(2, None), "Q4_K": slice(16, None), "Q5_K": slice(16, None), "Q6_K": slice(0, 192)}
BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8}
EDGE_F16 = np.array([0.0, -0.0, 2.0**-24, -(2.0**-24), 2.0**-14 - 2.0**-24, 6.1e-5, 1.0, -1.0, 65504.0, -65504.0,
                     0.0078125, 3.14], np.float16)


def _raw_blocks(kind: str, rows: int, k: int, rng: np.random.Generator, edges: bool = False) -> np.ndarray:
    elems, size, _ = BLOCK_TYPES[kind]
    raw = rng.integers(0, 256, (rows, k // elems, size), dtype=np.uint8)
    for offset in F16_FIELDS[kind]:
        if edges:
            values = rng.choice(EDGE_F16, raw.shape[:2])
        else:
            values = (rng.standard_normal(raw.shape[:2]) * 0.02).astype(np.float16)
        raw[..., offset:offset + 2] = values.astype(np.float16)[..., None].view(np.uint8)
    if edges and kind in ("Q4_K", "Q5_K"):
        raw[::2, :, 4:16] = 0xFF  # every 6-bit scale and minimum at 63
        raw[1::3, :, 4:16] = 0x00
    if edges:  # levels all highest, all lowest (0 or, signed, -128 and -1), and only the high bits set
        raw[2::6, :, LEVEL_BYTES[kind]] = 0xFF
        raw[3::6, :, LEVEL_BYTES[kind]] = 0x00
        raw[4::6, :, LEVEL_BYTES[kind]] = 0x80
        if kind in ("Q5_0", "Q5_1", "Q5_K", "Q6_K"):
            high = {"Q5_0": slice(2, 6), "Q5_1": slice(4, 8), "Q5_K": slice(16, 48), "Q6_K": slice(128, 192)}[kind]
            raw[5::6, :, LEVEL_BYTES[kind]] = 0x00
            raw[5::6, :, high] = 0xFF
    if edges and kind == "Q6_K":
        raw[::2, :, 192:208] = np.array([127, 128, 255, 0], np.uint8).repeat(4)  # int8 scales 127, -128, -1, 0
    return raw.reshape(rows, -1)


def _write(path, tensors: dict[str, tuple[np.ndarray, object]]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("edges", [False, True], ids=["random", "edges"])
@pytest.mark.parametrize("kind", sorted(BLOCK_TYPES))
def test_every_block_type_dequantizes_as_gguf_does(tmp_path, kind, edges):
    rng = np.random.default_rng(zlib.crc32(f"{kind}/{edges}".encode()))
    k = 512 if BLOCK_TYPES[kind][0] == 256 else 96
    rows = 37
    raw = _raw_blocks(kind, rows, k, rng, edges)
    qtype = gguf.GGMLQuantizationType[kind]
    _write(tmp_path / "t.gguf", {"w": (raw, qtype)})
    reader = GgufBlockReader(tmp_path / "t.gguf")
    assert reader.shape("w") == (rows, k) and not reader.is_float("w")
    blocks = reader.blocks("w")
    expected = gguf.quants.dequantize(reader.tensors["w"].data, qtype)
    got = QuantWeight([blocks]).dequantize().numpy()
    assert got.shape == expected.shape == (rows, k)
    np.testing.assert_array_equal(_bits(got), _bits(expected))
    # torch's passes (the reference the compiled kernel is held to) and the byte-per-level form
    # the ONNX graph takes give the same bits.
    np.testing.assert_array_equal(_bits(blocks.dequantize_torch().numpy()), _bits(expected))
    np.testing.assert_array_equal(_bits(blocks.bytewise().dequantize_torch().numpy()), _bits(expected))
    # Levels below 8 bits stay packed (low nibbles two to a byte, the high bits beside them): the
    # blocks take at most the file's bytes plus a byte per K-quant sub-block's minimum.
    assert blocks.bits == BITS[kind]
    assert blocks.block == (16 if kind == "Q6_K" else 32)
    assert (blocks.levels.dtype == torch.int8) == (kind == "Q8_0")
    assert (blocks.high is not None) == (BITS[kind] in (5, 6))
    assert raw.nbytes <= blocks.nbytes <= raw.nbytes * 1.03


def test_row_chunks_join_exactly(tmp_path, monkeypatch):
    from edge_runtime.model import gguf_blocks

    monkeypatch.setattr(gguf_blocks, "ROW_CHUNK", 5)
    rng = np.random.default_rng(3)
    raw = _raw_blocks("Q4_K", 23, 256, rng)
    _write(tmp_path / "t.gguf", {"w": (raw, gguf.GGMLQuantizationType.Q4_K)})
    reader = GgufBlockReader(tmp_path / "t.gguf")
    expected = gguf.quants.dequantize(reader.tensors["w"].data, gguf.GGMLQuantizationType.Q4_K)
    np.testing.assert_array_equal(_bits(reader.blocks("w").dequantize().numpy()), _bits(expected))


def test_float_tensors(tmp_path):
    rng = np.random.default_rng(4)
    f32 = rng.standard_normal((3, 8)).astype(np.float32)
    f16 = rng.standard_normal(16).astype(np.float16)
    bf16 = gguf.quants.quantize(rng.standard_normal((4, 6)).astype(np.float32), gguf.GGMLQuantizationType.BF16)
    _write(tmp_path / "t.gguf", {"a": (f32, None), "b": (f16, None), "c": (bf16, gguf.GGMLQuantizationType.BF16)})
    reader = GgufBlockReader(tmp_path / "t.gguf")
    assert all(reader.is_float(n) for n in "abc")
    np.testing.assert_array_equal(reader.float("a").numpy(), f32)
    np.testing.assert_array_equal(reader.float("b").numpy(), f16.astype(np.float32))
    expected_c = gguf.quants.dequantize(reader.tensors["c"].data, gguf.GGMLQuantizationType.BF16)
    np.testing.assert_array_equal(_bits(reader.float("c").numpy()), _bits(expected_c))
    assert reader.float("c").shape == (4, 6)


def test_unsupported_type_is_refused_by_name(tmp_path):
    rng = np.random.default_rng(5)
    elems, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q2_K]
    raw = rng.integers(0, 256, (2, size), dtype=np.uint8)
    raw[:, -4:] = 0  # d and dmin: zero, finite
    _write(tmp_path / "t.gguf", {"w": (raw, gguf.GGMLQuantizationType.Q2_K)})
    with pytest.raises(ModelNotAvailable, match="Q2_K"):
        GgufBlockReader(tmp_path / "t.gguf").blocks("w")
    with pytest.raises(ModelNotAvailable, match="no tensor"):
        GgufBlockReader(tmp_path / "t.gguf").blocks("nope")


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_head_order_undoes_llama_cpp_permutation_as_transformers_does(heads, kv_heads):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    head_dim = 8
    processor = LlamaTensorProcessor({"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    for name, n in ((".attn_q.", heads), (".attn_k.", kv_heads)):
        stored = np.arange(n * head_dim * 3, dtype=np.float32).reshape(n * head_dim, 3)
        expected = processor.process(stored, f"blk.0{name}weight").weights
        np.testing.assert_array_equal(stored[head_order(n * head_dim, n).numpy()], expected)


def test_blocks_reader_permutes_rows_of_q(tmp_path):
    rng = np.random.default_rng(6)
    raw = _raw_blocks("Q6_K", 16, 256, rng)
    _write(tmp_path / "t.gguf", {"w": (raw, gguf.GGMLQuantizationType.Q6_K)})
    reader = GgufBlockReader(tmp_path / "t.gguf")
    plain = reader.blocks("w").dequantize()
    assert torch.equal(reader.blocks("w", heads=2).dequantize(), plain[head_order(16, 2)])
