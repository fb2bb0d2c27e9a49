"""The auto backend's self-check verdicts, remembered by everything the check depended on, so a
cached start or a keep-alive reload does not run it again (37 s of a 1B start at load ~16).
Owns the key and the memo files (<onnx cache>/self-checks); not the check itself (auto.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import platform
import sys
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from edge_runtime import durable

log = logging.getLogger(__name__)

MEMO_VERSION = 1
MEMO_DIR = "self-checks"
# What the verdict also depends on beyond this tree's code: the libraries that compute either side.
PACKAGES = ("torch", "onnxruntime", "onnxruntime-gpu", "onnx", "numpy", "tensorrt")
_CODE_ROOT = Path(__file__).resolve().parents[1]  # the edge_runtime package


@dataclass(frozen=True)
class CheckMemo:
    """Where the verdict for one (graph, weights, backend, check, software, machine) is kept."""

    path: Path | None  # None: nothing is remembered (no cache directory)
    what: dict[str, Any]  # the key's parts, written beside the verdict for a reader

    def recall(self) -> tuple[dict[str, Any], str] | None:
        """The remembered check's fields and when it ran, if this exact combination was checked
        before."""
        if self.path is None or not self.path.is_file():
            return None
        try:
            data = json.loads(self.path.read_text())
            if data.get("version") != MEMO_VERSION or data.get("what") != self.what:
                return None
            return dict(data["check"]), str(data.get("checked_at", "?"))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable self-check memo %s: %s", self.path, exc)
            return None

    def remember(self, check: dict[str, Any]) -> None:
        if self.path is None:
            return
        record = {"version": MEMO_VERSION, "checked_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                  "what": self.what, "check": check}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            durable.write_json(self.path, record, indent=1)
        except OSError as exc:  # a read-only cache costs a self-check at the next start, nothing else
            log.warning("cannot remember the self-check in %s: %s", self.path, exc)


def check_memo(root: Path | None, backend: Any, model: Any, weights: str, quantization: str,
               settings: dict[str, Any], prompts: list[list[int]]) -> CheckMemo:
    """The memo for checking `backend` (its graph, when it runs one) over `model`'s weights
    (`weights`: their digest) with these check `settings` on `prompts`. Anything that could change
    the verdict is in the key: a change to any of it checks again."""
    graph = getattr(backend, "model_path", None)
    providers = getattr(backend, "providers", None)
    what = {
        "backend": backend.name,
        "graph": Path(graph).parent.name if graph is not None else None,
        "providers": repr(providers) if providers is not None else None,
        "weights": weights,
        "quantization": quantization,
        "device": str(model.device),
        "dtype": str(model.dtype),
        "check": settings,
        "prompts": hashlib.blake2b(repr(prompts).encode(), digest_size=8).hexdigest(),
        "code": code_digest(),
        "packages": package_versions(),
        "python": sys.version.split()[0],
        "machine": f"{platform.machine()}/{cpu_name()}",
    }
    key = hashlib.blake2b(json.dumps(what, sort_keys=True).encode(), digest_size=12).hexdigest()
    return CheckMemo(None if root is None else Path(root) / MEMO_DIR / f"{backend.name}-{key}.json", what)


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """This tree's runtime code (every .py and .c under edge_runtime, ~1 MB: ~10 ms): the
    export, the step inputs, the kernels and the torch reference all live there, and a change to
    any of them must meet the check again, release or not. Read once per process (the weights'
    memo and the self-check's both key on it, at every start and keep-alive reload): the code
    running is the code the process imported."""
    h = hashlib.blake2b(digest_size=12)
    for path in sorted(_CODE_ROOT.rglob("*")):
        if path.suffix in (".py", ".c") and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(_CODE_ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def package_versions() -> dict[str, str]:
    found = {}
    for package in PACKAGES:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            continue
    return found


def cpu_name() -> str:
    """Kernels differ by instruction set (AVX2, AVX-512, NEON), so a cache directory shared by two
    machines keeps a verdict for each."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model", "Hardware")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
