"""A compiled one-pass de-quantisation for `Blocks` on CPU (qdequant.c, built once per machine with
the system's C compiler into the cache and loaded with ctypes), equal bit for bit to the torch
passes of `Blocks.dequantize`, which stay the path wherever it is unavailable or turned off."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

from edge_runtime import durable
from edge_runtime.paths import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qdequant.c")
ENV = "MACE_QKERNEL"  # "off": de-quantise with torch's passes only (the reference path)
# Weights each thread takes at least: a hand-off to a pool thread costs 10-50 us on a quiet machine
# and milliseconds on a loaded one (measured at load 8 on 2 cores), so only large weights split.
PARALLEL_MIN_ELEMENTS = 1 << 20
_FLAGS = ["-O3", "-ffp-contract=off", "-fPIC", "-shared"]
_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_int64, ctypes.c_int64,
         ctypes.c_void_p]
# dequant_hi (5/6-bit levels): the levels, their high bits, then as _ARGS with the high-bit count
# before the output.
_HI_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_int64,
            ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]


class KernelUnavailable(RuntimeError):
    """The compiled de-quantisation cannot be built or loaded here (no compiler, a read-only
    cache, another OS); callers fall back to torch."""


def switch_on(name: str) -> bool:
    """Whether the environment switch `name` (a kernel's A/B switch, on unless set to off/0/false/no)
    is on."""
    return os.environ.get(name, "on").lower() not in ("off", "0", "false", "no")


def enabled() -> bool:
    return switch_on(ENV)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built library, or None (logged once) where it cannot be had."""
    try:
        return _load()
    except KernelUnavailable as e:
        log.info("de-quantising with torch's passes: %s", e)
        return None


def _load() -> ctypes.CDLL:
    lib = build_library(SOURCE, _FLAGS)
    for name in ("dequant4", "dequant8u", "dequant8s", "dequant_hi"):
        getattr(lib, name).argtypes = _HI_ARGS if name == "dequant_hi" else _ARGS
        getattr(lib, name).restype = None
    for name in ("per_block_u8", "per_block_s8"):
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_void_p]
        getattr(lib, name).restype = None
    return lib


# Linked after the source (a library named before it resolves nothing): attention.c's tanhf and expf, the
# decoders' libm calls, resolved in the built library rather than left to whatever the process loaded.
_LIBS = ["-lm"]


def build_library(source_path: Path, flags: list[str], includes: tuple[Path, ...] = ()) -> ctypes.CDLL:
    """`source_path` built with the system's C compiler (once per source, the files it includes,
    compiler, machine and flags, into the cache) and loaded; KernelUnavailable where that cannot
    be done."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailable("no C compiler (cc/gcc) found")
    try:
        source = b"".join(p.read_bytes() for p in (source_path, *includes))
    except OSError as e:
        raise KernelUnavailable(f"{source_path.name} is not installed beside {Path(__file__).name}: {e}") from e
    # The machine's own instruction set: -march=native on x86 (AVX-512/AVX2), -mcpu=native on aarch64
    # (dotprod where the core has it, e.g. Jetson Orin); a compiler that refuses it builds without.
    native = {"x86_64": "-march=native", "AMD64": "-march=native", "aarch64": "-mcpu=native",
              "arm64": "-mcpu=native"}.get(platform.machine())
    flags = flags + ([native] if native else [])
    key = hashlib.sha256(source + " ".join([compiler, platform.machine(), platform.node()] + flags + _LIBS).encode())
    target = cache_dir() / "kernels" / f"{source_path.stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        with tempfile.TemporaryDirectory() as tmp:
            built = Path(tmp) / f"{source_path.stem}.so"
            tries = [flags, [f for f in flags if f != native]] if native else [flags]
            for i, attempt in enumerate(tries):
                try:
                    subprocess.run([compiler, *attempt, str(source_path), "-o", str(built), *_LIBS], check=True,
                                   capture_output=True, timeout=120)
                    break
                except (OSError, subprocess.SubprocessError) as e:
                    if i == len(tries) - 1:
                        raise KernelUnavailable(f"building {source_path.name} failed: {e}") from e
            try:
                target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                durable.write_bytes(target, built.read_bytes())
            except OSError as e:
                raise KernelUnavailable(f"cannot write {target}: {e}") from e
    _check_trusted(target)
    try:
        return ctypes.CDLL(str(target))
    except OSError as e:
        raise KernelUnavailable(f"cannot load {target}: {e}") from e


def _check_trusted(target: Path) -> None:
    """Loading a library runs its code: only one this user (or root) owns, in a folder and file
    nobody else may write, is loaded (a shared cache directory must not become code injection)."""
    uid = os.getuid()
    for path in (target.parent, target):
        st = path.stat()
        if st.st_uid not in (uid, 0) or st.st_mode & 0o022:
            raise KernelUnavailable(f"{path} is not trusted (owner uid {st.st_uid}, mode {oct(st.st_mode & 0o777)}): "
                                    "it must be this user's and writable by no one else")


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="qdequant")


def available(levels: Tensor) -> bool:
    return levels.device.type == "cpu" and enabled() and _library() is not None


def dequantize_into(out: Tensor, levels: Tensor, scales: Tensor, offsets: Tensor | None, zero: int,
                    bits: int, high: Tensor | None = None) -> None:
    """`out` (float32 [n, blocks, block], contiguous) = the blocks de-quantised (`Blocks`' layout:
    `high` holds 5- and 6-bit levels' upper bits); `scales` and `offsets` float32 [n, blocks].
    Rows are split over torch's intra-op thread count (ctypes releases the GIL for the call)."""
    lib = _library()
    if lib is None:
        raise KernelUnavailable("the compiled de-quantisation is not available")
    levels, scales = levels.contiguous(), scales.contiguous()
    offsets = None if offsets is None else offsets.contiguous()
    high = None if high is None else high.contiguous()
    fn = lib.dequant4 if bits == 4 else lib.dequant8s if levels.dtype == torch.int8 else lib.dequant8u
    n, blocks, width = levels.shape
    threads = max(1, min(torch.get_num_threads(), n, out.numel() // PARALLEL_MIN_ELEMENTS))

    def run(lo: int, hi: int) -> None:
        offset = None if offsets is None else offsets[lo].data_ptr()
        if high is not None:
            lib.dequant_hi(levels[lo].data_ptr(), high[lo].data_ptr(), scales[lo].data_ptr(), offset, float(zero),
                           (hi - lo) * blocks, width, bits - 4, out[lo].data_ptr())
            return
        fn(levels[lo].data_ptr(), scales[lo].data_ptr(), offset, float(zero), (hi - lo) * blocks, width,
           out[lo].data_ptr())

    if threads == 1:
        run(0, n)
        return
    step = -(-n // threads)
    # The calling thread takes the first range itself: one pool hand-off fewer per weight (each
    # costs milliseconds on a loaded machine).
    futures = [_pool(threads - 1).submit(run, lo, min(n, lo + step)) for lo in range(step, n, step)]
    try:
        run(0, min(n, step))
    finally:
        for f in futures:
            f.result()


def per_block(base: Tensor, steps: Tensor) -> Tensor:
    """float32 [n, blocks] = each group's scale (`base` [n, groups]) times its blocks' steps
    (uint8 or int8 [n, blocks]): `qweights._per_block`'s product, bit for bit, in one pass."""
    lib = _library()
    if lib is None:
        raise KernelUnavailable("the compiled de-quantisation is not available")
    n, groups = base.shape
    base, steps = base.float().contiguous(), steps.contiguous()
    out = torch.empty(steps.shape, dtype=torch.float32)
    fn = lib.per_block_s8 if steps.dtype == torch.int8 else lib.per_block_u8
    fn(base.data_ptr(), steps.data_ptr(), n * groups, steps.shape[1] // groups, out.data_ptr())
    return out
