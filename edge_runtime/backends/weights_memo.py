"""The digest of a loaded model's weights (`onnx_export.model_hash`: its export key, the prefix
store's and the self-check memo's), remembered by the identity of the files it was loaded from,
so a cached start does not read every weight to hash it again (1B: 2-3 s; 8B: 4.7 GB of pages).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge_runtime import durable

log = logging.getLogger(__name__)

MEMO_DIR = "weights-digests"
_DIGEST = re.compile(r"[0-9a-f]{32}")


def attach(model: Any, model_dir: Path, root: Path) -> None:
    """Tell `model_hash` where `model`'s digest is remembered: under `root`, keyed by each file
    of `model_dir` that loading reads (path, device, inode, size and modification time in ns, as
    the GGUF's hash is remembered in model.source: a rewritten file changes them), the dtype the
    weights were loaded in and this tree's code (the loader's conversions are part of the
    numbers). Call it right after loading, before anything changes a weight: the memo stands for
    the weights as loaded."""
    from edge_runtime.backends.check_memo import code_digest

    files = []
    for path in sorted(Path(model_dir).resolve().iterdir()):
        if path.is_file() and (path.suffix in (".safetensors", ".json") or path.name.endswith(".index.json")):
            st = path.stat()
            files.append([str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns])
    what = {"files": files, "dtype": str(model.dtype), "code": code_digest()}
    key = hashlib.blake2b(json.dumps(what).encode(), digest_size=16).hexdigest()
    model.digest_memo = Path(root) / MEMO_DIR / key


def remembered(model: Any, compute: Callable[[Any], str]) -> str:
    """`compute(model)`, read from the memo `attach` named when it is there, else computed and
    written to it (a model no loader attached computes every time)."""
    path = getattr(model, "digest_memo", None)
    if path is None:
        return compute(model)
    try:
        known = path.read_text().strip()
        if _DIGEST.fullmatch(known):
            return known
    except OSError:
        pass
    digest = compute(model)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        durable.write_text(path, digest + "\n")
    except OSError as exc:  # a read-only cache hashes again at the next start, nothing else
        log.warning("cannot remember the weights' digest in %s: %s", path, exc)
    return digest
