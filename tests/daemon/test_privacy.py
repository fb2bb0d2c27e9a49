"""User ids stay out of the daemon's log (keyed pseudonyms), and the state dir stays private."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from daemon.privacy import LogPseudonyms
from edge_runtime.paths import make_private


def test_pseudonyms_are_stable_per_state_dir_keyed_and_private(tmp_path: Path) -> None:
    first = LogPseudonyms.from_state_dir(tmp_path / "state")
    again = LogPseudonyms.from_state_dir(tmp_path / "state")
    other = LogPseudonyms.from_state_dir(tmp_path / "elsewhere")
    assert first.tag("alice") == again.tag("alice") != other.tag("alice")
    assert first.tag("alice") != first.tag("bob") and "alice" not in first.tag("alice")
    assert stat.S_IMODE((tmp_path / "state" / "log-key").stat().st_mode) == 0o600
    assert first.scrub("adapter alice@3 of user 'alice' failed", "alice") == (
        f"adapter {first.tag('alice')}@3 of user '{first.tag('alice')}' failed")
    assert first.adapter("alice", 3) == f"{first.tag('alice')}@3"


def test_make_private_strips_group_and_other_bits_and_sets_a_private_umask(tmp_path: Path) -> None:
    previous = os.umask(0o022)
    try:
        root = tmp_path / "state"
        (root / "adapters" / "u").mkdir(parents=True)
        (root / "adapters" / "u" / "adapter_config.json").write_text("{}")
        (root / "events.jsonl").write_text("")
        outside = tmp_path / "outside.txt"
        outside.write_text("not ours to change")
        (root / "link").symlink_to(outside)
        assert make_private(root) == 5  # three folders, two files; the link is left alone
        (root / "new.txt").write_text("x")
        (root / "newdir").mkdir()
        assert os.umask(0o022) == 0o077
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")] if not p.is_symlink()}
    assert all(mode & 0o077 == 0 for mode in modes.values()), modes
    assert modes["new.txt"] == 0o600 and modes["newdir"] == 0o700
    assert stat.S_IMODE(outside.stat().st_mode) == 0o644  # behind a link, outside the root: untouched
