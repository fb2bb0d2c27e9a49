"""The model cache's files: a manifest of every file with its size and hash, the check that a
cache is complete, the lock that keeps two processes from building one model at once, and the
directory swap that puts a finished cache in place.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 2  # 2: BOS/EOS/UNK/PAD from the GGUF metadata
# Format-1 caches are kept when their tokenizer's EOS is one the config names: some were
# converted by a transformers release that read the GGUF's EOS wrong (5.17), most were not.
BLOCKS_FORMAT = 4  # a GGUF kept as its quantised blocks (block_cache); older releases ignore it
# 3: blocks with a byte per 5/6-bit level (block_cache's "mace-blocks-2"): not read, so rebuilt.
# A GGUF served from its own file (engine.torch_weights = "gguf"): config, tokenizer and the
# source's path and size in the manifest; no weights are written.
IN_PLACE_FORMAT = 5
READABLE_FORMATS = (1, MANIFEST_FORMAT, BLOCKS_FORMAT, IN_PLACE_FORMAT)


def _check_cache(cache: Path, verify: bool) -> dict | None:
    """The manifest if every file it lists is there with its size (and hash, with `verify`)."""
    try:
        manifest = json.loads((cache / MANIFEST_NAME).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("ignoring unreadable manifest in %s: %s", cache, exc)
        return None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (
        not isinstance(files, dict)
        or manifest.get("format") not in READABLE_FORMATS
        or "config.json" not in files
    ):
        logger.warning("ignoring %s: manifest of an unknown format", cache)
        return None
    if manifest["format"] == IN_PLACE_FORMAT and not _source_unchanged(manifest):
        logger.warning("rebuilding %s: the GGUF it reads in place is gone or resized", cache)
        return None
    if manifest["format"] == 1 and not _eos_agrees(cache):
        logger.warning("rebuilding %s: its tokenizer's end-of-sequence token is not the model's", cache)
        return None
    for file_name, entry in files.items():
        path = cache / file_name
        size = entry.get("size") if isinstance(entry, dict) else None
        if not path.is_file() or path.stat().st_size != size:
            logger.warning("cache %s is incomplete: %s missing or resized", cache, file_name)
            return None
        if verify and _sha256(path) != entry.get("sha256"):
            logger.warning("cache %s is corrupt: %s fails its sha256", cache, file_name)
            return None
    return manifest


def _source_unchanged(manifest: dict) -> bool:
    source = Path(str(manifest.get("source", {}).get("path", "")))
    return source.is_file() and source.stat().st_size == manifest.get("gguf_size")


def in_place_source(cache: Path) -> Path | None:
    """The GGUF a cache of IN_PLACE_FORMAT reads its weights from; None for any other cache."""
    try:
        manifest = json.loads((Path(cache) / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != IN_PLACE_FORMAT:
        return None
    return Path(manifest["source"]["path"])


def _eos_agrees(cache: Path) -> bool:
    """Whether the cached tokenizer's EOS token is one of the config's `eos_token_id`s (plain
    JSON reads: no tokenizer is built)."""
    try:
        eos = json.loads((cache / "tokenizer_config.json").read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        tokenizer = json.loads((cache / "tokenizer.json").read_text())
        wanted = json.loads((cache / "config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return False
    ids = {t.get("content"): t.get("id") for t in tokenizer.get("added_tokens", [])}
    ids.update((tokenizer.get("model") or {}).get("vocab") or {})
    wanted = set(wanted) if isinstance(wanted, list) else {wanted}
    return eos is not None and ids.get(eos) in wanted


@contextlib.contextmanager
def _exclusive(models: Path, name: str) -> Iterator[None]:
    """Hold `<models>/.<name>.lock` so two processes never convert the same model at once."""
    models.mkdir(parents=True, exist_ok=True)
    with open(models / f".{name}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another process is preparing %s; waiting for it", name)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            # With the lock held, leftovers of a crashed run of this model are nobody's.
            for stale in models.glob(f".{name}.*-*"):
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


PROGRESS_EVERY_S = 15.0


def _sha256(path: Path) -> str:
    """The file's sha256, logging how far it got every PROGRESS_EVERY_S: an 8B GGUF read cold
    takes minutes, and `macectl status` says only "loading" meanwhile."""
    digest, done = hashlib.sha256(), 0
    started = last = time.monotonic()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
            done += len(chunk)
            if time.monotonic() - last >= PROGRESS_EVERY_S:
                last = time.monotonic()
                size = max(path.stat().st_size, 1)
                logger.info("hashing %s: %.0f of %.0f MiB (%.0f%%) in %.0f s", path.name, done / 2**20,
                            size / 2**20, 100 * done / size, last - started)
    return digest.hexdigest()


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("transformers", "gguf", "torch", "tokenizers", "safetensors"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "absent"
    return found
