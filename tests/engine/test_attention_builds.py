"""kv/attention.c as other machines build it: attention_harness.c built natively (with and without
-march=native) and for aarch64 (armv8-a, armv8.2-a+dotprod, Jetson Orin's cortex-a78ae; run under
qemu) writes the same bytes everywhere but the soft cap's libm tanhf, and each build keeps the
kernel's promises (prefill rows are decode rows, bit for bit; the float64 bound of the decode tests)."""

from __future__ import annotations

import functools
import hashlib
import platform
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from edge_runtime.kv import attention_kernel
from edge_runtime.model.llama import rotate_half
from tests.cross_builds import NATIVE, ORIN, compiler, run
from tests.engine import test_attention_kernel as decode_tests

HARNESS = Path(__file__).with_name("attention_harness.c")
# Each build: (aarch64?, extra flags). "own tanhf": the soft cap's tanhf swapped for the harness's own
# (libm's last bits are the machine's: glibc's aarch64 expm1f fuses its multiply-adds, x86_64's does not).
BUILDS = {
    "native": (False, [NATIVE]),
    "no-march": (False, []),
    "armv8-a": (True, ["-march=armv8-a"]),
    "armv8.2-a+dotprod": (True, ["-march=armv8.2-a+dotprod"]),
    "cortex-a78ae": (True, [ORIN]),
    "native, own tanhf": (False, [NATIVE, "-DHARNESS_OWN_TANHF"]),
    "cortex-a78ae, own tanhf": (True, [ORIN, "-DHARNESS_OWN_TANHF"]),
}


def _bounds() -> dict[torch.dtype, float]:
    """dtype -> the bound test_decode_attention_matches_a_float64_softmax_attention holds the decode
    kernel to against a float64 attention (read from its parametrisation: one place says it)."""
    for mark in decode_tests.test_decode_attention_matches_a_float64_softmax_attention.pytestmark:
        if mark.args[0] == "dtype,tol":
            return dict(mark.args[1])
    raise AssertionError("the decode test's bounds are not parametrised as expected")


@pytest.fixture(scope="module")
def harness_output(tmp_path_factory):
    """build name -> its records (name -> bytes), built and run once; skips where the compiler
    or qemu that the build needs is missing."""
    where = tmp_path_factory.mktemp("attention-builds")

    @functools.cache
    def build(name: str) -> dict[str, bytes]:
        arm, extra = BUILDS[name]
        cc = compiler(arm)
        exe, out = where / name.replace(" ", "").replace(",", "-"), where / f"{name}.bin".replace(" ", "")
        # the runtime's flags for an executable (no -shared); -lm: libm's tanhf, as build_library links it
        flags = [f for f in attention_kernel._FLAGS if f != "-shared"]
        subprocess.run([cc, *flags, *extra, "-I", str(attention_kernel.SOURCE.parent), str(HARNESS), "-o", str(exe),
                        "-lm"], check=True, capture_output=True, timeout=300)
        run(arm, exe, str(out))
        return _records(out.read_bytes())

    return build


@pytest.fixture(scope="module")
def checked_cases() -> set[bytes]:
    """Digests of the cases already checked (most builds write the same bytes: checked once)."""
    return set()


def _records(data: bytes) -> dict[str, bytes]:
    """The harness's records: a 32-byte name, an int64 byte count, the bytes."""
    out, at = {}, 0
    while at < len(data):
        name = data[at : at + 32].rstrip(b"\0").decode()
        n = int.from_bytes(data[at + 32 : at + 40], "little", signed=True)
        out[name] = data[at + 40 : at + 40 + n]
        at += 40 + n
    return out


def _tensor(rec: dict[str, bytes], name: str, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(rec[name]), dtype=dtype).reshape(*shape)


def _cases(rec: dict[str, bytes]) -> list[int]:
    return sorted(int(k[1:].split("/")[0]) for k in rec if k.startswith("c") and k.endswith("/shape"))


def _case(rec: dict[str, bytes], c: int) -> dict:
    heads, kv, d, bf16, b, width, slots, chunk = np.frombuffer(rec[f"c{c}/shape"], np.int64).tolist()
    cap, _ = np.frombuffer(rec[f"c{c}/cap_scale"], np.float32).tolist()
    dt = torch.bfloat16 if bf16 else torch.float32
    t = lambda name, dtype, *shape: _tensor(rec, f"c{c}/{name}", dtype, *shape)  # noqa: E731
    case = {"heads": heads, "kv": kv, "d": d, "dtype": dt, "cap": cap or None,
            "k": t("k", dt, slots, kv, d), "v": t("v", dt, slots, kv, d),
            "q": t("q", dt, chunk, heads + kv, d)[:, :heads], "index": t("index", torch.int64, b, width),
            "lens": t("lens", torch.int64, b), "rows": t("rows", torch.int64, b), "slots": t("slots", torch.int64, -1)}
    for out in ("decode", "decode_w", "masked", "entries"):
        case[out] = t(out, dt, b, heads * d)
    for w in ("weights", "masked_weights"):
        case[w] = t(w, torch.float32, b, heads, width)
    for part in ("causal", "window"):
        case[part] = {"rows": t(part, torch.int64, chunk), "starts": t(f"{part}_starts", torch.int64, chunk),
                      "lens": t(f"{part}_lens", torch.int64, chunk)}
        for how in ("one", "split", "decode"):
            case[part][how] = t(f"{part}_{how}", dt, chunk, heads * d)
    return case


def _float64(case: dict, q: torch.Tensor, index: torch.Tensor, lens: torch.Tensor, monkeypatch) -> torch.Tensor:
    """The decode tests' float64 attention (their helper, at this case's heads and width)."""
    for name, value in (("HEADS", case["heads"]), ("KV_HEADS", case["kv"]), ("D", case["d"])):
        monkeypatch.setattr(decode_tests, name, value)
    return decode_tests._float64(q, case["k"], case["v"], index, lens, case["cap"])


def _check_case(case: dict, tol: float, monkeypatch) -> None:
    q, index, lens, rows = case["q"], case["index"], case["lens"], case["rows"]
    for same in ("decode_w", "entries"):  # weights asked for, keys read through `entries`: the same bits
        assert torch.equal(case[same].view(torch.int16), case["decode"].view(torch.int16)), same
    want = _float64(case, q[rows], index, lens, monkeypatch)
    assert (case["decode"][rows].double() - want).abs().max().item() < tol
    width = index.shape[1]
    past = torch.arange(width)[None, None] >= lens[:, None, None]
    assert bool((case["weights"][past.expand_as(case["weights"])] == 0).all())
    assert torch.allclose(case["weights"].sum(-1), torch.ones(()), atol=1e-5)
    # masked: every KV head drops positions j % 3 == 1 (exact zero weights), as if they were not there
    kept = [index[b, : lens[b]][torch.arange(int(lens[b])) % 3 != 1] for b in range(len(lens))]
    kept_index = torch.nn.utils.rnn.pad_sequence(kept, batch_first=True)
    kept_lens = torch.tensor([len(k) for k in kept])
    want = _float64(case, q[rows], kept_index, kept_lens, monkeypatch)
    assert (case["masked"][rows].double() - want).abs().max().item() < tol
    dropped = (torch.arange(width) % 3 == 1)[None, None] | past
    assert bool((case["masked_weights"][dropped.expand_as(case["masked_weights"])] == 0).all())
    for part in ("causal", "window"):
        p = case[part]
        # one call, a split into row ranges, each row alone as a decode row: the same bits
        assert torch.equal(p["one"].view(torch.int16), p["split"].view(torch.int16)), part
        assert torch.equal(p["one"].view(torch.int16), p["decode"].view(torch.int16)), part
        chunk_index = torch.zeros(len(p["lens"]), int(p["lens"].max()), dtype=torch.long)
        for t in range(len(p["lens"])):
            chunk_index[t, : p["lens"][t]] = case["slots"][p["starts"][t] : p["starts"][t] + p["lens"][t]]
        want = _float64(case, q[p["rows"]], chunk_index, p["lens"], monkeypatch)
        assert (p["one"][p["rows"]].double() - want).abs().max().item() < tol, part


def _check_write_and_rope(rec: dict[str, bytes]) -> None:
    for c, dt in ((0, torch.float32), (1, torch.bfloat16)):
        t = lambda name, *shape, c=c, dt=dt: _tensor(rec, f"w{c}/{name}", dt, *shape)  # noqa: E731
        kv, slots = t("kv", 3, 5, 16), _tensor(rec, f"w{c}/slots", torch.int64, 3)
        for plane, part in (("k", kv[:, :2]), ("v", kv[:, 2:4])):
            want = t(f"{plane}_before", 16, 2, 16).index_copy(0, slots, part)
            assert torch.equal(t(f"{plane}_after", 16, 2, 16).view(torch.int16), want.view(torch.int16))
    for c, r in ((0, 64), (1, 32)):
        t = lambda name, *shape, c=c: _tensor(rec, f"r{c}/{name}", torch.float32, *shape)  # noqa: E731
        x, cos, sin = t("x", 5, 11, 64)[:, :8], t("cos", 5, r), t("sin", 5, r)
        turned = x[..., :r]
        want = torch.cat([turned * cos[:, None] + rotate_half(turned) * sin[:, None], x[..., r:]], -1)
        assert torch.equal(t("out", 5, 8, 64), want)


@pytest.mark.parametrize("build", BUILDS)
def test_each_build_keeps_the_kernels_promises(build, harness_output, checked_cases, monkeypatch):
    """On every build: prefill rows (one call, row ranges) are the same rows as lone decode rows, bit
    for bit; decode rows through `entries` or with weights are the plain ones; masked keys get exact
    zero weights; all within the decode tests' float64 bound; write_kv is index_copy and rope is
    torch's rotation, bit for bit."""
    rec, bounds = harness_output(build), _bounds()
    cases = _cases(rec)
    assert len(cases) == 16
    for c in cases:
        digest = hashlib.sha256(b"".join(rec[name] for name in sorted(rec) if name.startswith(f"c{c}/"))).digest()
        if digest in checked_cases:  # the same bytes as a case an earlier build showed to keep them
            continue
        case = _case(rec, c)
        _check_case(case, bounds[case["dtype"]], monkeypatch)
        checked_cases.add(digest)
    _check_write_and_rope(rec)


@pytest.mark.parametrize("build", [b for b in BUILDS if b not in ("native", "native, own tanhf")])
def test_every_build_writes_the_native_builds_bytes(build, harness_output):
    """Generic 8-lane vectors and -ffp-contract=off: the bits do not depend on the instruction set.
    The one exception is libm's tanhf under the soft cap: capped cases built for another machine
    may differ in their last bits (within the float64 bound, checked above); with the harness's own
    tanhf every byte is the same on every build."""
    own = "own tanhf" in build
    want, got = harness_output("native, own tanhf" if own else "native"), harness_output(build)
    assert got.keys() == want.keys()
    differ = {name for name in want if got[name] != want[name]}
    if own or not BUILDS[build][0] or platform.machine() in ("aarch64", "arm64"):
        assert differ == set()
        return
    capped = set()
    for c in _cases(want):
        if np.frombuffer(want[f"c{c}/cap_scale"], np.float32)[0] > 0:
            capped |= {name for name in want if name.startswith(f"c{c}/")}
    assert differ <= capped, sorted(differ - capped)
