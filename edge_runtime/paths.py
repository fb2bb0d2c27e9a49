"""Where the runtime keeps its state (adapters, feedback database, cost calibration) and its
shared cache (the model, exported graphs).

One place decides them: state: $MACE_STATE_DIR, else systemd's $STATE_DIRECTORY, else
$XDG_STATE_HOME/mace-edge (default ~/.local/state/mace-edge); cache: `cache_dir()`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

# Owner only: user data, adapters trained on it, and everything beside them in the state dir.
PRIVATE_UMASK = 0o077


def state_dir() -> Path:
    for var in ("MACE_STATE_DIR", "STATE_DIRECTORY"):
        value = os.environ.get(var)
        if value:
            # systemd may pass several colon-separated directories; the first is ours.
            return Path(value.split(":")[0]).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(xdg) / "mace-edge"


def cache_dir() -> Path:
    """Downloads and builds that any state directory may share and that can be made again (the
    model cache, exported graphs), like HF_HOME: $MACE_CACHE_DIR, else systemd's
    $CACHE_DIRECTORY, else $XDG_CACHE_HOME/mace-edge (default ~/.cache/mace-edge)."""
    for var in ("MACE_CACHE_DIR", "CACHE_DIRECTORY"):
        value = os.environ.get(var)
        if value:
            return Path(value.split(":")[0]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "mace-edge"


def models_dir() -> Path:
    """The shared model cache: a new state directory does not fetch or convert again."""
    return cache_dir() / "models"


def legacy_models_dirs() -> list[Path]:
    """Where the model cache lived before it was shared (<state dir>/models, this one's and the
    default state dir's): still read, so an upgraded device does not fetch again."""
    xdg = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    dirs = [state_dir() / "models", Path(xdg) / "mace-edge" / "models"]
    return [d for i, d in enumerate(dirs) if d not in dirs[:i]]


def make_private(root: Path) -> int:
    """Keep the state directory the owner's alone, whatever umask the process was started with:
    new files are created 0600 / folders 0700 from now on (the process umask becomes 077), and
    group and other bits are stripped from everything already under `root` (an older install, a
    copy). Links and sockets are left alone. Returns how many modes changed."""
    os.umask(PRIVATE_UMASK)
    changed = 0
    if not root.exists():
        return 0
    for folder, dirs, files in os.walk(root):
        for path in (folder, *(os.path.join(folder, name) for name in (*dirs, *files))):
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode) or stat.S_ISSOCK(info.st_mode) or not info.st_mode & 0o077:
                continue
            os.chmod(path, stat.S_IMODE(info.st_mode) & 0o700)
            changed += 1
    return changed
