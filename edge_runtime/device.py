"""Device and dtype choice: CUDA when present (Jetson's integrated GPU included), else CPU;
bf16 on CPUs with native bf16 dot products (AVX512-BF16 / AMX) whose bf16 GEMMs compute a row
the same way whatever the batch, where it measured faster than fp32 for this workload (see
README, performance); fp32 on other CPUs."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def cpu_has_fast_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


@functools.cache
def cpu_bf16_rows_invariant() -> bool:
    """Whether this CPU's bf16 GEMMs give a row the same bits whatever the number of rows.

    The engine's greedy output must not depend on what runs beside a request (docs/architecture.md,
    decision 5). oneDNN's AVX512-BF16 kernels keep that (with `linear()` never multiplying a lone
    row); its AMX kernels block the rows differently with the batch size, so a row's rounding
    changes with its neighbours (measured on a Sapphire Rapids-class Xeon: 16 rows of a 576x3072
    projection differ from the same rows among 128) and greedy tokens drift. Capping oneDNN below
    AMX restores the bits but made prefill GEMMs over 10x slower there, so such a CPU serves fp32.
    Probed once per process on projection shapes of the default model; a few milliseconds."""
    from edge_runtime.model.llama import linear  # the engine's row-invariant wrapper

    gen = torch.Generator().manual_seed(0)
    for n, k in ((3072, 576), (576, 1536), (576, 576)):
        weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        rows = torch.randn(128, k, generator=gen).to(torch.bfloat16)
        with torch.no_grad():
            full = linear(rows, weight)
            for m in (1, 2, 5, 16, 33, 64):
                if not torch.equal(linear(rows[:m], weight), full[:m]):
                    return False
    return True


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    return device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() and cpu_bf16_rows_invariant() else torch.float32
    try:
        dtype = _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16") from None
    if dtype is torch.float16 and device.type == "cpu":
        raise ValueError("float16 on CPU is slow and inaccurate here; use bfloat16 or float32")
    return dtype
