"""Where the runtime keeps its state (model cache, adapters, feedback database).

One place decides it: $MACE_STATE_DIR, else systemd's $STATE_DIRECTORY, else
$XDG_STATE_HOME/mace-edge (default ~/.local/state/mace-edge).
"""

from __future__ import annotations

import os
from pathlib import Path


def state_dir() -> Path:
    for var in ("MACE_STATE_DIR", "STATE_DIRECTORY"):
        value = os.environ.get(var)
        if value:
            # systemd may pass several colon-separated directories; the first is ours.
            return Path(value.split(":")[0]).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(xdg) / "mace-edge"


def models_dir() -> Path:
    return state_dir() / "models"
