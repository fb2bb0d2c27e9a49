"""gguf_kernel: de-quantisation bit for bit against gguf's numpy code and block matmuls against
x @ dequantize(W).T, for every supported type, on the compiled path and the reference path."""

from __future__ import annotations

import functools
import platform
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from edge_runtime.model import gguf_kernel
from edge_runtime.model.qkernel import KernelUnavailable, build_library
from tests import cross_builds

Q = GGMLQuantizationType
TYPES = sorted(gguf_kernel.SUPPORTED, key=lambda t: t.value)
# Where the scale fields (fp16) lie in a block of the types gguf's numpy code cannot quantise.
_HALF_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
# ... and in every block type, for blocks of random bytes with chosen scales.
_ALL_HALF_FIELDS = {**_HALF_FIELDS, Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,)}
# float16 scales at the edges: zeros of both signs, subnormals, the extremes.
EDGE = np.array([0.0, -0.0, 6e-8, -6e-8, 6.1e-5, 65504.0, -65504.0, 1.0, -0.5, 3e-3], dtype=np.float16)


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


@functools.cache
def _variant_library(extra: tuple[str, ...]):
    """gguf_native.c built with extra flags: -DGG_GENERIC (the portable loops other machines run),
    -mno-avx512f -mno-avxvnni (an AVX2-only x86: maddubs for the int8 dot)."""
    try:
        return gguf_kernel.bind(build_library(gguf_kernel.SOURCE, gguf_kernel._FLAGS + list(extra),
                                              gguf_kernel.INCLUDES))
    except KernelUnavailable:
        return None


_VARIANTS = {"portable": ("-DGG_GENERIC",), "avx2": ("-mno-avx512f", "-mno-avxvnni")}


def use_variant(name: str, monkeypatch) -> None:
    """Serve gguf_kernel's calls from the `_VARIANTS[name]` build (skips where it cannot be had)."""
    if name == "avx2" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86 build")
    lib = _variant_library(_VARIANTS[name])
    if lib is None:
        pytest.skip(f"the {name} build is not available here")
    monkeypatch.setattr(gguf_kernel, "_library", lambda: lib)


@pytest.fixture(params=["compiled", "portable", "avx2", "reference"])
def path(request, monkeypatch):
    if request.param == "reference":
        monkeypatch.setenv(gguf_kernel.ENV, "off")
        assert not gguf_kernel.available()
    elif not gguf_kernel.available():
        pytest.skip("the compiled GGUF kernels are not available here")
    elif request.param in _VARIANTS:
        use_variant(request.param, monkeypatch)
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
@pytest.mark.parametrize("m", [1, 8])
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
        assert ((back.double() - got.double() @ w.double()).abs() <= _bound(got, w.T)).all()


@pytest.mark.parametrize("qtype", sorted(_ALL_HALF_FIELDS, key=lambda t: t.value), ids=lambda t: t.name)
def test_dequantize_random_bytes_with_edge_scales(qtype, path):
    """Any bytes with any finite scale (subnormal, -0, 65504) de-quantise bit for bit, -0 kept."""
    rng = np.random.default_rng(qtype.value)
    block, size = GGML_QUANT_SIZES[qtype]
    n, blocks = 5, 512 // block
    raw = rng.integers(0, 256, (n, blocks, size), dtype=np.uint8)
    for at in _ALL_HALF_FIELDS[qtype]:
        raw[..., at:at + 2] = EDGE[rng.integers(0, len(EDGE), (n, blocks))].view(np.uint8).reshape(n, blocks, 2)
    raw = torch.from_numpy(raw.reshape(n, -1))
    got, want = gguf_kernel.dequantize(raw, qtype, 512), reference(raw, qtype)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda t: t.name)
def test_float_rows_of_any_width_and_bits(qtype, path):
    """Float rows: widths that are no multiple of 16, every bit pattern (infinities and NaNs
    de-quantise as numpy widens them)."""
    width = 4 if qtype == Q.F32 else 2
    raw = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (9, 100 * width), dtype=np.uint8))
    got, want = gguf_kernel.dequantize(raw, qtype, 100), reference(raw, qtype)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    raw = make_blocks(qtype, 9, 100)
    x = torch.randn(2, 100)
    w = reference(raw, qtype)
    assert ((gguf_kernel.matmul(x, raw, qtype, 100).double() - x.double() @ w.double().T).abs() <= _bound(x, w)).all()


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_1], ids=lambda t: t.name)
def test_threads_tiles_and_many_rows(qtype, path, monkeypatch):
    """Rows split over threads (a count that does not divide N), several tiles per weight, and more
    rows of x than the fused kernel takes (the tiled GEMM path), all against the reference."""
    monkeypatch.setattr(gguf_kernel, "PARALLEL_MIN_WEIGHTS", 1)
    monkeypatch.setattr(gguf_kernel, "TILE_ELEMENTS", 3 * 512)
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        raw = make_blocks(qtype, 29, 512, seed=5)
        w = reference(raw, qtype)
        assert torch.equal(gguf_kernel.dequantize(raw, qtype, 512).view(torch.int32), w.view(torch.int32))
        for m in (1, 8, 9, 40):
            x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
            got = gguf_kernel.matmul(x, raw, qtype, 512)
            assert ((got.double() - x.double() @ w.double().T).abs() <= _bound(x, w)).all()
        back = gguf_kernel.matmul_back(got, raw, qtype, 512)
        assert ((back.double() - got.double() @ w.double()).abs() <= _bound(got, w.T)).all()
    finally:
        torch.set_num_threads(torch_threads)


BLOCK_TYPES = [t for t in TYPES if GGML_QUANT_SIZES[t][0] > 1]
_OFFSET_AT = {Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K}  # the per-32 offset's fp16 (min) at bytes 2..3 of a block


def _int8_bound(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """What int8 activations may cost: sum over x's 32-value blocks of dx_b / 2 * |levels part of
    w| (the weight less its per-32 offset: the block's min field zeroed), plus the float bound.
    Q4_K, Q5_K and Q6_K take x as q8_K (one dx per 256 values, and the offsets meet the quantised x too):
    sum over the 256-value blocks of dx_b / 2 * |w|."""
    k = x.shape[1]
    if qtype in gguf_kernel.Q8K_TYPES:
        w = reference(raw, qtype).double()
        dx = x.abs().reshape(x.shape[0], -1, 256).amax(-1).double() / 127
        rounding = (dx / 2 * (1 + 1e-6)).repeat_interleave(256, dim=1)  # (1 / (127 / amax): a few ulps)
        return rounding @ w.abs().T + 2 * k * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().T) * 2
    levels = raw.clone()
    if qtype in _OFFSET_AT:
        block, size = GGML_QUANT_SIZES[qtype]
        view = levels.view(raw.shape[0], k // block, size)
        view[..., 2:4] = 0
    lw = reference(levels, qtype).double()
    dx = x.abs().reshape(x.shape[0], -1, 32).amax(-1).double() / 127
    rounding = (dx / 2).repeat_interleave(32, dim=1)
    w = reference(raw, qtype).double()
    return rounding @ lw.abs().T + 2 * k * torch.finfo(torch.float32).eps * (x.abs().double() @ (w.abs() + lw.abs()).T)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 13])
def test_int8_activations_within_their_bound(qtype, m, path, monkeypatch):
    """int8 activations (opt-in) stay within x's rounding bound of the float product; on the
    reference path the switch is ignored (the float product)."""
    monkeypatch.setenv(gguf_kernel.ACTIVATIONS_ENV, "int8")
    k = 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 608  # 608: two whole 256-weight tiles and a part
    raw = make_blocks(qtype, 37, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[0, :32] = 0.0  # an all-zero block of x (scale 0)
    want = x.double() @ reference(raw, qtype).double().T
    got = gguf_kernel.matmul(x, raw, qtype, k)
    assert ((got.double() - want).abs() <= _int8_bound(x, raw, qtype)).all()
    if path == "compiled":  # it is a different product: the float one is closer
        f32 = gguf_kernel.matmul(x, raw, qtype, k, int8_x=False)
        assert not torch.equal(got, f32)
        assert (f32.double() - want).abs().mean() < (got.double() - want).abs().mean()


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0], ids=lambda t: t.name)
def test_int8_decode_kernels_at_the_edges(qtype, path, monkeypatch):
    """The decode kernels (q8_K x for Q4_K/Q5_K/Q6_K, per-32 x for Q8_0): the smallest legal width, every
    row count 1..16 of x, weight rows that the thread split does not divide, random bytes with edge
    fp16 scales (subnormals, -0, 65504), an all-zero 256 of x; within the int8 bound of the float64
    product of gguf's numpy de-quantisation."""
    monkeypatch.setattr(gguf_kernel, "PARALLEL_MIN_WEIGHTS", 1)
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        rng = np.random.default_rng(qtype.value)
        block, size = GGML_QUANT_SIZES[qtype]
        for k, n in ((block if block == 256 else 32, 7), (768, 29)):
            raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
            for at in _ALL_HALF_FIELDS[qtype]:
                raw[..., at:at + 2] = EDGE[rng.integers(0, len(EDGE), (n, k // block))].view(np.uint8).reshape(
                    n, k // block, 2)
            raw = torch.from_numpy(raw.reshape(n, -1))
            w = reference(raw, qtype).double()
            for m in range(1, 17):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                x[0, :min(k, 256)] = 0.0
                got = gguf_kernel.matmul(x, raw, qtype, k, int8_x=True)
                want = x.double() @ w.T
                assert torch.isfinite(got).all()
                assert ((got.double() - want).abs() <= _int8_bound(x, raw, qtype)).all(), (k, m)
    finally:
        torch.set_num_threads(torch_threads)


def test_products_from_several_threads_at_once(path):
    """Callers on several Python threads at once (the library's pool serves one product at a time;
    the others run their rows on their own thread) get the products they would alone."""
    import threading

    raw = make_blocks(Q.Q6_K, 300, 1024, seed=3)
    xs = [torch.randn(1 + i % 3, 1024, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    want = [gguf_kernel.matmul(x, raw, Q.Q6_K, 1024, int8_x=True) for x in xs]
    got: dict[int, list[torch.Tensor]] = {}

    def run(i: int) -> None:
        got[i] = [gguf_kernel.matmul(xs[i], raw, Q.Q6_K, 1024, int8_x=True) for _ in range(20)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, outs in got.items():
        assert all(torch.equal(o, want[i]) for o in outs)


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


_HARNESS = Path(__file__).with_name("gguf_native_harness.c")


def _harness_rows(path: Path):
    """(qx, dx, {type: (raw, dequantized, f32 product, int8 product)}, x) as the harness wrote them."""
    data, at = path.read_bytes(), 0
    n, k, m = 37, 512, 13

    def take(count, dtype):
        nonlocal at
        a = np.frombuffer(data, dtype=dtype, count=count, offset=at)
        at += a.nbytes
        return a

    qx, dx = take(m * k, np.int8), take(m * k // 32, np.float32)
    rows = {}
    for t in (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K):
        rb = gguf_kernel.row_bytes(t, k)
        rows[t] = (take(n * rb, np.uint8).reshape(n, rb), take(n * k, np.float32).reshape(n, k),
                   take(m * n, np.float32).reshape(m, n), take(m * n, np.float32).reshape(m, n))
    x = take(m * k, np.float32).reshape(m, k)
    group = {"base": take(m * 2 * n, np.float32).reshape(m, 2 * n), "plain": take(m * 2 * n, np.float32).reshape(m, 2 * n),
             "norm_w": take(k, np.float32)}
    for prep in ("norm", "silu"):
        group[prep] = (take(m * k, np.float32).reshape(m, k), take(m * 2 * n, np.float32).reshape(m, 2 * n))
    assert at == len(data)
    return qx, dx, rows, x, group


@pytest.mark.parametrize("march", ["armv8-a", "armv8.2-a+dotprod"])
def test_aarch64_build_under_qemu(tmp_path, march):
    """Jetson's build (aarch64: the NEON int8 dot, `sdot` where the target has dotprod as Orin's
    -mcpu=native does, the portable decoders, which the "portable" variant above also runs
    natively), cross-compiled and run under qemu where both are installed: de-quantisation bit for
    bit gguf's numpy code, float products within the float bound, int8 products within x's
    rounding bound."""
    cc = cross_builds.compiler(arm=True)
    exe, out = tmp_path / "harness", tmp_path / "out.bin"
    subprocess.run([cc, "-O3", "-ffp-contract=off", "-fno-math-errno", "-pthread", f"-march={march}", "-I", str(gguf_kernel.SOURCE.parent),
                    str(_HARNESS), "-o", str(exe)], check=True, capture_output=True, timeout=300)
    cross_builds.run(True, exe, str(out))
    qx, dx, rows, x, group = _harness_rows(out)
    xt = torch.from_numpy(x.copy())
    for qtype, (raw, deq, f32, int8) in rows.items():
        want = reference(torch.from_numpy(raw.copy()), qtype)
        assert np.array_equal(deq.view(np.int32), want.numpy().view(np.int32)), qtype.name
        exact = xt.double() @ want.double().T
        assert ((torch.from_numpy(f32.copy()).double() - exact).abs() <= _bound(xt, want)).all(), qtype.name
        if GGML_QUANT_SIZES[qtype][0] > 1:
            bound = _int8_bound(xt, torch.from_numpy(raw.copy()), qtype)
            assert ((torch.from_numpy(int8.copy()).double() - exact).abs() <= bound).all(), qtype.name
    _check_harness_group(xt, rows, group)


def _check_harness_group(x: torch.Tensor, rows: dict, group: dict) -> None:
    """The harness's grouped calls (gguf_native_fused.c on that build): x as it is, onto a base, is
    the parts' own int8 products (reversed columns) plus the base, bit for bit; the C norm and silu *
    up are torch's within 4 ulps, and their products within the int8 bound of the exact ones."""
    t = lambda a: torch.from_numpy(a.copy())  # noqa: E731
    parts = (Q.Q4_K, Q.Q6_K)
    int8 = torch.cat([t(rows[q][3]) for q in parts], dim=1).flip(1)
    assert torch.equal(t(group["plain"]), t(group["base"]) + int8)
    raw = {q: t(rows[q][0]) for q in parts}
    eps = torch.finfo(torch.float32).eps
    gate, up = x, x.flip(1)
    for prep, want in (("norm", _torch_rms_norm(x, t(group["norm_w"]))), ("silu", torch.nn.functional.silu(gate) * up)):
        xf, out = (t(a) for a in group[prep])
        assert ((xf - want).abs() <= 4 * eps * want.abs() + 1e-30).all(), prep
        exact = torch.cat([xf.double() @ reference(raw[q], q).double().T for q in parts], dim=1).flip(1)
        bound = torch.cat([_int8_bound(xf, raw[q], q) for q in parts], dim=1).flip(1)
        assert ((out.double() - exact).abs() <= bound).all(), prep


def _torch_rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from edge_runtime.model.llama import rms_norm

    return rms_norm(x, w, 1e-5)


def test_every_c_source_the_build_reads_ships_in_the_package():
    """An installed wheel builds gguf_native.c beside the files it includes: each is package data."""
    tomllib = pytest.importorskip("tomllib")
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    shipped = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["edge_runtime"]
    for source in (gguf_kernel.SOURCE, *gguf_kernel.INCLUDES):
        assert f"model/{source.name}" in shipped, source.name
