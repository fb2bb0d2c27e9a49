"""The Triton kernels over quantised blocks (`qweights_cuda`): on a GPU the compiled kernels, on a
CPU Triton's interpreter over CPU tensors (the same kernel source, run by numpy), against
`Blocks.dequantize` and a float64 matmul; and the `QuantWeight` paths that route to them
(linear, backward, embedding, a whole model's forward), and their fallback."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (the GPU kernels' tests need it, or its CPU interpreter)",
                allow_module_level=True)
if not CUDA:
    # Before the kernels' module is imported: `triton.jit` picks the interpreter then.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from edge_runtime.model import qweights, qweights_cuda  # noqa: E402
from edge_runtime.model.qweights import Blocks, QuantWeight, quant_linear  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
GPU_KERNELS = qweights.gpu_kernels  # the real routing, before any test patches it


def q4_k(n: int, k: int, seed: int = 0) -> Blocks:
    """Q4_K's layout: blocks of 32, a float16 scale and offset per 256 times 6-bit steps."""
    gen = torch.Generator().manual_seed(seed)
    nb = k // 32
    return Blocks(levels=torch.randint(0, 256, (n, nb, 16), generator=gen).to(torch.uint8),
                  scales=(torch.rand(n, nb // 8, generator=gen) * 0.01).half(),
                  scale_steps=torch.randint(0, 64, (n, nb), generator=gen).to(torch.uint8),
                  offsets=-(torch.rand(n, nb // 8, generator=gen) * 0.01).half(),
                  offset_steps=torch.randint(0, 64, (n, nb), generator=gen).to(torch.uint8), zero=0, bits=4)


def q6_k(n: int, k: int, seed: int = 0) -> Blocks:
    """Q6_K's: blocks of 16, 2 high bits each, a float16 scale per 256 times signed steps, zero 32."""
    gen = torch.Generator().manual_seed(seed)
    nb = k // 16
    return Blocks(levels=torch.randint(0, 256, (n, nb, 8), generator=gen).to(torch.uint8),
                  high=torch.randint(0, 256, (n, nb, 4), generator=gen).to(torch.uint8),
                  scales=(torch.rand(n, nb // 16, generator=gen) * 0.001).half(),
                  scale_steps=torch.randint(-128, 128, (n, nb), generator=gen).to(torch.int8),
                  offsets=None, zero=32, bits=6)


def q8_0(n: int, k: int, seed: int = 0) -> Blocks:
    """Q8_0's: signed bytes, a float16 scale per 32."""
    gen = torch.Generator().manual_seed(seed)
    nb = k // 32
    return Blocks(levels=torch.randint(-128, 128, (n, nb, 32), generator=gen).to(torch.int8),
                  scales=(torch.rand(n, nb, generator=gen) * 0.01).half(), offsets=None, zero=0, bits=8)


def q5_1(n: int, k: int, seed: int = 0) -> Blocks:
    """A 5-bit format with plain (not factored) float32 scales and offsets, as Q5_1 is kept."""
    gen = torch.Generator().manual_seed(seed)
    nb = k // 32
    return Blocks(levels=torch.randint(0, 256, (n, nb, 16), generator=gen).to(torch.uint8),
                  high=torch.randint(0, 256, (n, nb, 4), generator=gen).to(torch.uint8),
                  scales=torch.rand(n, nb, generator=gen) * 0.01, offsets=torch.randn(n, nb, generator=gen) * 0.01,
                  zero=0, bits=5)


FORMATS = {"q4_k": (q4_k, 512), "q6_k": (q6_k, 256), "q8_0": (q8_0, 160), "q5_1": (q5_1, 96)}


def _on(part: Blocks) -> Blocks:
    return part.to(DEVICE)


@pytest.fixture
def kernels_here(monkeypatch):
    """QuantWeight routes to the kernels for tensors on this test's device (the CPU: interpreted)."""
    monkeypatch.setattr(qweights, "gpu_kernels", lambda t: qweights_cuda)
    monkeypatch.setattr(qweights_cuda, "_broken", None)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_dequantize_kernel_equals_blocks_dequantize_bit_for_bit(name):
    make, k = FORMATS[name]
    part = make(37, k)
    want = part.dequantize_torch()
    got = qweights_cuda.dequantize(_on(part), torch.float32).cpu()
    assert torch.equal(got, want)
    assert torch.equal(qweights_cuda.dequantize(_on(part), torch.bfloat16).cpu(), _bfloat16(want))
    index = torch.tensor([36, 0, 5, 5, 17])
    assert torch.equal(qweights_cuda.dequantize(_on(part), torch.float32, index.to(DEVICE)).cpu(), want[index])
    # Into a caller's buffer (the thread's workspace on a GPU): the same values, in its storage.
    buf = torch.full((part.n * part.k + 7,), float("nan"), device=DEVICE)
    into = qweights_cuda.dequantize(_on(part), torch.float32, out=buf)
    assert into.data_ptr() == buf.data_ptr() and torch.equal(into.cpu(), want)


def _bfloat16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 as the kernel's cast does: round to nearest even on a GPU; Triton's
    interpreter (numpy, which has no bfloat16) truncates instead."""
    if CUDA:
        return x.to(torch.bfloat16)
    return (x.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 16])
def test_matmul_kernel_against_float64(name, rows):
    """float32 rows: within 1e-5 of the float64 product's scale (the sums' float32 rounding);
    bfloat16 rows: W's values round to bfloat16 in the tile (as de-quantising to bfloat16 does),
    the output to bfloat16: within 2^-7 of the scale."""
    make, k = FORMATS[name]
    part = make(37, k, seed=rows)  # N odd; K (96, 160) not a multiple of the K tile for 32-blocks
    w = part.dequantize_torch()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(37, generator=gen) * 0.01
    for dtype, bound in ((torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)):
        xd = x.to(dtype)
        y = qweights_cuda.linear([_on(part)], xd.to(DEVICE), bias.to(DEVICE, dtype))
        assert y is not None and y.dtype == dtype and y.shape == (rows, 37)
        ref = _reference(xd, w, bias.to(dtype))
        scale = (xd.double().abs() @ w.double().abs().T).max()
        assert (y.cpu().double() - ref).abs().max() <= bound * scale, (dtype, name, rows)


@pytest.mark.parametrize("name,split", [("q4_k", 2), ("q6_k", 3), ("q8_0", 3)])
def test_k_split_over_programs_sums_in_order(name, split):
    """K cut between programs (small N on a big GPU), the float32 partial sums added by a second
    kernel in a fixed order: within the same bound, and the same bits on every run."""
    make, _ = FORMATS[name]
    part = make(37, 256 * 5, seed=split)
    w = part.dequantize_torch()
    x = torch.randn(3, 256 * 5, generator=torch.Generator().manual_seed(split))
    bias = torch.randn(37)
    outs = []
    for _ in range(2):
        out = torch.empty(3, 40, device=DEVICE)
        qweights_cuda.matmul_into(x.to(DEVICE), _on(part), out[:, 2:39], bias.to(DEVICE), split=split)
        outs.append(out[:, 2:39].cpu())
    ref = _reference(x, w, bias)
    assert (outs[0].double() - ref).abs().max() <= 1e-5 * (x.double().abs() @ w.double().abs().T).max()
    assert torch.equal(outs[0], outs[1])


def test_more_rows_than_the_kernel_tile_are_left_to_the_caller():
    part = _on(q4_k(8, 256))
    assert qweights_cuda.linear([part], torch.randn(17, 256, device=DEVICE), None) is None
    assert qweights_cuda.linear([part], torch.randn(2, 256, device=DEVICE, dtype=torch.float64), None) is None


def _stacked() -> QuantWeight:
    """q|k|v of a Q4_K_M layer: formats mixed along N (Q4_K, Q6_K, Q4_K again, Q8_0)."""
    return QuantWeight([q4_k(9, 256), q6_k(5, 256, seed=1), q4_k(3, 256, seed=2), q8_0(7, 256, seed=3)])


@pytest.mark.parametrize("rows", [1, 2, 17])
def test_stacked_parts_with_bias_forward_and_backward(kernels_here, rows):
    """QuantWeight's linear on the kernels (17 rows: de-quantised by the kernel, then torch's
    GEMM) equals its CPU path; the gradient w.r.t. x reads the same blocks."""
    cpu = _stacked()
    w = cpu.to(DEVICE)
    assert w.formats == [(0, 4), (32, 6), (0, 4), (0, 8)]
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=gen)
    bias = torch.randn(24, generator=gen) * 0.01
    dense = cpu.dequantize().double()
    xg = x.clone().to(DEVICE).requires_grad_(True)
    y = quant_linear(xg, w, bias.to(DEVICE))
    ref = _reference(x, cpu.dequantize(), bias)
    scale = (x.double().abs() @ dense.abs().T).max()
    assert (y.detach().cpu().double() - ref).abs().max() <= 1e-5 * scale
    grad = torch.randn(rows, 24, generator=gen)
    y.backward(grad.to(DEVICE))
    want = grad.double() @ dense
    assert (xg.grad.cpu().double() - want).abs().max() <= 1e-5 * (grad.double().abs() @ dense.abs()).max()


def test_embedding_reads_rows_across_parts_without_a_host_sync(kernels_here):
    w = _stacked().to(DEVICE)
    dense = _stacked().dequantize()
    ids = torch.tensor([[23, 0, 9], [13, 14, 16]])
    got = w.embedding(ids.to(DEVICE), torch.float32)
    assert got.shape == (2, 3, 256) and torch.equal(got.cpu(), dense[ids])
    assert torch.equal(w.embedding(ids.to(DEVICE), torch.bfloat16).cpu(), _bfloat16(dense[ids]))


def test_a_failing_kernel_switches_to_torch_and_says_so(kernels_here, monkeypatch, caplog):
    def broken(*_args, **_kwargs):
        raise RuntimeError("planted compile failure")

    monkeypatch.setattr(qweights_cuda, "matmul_into", broken)
    w = _stacked().to(DEVICE)
    x = torch.randn(2, 256, device=DEVICE)
    with caplog.at_level("WARNING", logger="edge_runtime.model.qweights_cuda"):
        assert quant_linear(x, w).shape == (2, 24)  # served by de-quantising
    assert "planted compile failure" in caplog.text and qweights_cuda.unavailable() is not None
    monkeypatch.setattr(qweights, "gpu_kernels", GPU_KERNELS)
    assert qweights.gpu_kernels(x) is None  # off for the process, on any device
    assert torch.allclose(quant_linear(x, w), x @ w.dequantize().T, atol=1e-5)


def test_a_q4_k_m_model_forward_on_the_kernels_equals_its_torch_forward(tmp_path, kernels_here, monkeypatch):
    """Every path a decode step takes (embedding of a Q6_K table, q|k|v of mixed formats, the
    tied head) through the kernels, against the same model's CPU forward."""
    from edge_runtime.model.dense import dense_logits
    from edge_runtime.model.gguf_load import load_llama_gguf
    from tests.model.quant_helpers import Q4_K_M_LIKE, tiny_quant_gguf

    _, path = tiny_quant_gguf(tmp_path, Q4_K_M_LIKE, tie=True, num_layers=1)
    model = load_llama_gguf(path)
    ids = torch.randint(3, 300, (1, 5), generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(qweights, "gpu_kernels", lambda t: None)
    want = dense_logits(model, ids)
    monkeypatch.setattr(qweights, "gpu_kernels", lambda t: qweights_cuda)
    calls = []
    real = qweights_cuda.matmul_into
    monkeypatch.setattr(qweights_cuda, "matmul_into", lambda *a, **kw: calls.append(a[1].bits) or real(*a, **kw))
    got = dense_logits(model.to(DEVICE), ids.to(DEVICE)).cpu()
    assert {4, 6, 8} <= set(calls)  # Q4_K, the Q6_K head and v, layer 0's Q8_0 up
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_a_half_precision_row_does_not_depend_on_the_rows_beside_it():
    """Up to MAX_ROWS rows all take the same tile, so a decode row rounds alike alone or in a batch."""
    w = _stacked().to(DEVICE)
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.bfloat16)
    alone = qweights_cuda.linear(w.parts, x[:1], None)
    for rows in (2, 7, 16):
        assert torch.equal(qweights_cuda.linear(w.parts, x[:rows], None)[:1], alone)


NEEDS_CUDA = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def _decode_step_weights() -> tuple[QuantWeight, QuantWeight]:
    """A Q6_K table (embedding and tied head) and a layer's projection of mixed formats."""
    table = QuantWeight([q6_k(300, 256, seed=5)]).cuda()
    layer = QuantWeight([q4_k(200, 256, seed=6), q6_k(24, 256, seed=7), q8_0(32, 256, seed=8)]).cuda()
    return table, layer


@pytest.mark.gpu
@NEEDS_CUDA
def test_a_decode_steps_reads_of_blocks_replay_in_a_cuda_graph_with_no_host_sync():
    table, layer = _decode_step_weights()
    ids = torch.tensor([3, 299, 17, 0], device="cuda")

    def step() -> torch.Tensor:
        h = table.embedding(ids, torch.bfloat16)
        return quant_linear(quant_linear(h, layer), table)  # [4, 300]: the tied head

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels and warm the allocator outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.set_sync_debug_mode("error")  # any host sync in the step raises
    try:
        eager = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    ids.copy_(torch.tensor([5, 6, 7, 8]))
    graph.replay()
    want = step()
    assert not torch.equal(want, eager) and torch.equal(captured, want)
    assert qweights_cuda.unavailable() is None  # the kernels ran, not the fallback


@pytest.mark.gpu
@NEEDS_CUDA
def test_kernels_on_the_gpu_match_the_torch_path_at_decode_and_prefill_shapes():
    """The GPU's bfloat16 step against de-quantise-then-cuBLAS, 1 to 64 rows, at 1B-like K."""
    part = q4_k(512, 2048, seed=9).to("cuda")
    w = QuantWeight([part])
    dense = part.dequantize_torch(torch.bfloat16)
    for rows in (1, 4, 16, 64):
        x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
        got = quant_linear(x, w)
        want = torch.nn.functional.linear(x, dense)
        assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
