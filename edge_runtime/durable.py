"""Writes that survive a crash or a power cut: a file or a whole folder appears under its name
complete, or not at all (the old file stays), and the rename that publishes it is itself on disk.
Standard library only: the daemon's torch-free side uses it too.

The recipe every caller shares: write into a temporary name beside the target (the same
filesystem, so the rename is atomic), flush and fsync the data, rename, then fsync the folder
that holds the name.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any


class TargetExists(FileExistsError):
    """`publish_directory` found its target already there (versions are immutable; another
    writer may have won the race)."""


def fsync_file(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Make the names in a folder durable (a rename, a new file). Best effort: some filesystems
    (and Windows) refuse to open or fsync a folder, and there the rename is all one gets."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temp_name(path: Path, prefix: str = ".") -> Path:
    return path.parent / f"{prefix}{path.name}.{secrets.token_hex(4)}.tmp"


def write_bytes(path: str | Path, data: bytes, mode: int | None = None) -> None:
    """Replace `path` with `data` atomically and durably; on any failure the old file (if any)
    is untouched and no temporary file is left. `mode` (e.g. 0o600 for a secret) is the file's
    permission from its first byte on, whatever the umask: a secret is never readable by others,
    not even as the temporary."""
    path = Path(path)
    tmp = _temp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
        if mode is not None:
            os.fchmod(fd, mode)  # the umask may have taken bits the caller asked for
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text(path: str | Path, text: str, encoding: str = "utf-8", mode: int | None = None) -> None:
    write_bytes(path, text.encode(encoding), mode=mode)


def write_json(path: str | Path, obj: Any, **dumps: Any) -> None:
    """`obj` as JSON (`dumps`: json.dumps's keyword arguments, e.g. indent)."""
    write_text(path, json.dumps(obj, **dumps))


def append_line(path: str | Path, line: str, encoding: str = "utf-8") -> None:
    """Append one line (a newline is added) to a log and fsync it; the folder too when this
    created the file. A crash mid-append can leave a partial last line."""
    path = Path(path)
    created = not path.exists()
    with open(path, "a", encoding=encoding) as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())
    if created:
        fsync_dir(path.parent)


def publish_directory(target: str | Path, fill: Callable[[Path], None], temp_prefix: str = ".tmp-") -> Path:
    """Create the folder `target` complete or not at all: `fill(tmp)` writes into a fresh folder
    beside it named `temp_prefix + target.name + '-' + hex` (callers sweep that prefix after a
    crash), every file under it is fsynced, it is renamed to `target` and the parent fsynced.

    Raises TargetExists when `target` is already there (before or at the rename); on any failure
    the temporary folder is removed."""
    target = Path(target)
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        raise TargetExists(f"{target} already exists")
    tmp = parent / f"{temp_prefix}{target.name}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        fill(tmp)
        for folder, _, files in os.walk(tmp):
            for name in files:
                fsync_file(Path(folder) / name)
            fsync_dir(folder)
        try:
            os.rename(tmp, target)  # atomic on POSIX; refused when a non-empty target appeared meanwhile
        except OSError as exc:
            if target.exists():
                raise TargetExists(f"{target} already exists") from exc
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(parent)
    return target


def fsync_tree(directory: str | Path) -> None:
    """fsync every file under `directory` and each folder of it (before a rename publishes it)."""
    for folder, _, files in os.walk(directory):
        for name in files:
            fsync_file(Path(folder) / name)
        fsync_dir(folder)


def replace_directory(new: str | Path, target: str | Path) -> None:
    """Put the complete folder `new` (already fsynced) in the place of `target`, which may exist:
    the old one is renamed aside, the new one renamed in, the parent fsynced, then the old one
    removed. A crash between the two renames leaves the old copy under a hidden name beside it
    (callers that own the parent sweep those)."""
    new, target = Path(new), Path(target)
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.rename(target, old)
    os.rename(new, target)
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
