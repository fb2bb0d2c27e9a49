"""Device and dtype choice: CUDA when present (Jetson's integrated GPU included), else CPU;
bf16 on CPUs with native bf16 dot products (AVX512-BF16 / AMX), where it measured faster than
fp32 for this workload (see README, performance), fp32 on other CPUs."""

from __future__ import annotations

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
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    try:
        dtype = _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16") from None
    if dtype is torch.float16 and device.type == "cpu":
        raise ValueError("float16 on CPU is slow and inaccurate here; use bfloat16 or float32")
    return dtype
