"""The torch-free boundary: every module of `daemon.wire` and `daemon.sdk` (with `macectl`) imports
in a fresh interpreter without pulling in the engine or any compute library, so an app can use the
SDK on a machine that has none of them."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import daemon.sdk
import daemon.wire
from tests.daemon.conftest import REPO

# Compute and model libraries, the runtime itself, and the server-side stacks: none may load
# with the SDK. numpy is allowed only once adapter tensors are converted (imported there, lazily).
FORBIDDEN = ("torch", "transformers", "tokenizers", "safetensors", "onnx", "onnxruntime", "peft", "trl",
             "accelerate", "llguidance", "numpy", "flwr", "edge_runtime", "starlette", "uvicorn", "pydantic",
             "psutil", "cryptography")


def torch_free_modules() -> list[str]:
    names = []
    for package in (daemon.wire, daemon.sdk):
        names.append(package.__name__)
        names += [m.name for m in pkgutil.iter_modules(package.__path__, package.__name__ + ".")]
    return sorted(names)


def test_the_boundary_covers_the_wire_the_sdk_and_macectl() -> None:
    names = torch_free_modules()
    assert {"daemon.wire.frames", "daemon.wire.ops", "daemon.wire.tensors", "daemon.sdk.client",
            "daemon.sdk.async_client", "daemon.sdk.ops", "daemon.sdk.cli"} <= set(names)


@pytest.mark.parametrize("module", torch_free_modules())
def test_module_imports_without_torch_or_compute_libraries(module: str) -> None:
    code = (f"import sys, {module}; loaded = [m for m in {FORBIDDEN!r} "
            "if m in sys.modules or any(k.startswith(m + '.') for k in sys.modules)]; print(','.join(loaded))")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "", f"{module} imports {run.stdout.strip()}"
