"""The GPU kernels compile, on a machine with no GPU, for the GPUs this project runs on: sm_90
(H100, H200) and sm_87 (Jetson AGX Orin). `triton.compile` (Triton's own LLVM and bundled ptxas)
over exactly the launches decode, prefill and embedding build, so a kernel that the interpreter
runs but the compiler refuses cannot reach a GPU. In a fresh process: Triton's interpreter patches
`triton.language` for the rest of the process it runs in (the other kernel tests)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
_TYPES = {torch.uint8: "*u8", torch.int8: "*i8", torch.float16: "*fp16", torch.bfloat16: "*bf16",
          torch.float32: "*fp32", torch.int64: "*i64"}
# (target, format, N, K, rows, dtype, split, gemv): decode in bfloat16 with a split K (and the
# kernel adding its partial sums) and without, each format, float32 rows, the Orin's decode, and
# a single bfloat16 row through the GEMV (the bench's comparison).
MATMULS = [(90, "q4_k", 3072, 2048, 16, "bfloat16", 4, False), (90, "q6_k", 2048, 8192, 1, "bfloat16", 1, False),
           (90, "q8_0", 16384, 2048, 4, "float32", 1, False), (87, "q4_k", 2048, 2048, 1, "bfloat16", 1, False),
           (90, "q4_k", 2048, 2048, 1, "bfloat16", 1, True)]
# (target, format, through an index): an embedding's rows (prefill's and the backward's chunks
# are the same kernel without the index).
DEQUANTS = [(90, "q6_k", True)]


def _compile(launch, arch: int, num_warps: int) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, _grid, args, consts = launch
    values = [*args, *(consts[n] for n in kernel.arg_names[len(args):])]
    signature = {name: ("constexpr" if name in consts else
                        _TYPES[value.dtype] if isinstance(value, torch.Tensor) else "i32")
                 for name, value in zip(kernel.arg_names, values, strict=True)}
    compiled = triton.compile(ASTSource(kernel, signature, consts), target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps})
    assert compiled.asm["cubin"]


def compile_all() -> list[str]:
    """Compiles every case (run in a fresh process without TRITON_INTERPRET); their names."""
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_qweights_cuda import random_blocks

    from edge_runtime.model import qweights_cuda as kernels

    done = []
    for arch, fmt, n, k, rows, dtype_name, split, gemv in MATMULS:
        dtype = getattr(torch, dtype_name)
        x, out = torch.empty(rows, k, dtype=dtype), torch.empty(rows, n, dtype=dtype)
        launches = kernels.matmul_launches(x, random_blocks(fmt, n, k, "cpu"), out, torch.empty(n, dtype=dtype),
                                           split=split, interpreted=False, gemv=gemv)
        assert len(launches) == (2 if split > 1 else 1)
        for launch in launches:
            _compile(launch, arch, kernels.NUM_WARPS)
        done.append(f"sm{arch} matmul {fmt} {rows} rows {dtype_name} split {split}{' gemv' if gemv else ''}")
    for arch, fmt, indexed in DEQUANTS:
        index = torch.zeros(4, dtype=torch.int64) if indexed else None
        out = torch.empty(4 if indexed else 64, 2048, dtype=torch.bfloat16)
        _compile(kernels.dequantize_launch(random_blocks(fmt, 64, 2048, "cpu"), out, index, interpreted=False), arch,
                 kernels.NUM_WARPS)
        done.append(f"sm{arch} dequantize {fmt}{' rows by index' if indexed else ''}")
    return done


def test_the_kernels_compile_for_the_gpus(tmp_path):
    spec = importlib.util.find_spec("triton")
    if spec is None:
        pytest.skip("triton is not installed")
    if not (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton has no bundled ptxas to compile for NVIDIA targets")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path / "cache"))  # compiled here, not found
    code = "import json, tests.model.test_qweights_cuda_compile as t; print(json.dumps(t.compile_all()))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(json.loads(done.stdout.splitlines()[-1])) == len(MATMULS) + len(DEQUANTS)
