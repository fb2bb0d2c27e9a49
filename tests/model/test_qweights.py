"""QuantWeight on its own: parts of several formats stacked along N, row gathers (embeddings),
row chunks, byte counts, refusals, and the linear's forward and backward against float autograd."""

from __future__ import annotations

import pytest
import torch

from edge_runtime.model import qweights
from edge_runtime.model.qweights import Blocks, QuantWeight, quant_linear


def _blocks(n: int, k: int, bits: int, block: int, zero: int = 0, offsets: bool = True, signed: bool = False,
            seed: int = 0) -> Blocks:
    gen = torch.Generator().manual_seed(seed)
    width = block // 2 if bits == 4 else block
    if signed:
        levels = torch.randint(-128, 128, (n, k // block, width), generator=gen).to(torch.int8)
    else:
        levels = torch.randint(0, 256, (n, k // block, width), generator=gen).to(torch.uint8)
    scales = torch.rand(n, k // block, generator=gen) * 0.01
    return Blocks(levels, scales, torch.randn(n, k // block, generator=gen) * 0.01 if offsets else None, zero, bits)


def _mixed() -> QuantWeight:
    return QuantWeight([_blocks(5, 64, 4, 32), _blocks(3, 64, 4, 32, seed=1), _blocks(4, 64, 8, 16, offsets=False,
                        signed=True, seed=2), _blocks(2, 64, 4, 32, zero=8, offsets=False, seed=3)])


def test_parts_of_one_format_merge_and_the_rest_stack():
    w = _mixed()
    assert [p.n for p in w.parts] == [8, 4, 2] and w.shape == (14, 64)
    assert w.formats == [(0, 4), (0, 8), (8, 4)]
    dense = w.dequantize()
    assert torch.equal(dense, torch.cat([p.dequantize() for p in w.parts]))
    assert torch.equal(QuantWeight.cat([QuantWeight(w.parts[:1]), QuantWeight(w.parts[1:])]).dequantize(), dense)
    assert w.nbytes == sum(t.numel() * t.element_size() for p in w.parts for t in p.tensors())
    assert w.nbytes < dense.numel() * 4 / 3


def test_levels_de_quantise_as_written():
    b = _blocks(2, 32, 4, 32, zero=8, offsets=True)
    q = torch.stack((b.levels & 15, b.levels >> 4), dim=-1).reshape(2, 1, 32).float()  # even element low
    want = ((q - 8) * b.scales[..., None] + b.offsets[..., None]).reshape(2, 32)
    assert torch.equal(b.dequantize(), want)
    assert b.dequantize(torch.bfloat16).dtype == torch.bfloat16


def test_embedding_gathers_rows_across_parts():
    w = _mixed()
    ids = torch.tensor([[13, 0, 7], [8, 12, 5]])
    assert torch.equal(w.embedding(ids), w.dequantize()[ids])


def test_row_chunks_cover_every_row_once(monkeypatch):
    monkeypatch.setattr(qweights, "CHUNK_ELEMENTS", 64 * 3)
    w = _mixed()
    chunks = list(w.row_chunks())
    assert [lo for lo, _ in chunks] == [0, 3, 6, 8, 11, 12]
    assert torch.equal(torch.cat([c.dequantize() for _, c in chunks]), w.dequantize())


@pytest.mark.parametrize("chunk", [1 << 24, 64 * 5])
def test_linear_forward_and_backward_equal_float_autograd(monkeypatch, chunk):
    monkeypatch.setattr(qweights, "CHUNK_ELEMENTS", chunk)
    w = _mixed()
    dense = w.dequantize()
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(6, 64, generator=gen).requires_grad_(True)
    bias = torch.randn(14, generator=gen).requires_grad_(True)
    y = quant_linear(x, w, bias)
    x2, bias2 = x.detach().clone().requires_grad_(True), bias.detach().clone().requires_grad_(True)
    want = torch.nn.functional.linear(x2, dense, bias2)
    # A row piece's matmul may take another BLAS path than the whole weight's: an ulp or two apart
    # (unseeded, atol 1e-7 failed about 1 run in 6 with 1.8e-7).
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    grad = torch.randn(y.shape, generator=gen)
    y.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(bias.grad, bias2.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # no graph: the float weight is gone with the call
        assert not quant_linear(x, w).requires_grad


def test_malformed_blocks_are_refused():
    levels = torch.zeros(2, 1, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bits"):
        Blocks(levels, torch.zeros(2, 1), None, 0, 5)
    with pytest.raises(ValueError, match="scales"):
        Blocks(levels, torch.zeros(2, 2), None, 0, 4)
    with pytest.raises(ValueError, match="int8"):
        Blocks(levels.to(torch.int8), torch.zeros(2, 1), None, 0, 4)  # signed levels are 8-bit only
    with pytest.raises(ValueError, match="bits"):
        Blocks(levels, torch.zeros(2, 1), None, 0, 3)
    with pytest.raises(ValueError, match="high bits"):  # 6 bits of 32 elements: 8 bytes of high bits
        Blocks(levels, torch.zeros(2, 1), None, 32, 6, high=torch.zeros(2, 1, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="high bits"):
        Blocks(levels, torch.zeros(2, 1), None, 0, 4, high=torch.zeros(2, 1, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="share K"):
        QuantWeight([_blocks(2, 64, 4, 32), _blocks(2, 32, 4, 32)])


def test_packed_5_and_6_bit_parts_slice_gather_and_stack_with_the_rest():
    gen = torch.Generator().manual_seed(7)
    six = Blocks(torch.randint(0, 256, (6, 4, 8), generator=gen).to(torch.uint8), torch.rand(6, 4, generator=gen),
                 None, 32, 6, high=torch.randint(0, 256, (6, 4, 4), generator=gen).to(torch.uint8))
    five = Blocks(torch.randint(0, 256, (3, 2, 16), generator=gen).to(torch.uint8), torch.rand(3, 2, generator=gen),
                  torch.rand(3, 2, generator=gen), 0, 5, high=torch.randint(0, 256, (3, 2, 4), generator=gen).to(torch.uint8))
    assert six.block == 16 and six.k == 64 and five.block == 32 and five.k == 64
    assert six.nbytes == 6 * 4 * (8 + 4 + 4)  # 6 bits a level plus a float32 scale per 16
    w = QuantWeight([six, five, _blocks(2, 64, 4, 32)])
    assert w.formats == [(32, 6), (0, 5), (0, 4)]
    dense = w.dequantize()
    assert torch.equal(dense[:6], six.dequantize_torch()) and torch.equal(dense[6:9], five.dequantize_torch())
    assert torch.equal(w.embedding(torch.tensor([8, 0, 5, 10])), dense[[8, 0, 5, 10]])
    assert torch.equal(six.slice(1, 4).dequantize(), dense[1:4])
    wide = six.bytewise()
    assert wide.bits == 8 and wide.levels.dtype == torch.int8 and wide.zero == 0 and wide.high is None
    assert torch.equal(wide.dequantize(), dense[:6])
