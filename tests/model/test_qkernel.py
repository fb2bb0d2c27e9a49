"""The compiled one-pass de-quantisation (qkernel) equals torch's passes bit for bit on every
block layout (4-bit with and without zero and offset, factored K-quant scales, 5- and 6-bit
levels with packed high bits, 8-bit signed and unsigned, float16 edge scales, -0 kept), split over threads too, and falls back to torch's passes
where it is turned off or cannot be built."""

from __future__ import annotations

import shutil

import pytest
import torch

from edge_runtime.model import qkernel
from edge_runtime.model.qweights import Blocks

# float16 scales at the edges: zeros of both signs, subnormals, the extremes.
EDGE = torch.tensor([0.0, -0.0, 6e-8, -6e-8, 6.1e-5, 65504.0, -65504.0, 1.0, -0.5, 3e-3], dtype=torch.float16)


def _levels(gen, n, blocks, width, signed):
    if signed:
        return torch.randint(-128, 128, (n, blocks, width), generator=gen).to(torch.int8)
    return torch.randint(0, 256, (n, blocks, width), generator=gen).to(torch.uint8)


def _layouts(n=7, k=256, seed=0) -> dict[str, Blocks]:
    gen = torch.Generator().manual_seed(seed)
    blocks = k // 32

    def edge_scales(shape):
        return EDGE[torch.randint(0, len(EDGE), shape, generator=gen)]

    return {
        "q4_0": Blocks(_levels(gen, n, blocks, 16, False), edge_scales((n, blocks)), None, 8, 4),
        "q4_1": Blocks(_levels(gen, n, blocks, 16, False), edge_scales((n, blocks)), edge_scales((n, blocks)), 0, 4),
        "q4_k": Blocks(_levels(gen, n, blocks, 16, False), edge_scales((n, 1)), edge_scales((n, 1)), 0, 4,
                       scale_steps=torch.randint(0, 64, (n, blocks), generator=gen).to(torch.uint8),
                       offset_steps=torch.randint(0, 64, (n, blocks), generator=gen).to(torch.uint8)),
        "q5_k": Blocks(_levels(gen, n, blocks, 32, False) & 31, edge_scales((n, 1)), edge_scales((n, 1)), 0, 8,
                       scale_steps=torch.randint(0, 64, (n, blocks), generator=gen).to(torch.uint8),
                       offset_steps=torch.randint(0, 64, (n, blocks), generator=gen).to(torch.uint8)),
        "q6_k": Blocks(_levels(gen, n, k // 16, 16, True), edge_scales((n, 1)), None, 0, 8,
                       scale_steps=torch.randint(-128, 128, (n, k // 16), generator=gen).to(torch.int8)),
        "q5_k packed": Blocks(_levels(gen, n, blocks, 16, False), edge_scales((n, 1)), edge_scales((n, 1)), 0, 5,
                              scale_steps=torch.randint(0, 64, (n, blocks), generator=gen).to(torch.uint8),
                              offset_steps=torch.randint(0, 64, (n, blocks), generator=gen).to(torch.uint8),
                              high=_levels(gen, n, blocks, 4, False)),
        "q6_k packed": Blocks(_levels(gen, n, k // 16, 8, False), edge_scales((n, 1)), None, 32, 6,
                              scale_steps=torch.randint(-128, 128, (n, k // 16), generator=gen).to(torch.int8),
                              high=_levels(gen, n, k // 16, 4, False)),
        "q5_0 packed": Blocks(_levels(gen, n, blocks, 16, False), edge_scales((n, blocks)), None, 16, 5,
                              high=_levels(gen, n, blocks, 4, False)),
        "q5_1 packed": Blocks(_levels(gen, n, blocks, 16, False), edge_scales((n, blocks)), edge_scales((n, blocks)),
                              0, 5, high=_levels(gen, n, blocks, 4, False)),
        # widths the kernel has no unrolled copy for: 8 (its word path), 4 (its bit-by-bit loop)
        "6-bit blocks of 8": Blocks(_levels(gen, n, k // 8, 4, False), torch.randn(n, k // 8, generator=gen), None,
                                    32, 6, high=_levels(gen, n, k // 8, 2, False)),
        "6-bit blocks of 4": Blocks(_levels(gen, n, k // 4, 2, False), torch.randn(n, k // 4, generator=gen),
                                    torch.randn(n, k // 4, generator=gen), 0, 6, high=_levels(gen, n, k // 4, 1, False)),
        "q8_0": Blocks(_levels(gen, n, blocks, 32, True), edge_scales((n, blocks)), None, 0, 8),
        "uint8 with zero": Blocks(_levels(gen, n, blocks, 32, False), torch.rand(n, blocks, generator=gen), None, 16, 8),
        "float32 scales": Blocks(_levels(gen, n, blocks, 16, False), torch.randn(n, blocks, generator=gen),
                                 torch.randn(n, blocks, generator=gen), 8, 4),
    }


@pytest.fixture
def kernel():
    if not qkernel.available(torch.empty(0, dtype=torch.uint8)):
        pytest.skip("no C compiler here: the torch passes are the only path")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("name", list(_layouts()))
def test_kernel_equals_torch_passes_bit_for_bit(kernel, name):
    b = _layouts()[name]
    got, want = b.dequantize(), b.dequantize_torch()
    assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(b.dequantize(torch.bfloat16), b.dequantize_torch(torch.bfloat16))


@pytest.mark.parametrize("name", [n for n in _layouts() if _layouts()[n].bits in (5, 6)])
def test_packed_levels_are_low_nibbles_and_high_bits(kernel, name):
    b = _layouts()[name]
    hb = b.bits - 4
    low = torch.stack((b.levels & 15, b.levels >> 4), dim=-1).reshape(b.n, -1, b.block).int()
    bitstring = torch.stack([(b.high >> i) & 1 for i in range(8)], dim=-1).reshape(b.n, -1, b.block, hb).int()
    high = sum(bitstring[..., i] << i for i in range(hb))  # element j's bits at hb * j, lowest first
    q = low | (high << 4)
    assert torch.equal(b.unpacked().int(), q)
    s, o = b.scale_per_block(), b.offset_per_block()
    want = (q.float() - b.zero) * s[..., None]
    want = (want if o is None else want + o[..., None]).reshape(b.n, b.k)
    assert torch.equal(_bits(b.dequantize()), _bits(want))
    assert torch.equal(_bits(b.bytewise().dequantize()), _bits(want))


def test_negative_zero_is_kept_where_llama_cpp_has_it(kernel):
    levels = torch.full((1, 1, 16), 0x88, dtype=torch.uint8)  # both nibbles level 8: (8 - 8) * -1 = -0
    b = Blocks(levels, torch.tensor([[-1.0]], dtype=torch.float16), None, 8, 4)
    w = b.dequantize()
    assert (w == 0).all() and torch.signbit(w).all()


def test_rows_split_over_threads_give_the_same_bits(kernel, monkeypatch):
    monkeypatch.setattr(qkernel, "PARALLEL_MIN_ELEMENTS", 64)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for b in _layouts(n=11).values():
            assert torch.equal(_bits(b.dequantize()), _bits(b.dequantize_torch()))
    finally:
        torch.set_num_threads(threads)


def test_row_slices_and_gathers_de_quantise_the_same(kernel):
    b = _layouts(n=9)["q4_k"]
    full = b.dequantize_torch()
    assert torch.equal(b.slice(2, 7).dequantize(), full[2:7])
    index = torch.tensor([8, 0, 3, 3])
    assert torch.equal(b.rows(index).dequantize(), full[index])


def test_turned_off_or_unbuildable_falls_back_to_torch(monkeypatch, tmp_path):
    b = _layouts()["q4_1"]
    want = b.dequantize_torch()
    monkeypatch.setenv(qkernel.ENV, "off")
    assert not qkernel.available(b.levels)
    assert torch.equal(_bits(b.dequantize()), _bits(want))
    monkeypatch.delenv(qkernel.ENV)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MACE_CACHE_DIR", str(tmp_path / "cache"))
    qkernel._library.cache_clear()
    try:
        assert not qkernel.available(b.levels)
        with pytest.raises(qkernel.KernelUnavailable):
            qkernel._load()
        assert torch.equal(_bits(b.dequantize()), _bits(want))
    finally:
        qkernel._library.cache_clear()


def test_linear_reuses_one_buffer_and_keeps_each_result(kernel):
    from edge_runtime.model import qweights
    from edge_runtime.model.qweights import QuantWeight, quant_linear

    parts = list(_layouts(n=6).values())
    weights = [QuantWeight([p]) for p in parts if p.k == 256]
    x = torch.randn(3, 256, requires_grad=True)
    outs = [quant_linear(x, w) for w in weights]  # every call overwrites the same workspace
    buffer = qweights._WORKSPACES.buffer
    for w, y in zip(weights, outs, strict=True):
        assert torch.equal(y, torch.nn.functional.linear(x, w.dequantize()))
    sum(y.square().sum() for y in outs).backward()
    want = torch.autograd.grad(sum(torch.nn.functional.linear(x, w.dequantize()).square().sum() for w in weights), x)[0]
    torch.testing.assert_close(x.grad, want, rtol=1e-6, atol=0)
    assert qweights._WORKSPACES.buffer is buffer


def test_a_library_others_may_write_is_never_loaded(tmp_path):
    lib = tmp_path / "kernels" / "qdequant-x.so"
    lib.parent.mkdir(mode=0o700)
    lib.write_bytes(b"\x7fELF")
    lib.chmod(0o644)
    qkernel._check_trusted(lib)  # this user's, written by no one else: trusted
    lib.chmod(0o666)
    with pytest.raises(qkernel.KernelUnavailable, match="not trusted"):
        qkernel._check_trusted(lib)
    lib.chmod(0o644)
    lib.parent.chmod(0o777)
    with pytest.raises(qkernel.KernelUnavailable, match="not trusted"):
        qkernel._check_trusted(lib)


def test_a_compiler_that_refuses_the_native_flag_builds_without_it(monkeypatch, tmp_path):
    """aarch64 asks for -mcpu=native (dotprod on cores that have it); a compiler that refuses it
    still builds the library, without the flag."""
    real = shutil.which("cc") or shutil.which("gcc")
    if real is None:
        pytest.skip("no C compiler here")
    calls = tmp_path / "calls"
    wrapper = tmp_path / "cc"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {calls}\ncase "$*" in *-mcpu=native*) exit 1;; esac\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    source = tmp_path / "one.c"
    source.write_text("int one(void) { return 1; }\n")
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("MACE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(qkernel.platform, "machine", lambda: "aarch64")
    lib = qkernel.build_library(source, ["-O2", "-fPIC", "-shared"])
    assert lib.one() == 1
    tried = calls.read_text().splitlines()
    assert len(tried) == 2 and "-mcpu=native" in tried[0] and "-mcpu=native" not in tried[1]
