"""The decode stack (gguf_native_stack.c) as other machines build it: gguf_stack_harness.c, built
natively and for aarch64 (armv8-a, Orin's cortex-a78ae; run under qemu) with kv/attention.c linked
beside it, gives every layer of a decode step in one call the bits of the per-layer calls, adapter rows'
LoRA terms (gguf_native_lora.c) included."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import numpy as np
import pytest

from edge_runtime.kv import attention_kernel
from edge_runtime.model import gguf_kernel
from tests.cross_builds import NATIVE, ORIN, compiler, run

HARNESS = Path(__file__).with_name("gguf_stack_harness.c")
BUILDS = {"native": (False, NATIVE), "armv8-a": (True, "-march=armv8-a"), "cortex-a78ae": (True, ORIN)}
M, HIDDEN, LAYERS, SLOTS, KV_SIZE = 3, 256, 2, 32, 128  # the harness's sizes


@pytest.fixture(scope="module")
def stack_output(tmp_path_factory):
    """build name -> (stack's x, per-layer x, caches [stack, per-layer][layer][k, v]), built and run
    once; skips where the compiler or qemu the build needs is missing."""
    where = tmp_path_factory.mktemp("gguf-stack-builds")

    @functools.cache
    def build(name: str):
        arm, target = BUILDS[name]
        cc = compiler(arm)
        obj, exe, out = where / f"attention-{name}.o", where / f"stack-{name}", where / f"{name}.bin"
        # each source with its own module's runtime flags, as two libraries (no -shared: one executable)
        own = lambda flags: [f for f in flags if f != "-shared"] + [target]  # noqa: E731
        subprocess.run([cc, *own(attention_kernel._FLAGS), "-c", str(attention_kernel.SOURCE), "-o", str(obj)],
                       check=True, capture_output=True, timeout=300)
        subprocess.run([cc, *own(gguf_kernel._FLAGS), "-I", str(gguf_kernel.SOURCE.parent), str(HARNESS), str(obj),
                        "-o", str(exe), "-lm"], check=True, capture_output=True, timeout=300)
        run(arm, exe, str(out))
        data = np.fromfile(out, np.float32)
        n = M * HIDDEN
        assert data.size == 2 * n + 2 * LAYERS * 2 * SLOTS * KV_SIZE
        return data[:n], data[n : 2 * n], data[2 * n :].reshape(2, LAYERS, 2, SLOTS * KV_SIZE)

    return build


@pytest.mark.parametrize("build", BUILDS)
def test_the_stack_is_the_per_layer_calls_bit_for_bit(build, stack_output):
    stacked, layered, caches = stack_output(build)
    assert np.isfinite(stacked).all() and np.abs(stacked).max() > 0
    assert np.array_equal(stacked.view(np.int32), layered.view(np.int32))
    assert np.array_equal(caches[0].view(np.int32), caches[1].view(np.int32))  # the same keys and values written


@pytest.mark.parametrize("build", [b for b in BUILDS if b != "native"])
def test_the_stack_on_aarch64_is_the_native_one_up_to_the_products_rounding(build, stack_output):
    """The GGUF products sum in the instruction set's order (AVX-512 against NEON: bounded, not bit
    for bit; tests/model/test_gguf_kernel.py), so two layers agree to float32 rounding (2e-7 of the
    largest value measured), not in every bit; a wrong layout or a miscompile would be far off."""
    native, arm = stack_output("native")[0], stack_output(build)[0]
    assert np.abs(arm - native).max() <= 1e-5 * np.abs(native).max()
