"""gguf_kernel: de-quantisation bit for bit against gguf's numpy code and block matmuls against
x @ dequantize(W).T, for every supported type, on the compiled path and the reference path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from edge_runtime.model import gguf_kernel

Q = GGMLQuantizationType
TYPES = sorted(gguf_kernel.SUPPORTED, key=lambda t: t.value)
# Where the scale fields (fp16) lie in a block of the types gguf's numpy code cannot quantise.
_HALF_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def make_blocks(qtype: GGMLQuantizationType, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, row_bytes]: random weights quantised by gguf where it can, else random bytes with
    finite, moderate fp16 scales."""
    rng = np.random.default_rng(seed)
    if qtype not in _HALF_FIELDS:
        data = rng.standard_normal((n, k)).astype(np.float32)
        out = gguf_quants.quantize(data, qtype)
        return torch.from_numpy(np.ascontiguousarray(out).view(np.uint8).reshape(n, -1).copy())
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in _HALF_FIELDS[qtype]:
        raw[..., at:at + 2] = (rng.uniform(-0.05, 0.05, (n, k // block)).astype(np.float16)
                               .view(np.uint8).reshape(n, k // block, 2))
    return torch.from_numpy(raw.reshape(n, -1))


def reference(raw: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(raw.numpy(), qtype)))


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Float32 summation-order error allowed for x @ w.T: 2 k eps (|x| @ |w|^T), the classic bound
    for a dot product of length k summed in any order (plus the few ulps of factored scales)."""
    k = x.shape[1]
    return 2 * k * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double().T) + 1e-30


@pytest.fixture(params=["compiled", "reference"])
def path(request, monkeypatch):
    if request.param == "reference":
        monkeypatch.setenv(gguf_kernel.ENV, "off")
        assert not gguf_kernel.available()
    elif not gguf_kernel.available():
        pytest.skip("the compiled GGUF kernels are not available here")
    return request.param


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_is_bit_exact(qtype, path):
    k = 2 * GGML_QUANT_SIZES[qtype][0] if qtype in _HALF_FIELDS else 256
    for n, kk in ((1, GGML_QUANT_SIZES[qtype][0] if qtype in _HALF_FIELDS else 32), (7, k)):
        raw = make_blocks(qtype, n, kk, seed=n)
        got = gguf_kernel.dequantize(raw, qtype, kk)
        want = reference(raw, qtype)
        assert got.shape == (n, kk)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_matmul_matches_reference(qtype, m, path):
    block = GGML_QUANT_SIZES[qtype][0]
    k = 512 if block == 256 else 96
    for n in (1, 37):
        raw = make_blocks(qtype, n, k, seed=m + n)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
        w = reference(raw, qtype)
        got = gguf_kernel.matmul(x, raw, qtype, k)
        want = (x.double() @ w.double().T).float()
        assert got.shape == (m, n)
        assert ((got.double() - want.double()).abs() <= _bound(x, w)).all()
        back = gguf_kernel.matmul_back(got, raw, qtype, k)
        assert back.shape == (m, k)
        assert ((back.double() - got.double() @ w.double()).abs()
                <= 2 * n * torch.finfo(torch.float32).eps * (got.abs().double() @ w.abs().double()) + 1e-30).all()


def test_one_block_rows_and_out(path):
    raw = make_blocks(Q.Q4_K, 5, 256)
    out = torch.full((1, 5), float("nan"))
    x = torch.randn(1, 256)
    assert gguf_kernel.matmul(x, raw, Q.Q4_K, 256, out=out) is out
    w = reference(raw, Q.Q4_K)
    assert ((out.double() - x.double() @ w.double().T).abs() <= _bound(x, w)).all()


def test_linear_backward_flows_to_x(path):
    raw = make_blocks(Q.Q8_0, 16, 64)
    w = reference(raw, Q.Q8_0)
    x = torch.randn(2, 3, 64, requires_grad=True)
    y = gguf_kernel.linear(x, raw, Q.Q8_0, 64)
    assert y.shape == (2, 3, 16)
    y.square().sum().backward()
    want = (2 * (x.detach().reshape(-1, 64) @ w.T)) @ w
    torch.testing.assert_close(x.grad.reshape(-1, 64), want, rtol=1e-4, atol=1e-4)


def test_wrong_sizes_are_typed_errors():
    raw = make_blocks(Q.Q6_K, 2, 256)
    with pytest.raises(gguf_kernel.GGUFKernelError):
        gguf_kernel.dequantize(raw[:, :-1].contiguous(), Q.Q6_K, 256)
    with pytest.raises(gguf_kernel.GGUFKernelError):
        gguf_kernel.row_bytes(Q.Q4_K, 100)
    with pytest.raises(gguf_kernel.GGUFKernelError):
        gguf_kernel.matmul(torch.randn(1, 128), raw, Q.Q6_K, 256)
    with pytest.raises(gguf_kernel.GGUFKernelError):
        gguf_kernel.row_bytes(Q.IQ2_XXS, 256)
    assert gguf_kernel.row_bytes(Q.Q4_K, 512) == 288
    assert gguf_kernel.row_bytes(Q.Q8_0, 64) == 68
