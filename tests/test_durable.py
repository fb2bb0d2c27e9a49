"""edge_runtime.durable: a crash (an error at any point before the rename) leaves the old file or
no folder, and no temporary; no module of edge_runtime/, trt_plugins/ or daemon/ renames or
fsyncs by hand."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

from edge_runtime import durable

ROOT = Path(__file__).resolve().parents[1]
HAND_WRITTEN_ALLOWED = {"edge_runtime/durable.py"}
FORBIDDEN_CALLS = {("os", "replace"), ("os", "rename"), ("os", "fsync"), ("os", "fdatasync")}


def test_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("old")
    durable.write_json(path, {"a": 1}, indent=1)
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_failure_before_the_rename_keeps_the_old_file_and_removes_the_temporary(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    path.write_text("old")

    def crash(src, dst):
        raise OSError("power cut")

    monkeypatch.setattr(durable.os, "replace", crash)
    with pytest.raises(OSError, match="power cut"):
        durable.write_text(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_failure_while_writing_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "engine.bin"
    path.write_bytes(b"old")

    def crash(fd):
        raise OSError("disk full")

    monkeypatch.setattr(durable.os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        durable.write_bytes(path, b"new")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["engine.bin"]


def test_the_data_and_the_folder_are_fsynced_before_and_after_the_rename(tmp_path, monkeypatch):
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(durable.os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(durable.os, "replace", lambda a, b: (events.append("rename"), real_replace(a, b))[1])
    durable.write_text(tmp_path / "x", "data")
    assert events == ["fsync", "rename", "fsync"]  # the file's data, the rename, the folder


def test_publish_directory_is_all_or_nothing(tmp_path):
    def fill(folder: Path) -> None:
        (folder / "a").write_text("1")
        (folder / "sub").mkdir()
        (folder / "sub" / "b").write_text("2")

    target = durable.publish_directory(tmp_path / "v1", fill)
    assert (target / "a").read_text() == "1" and (target / "sub" / "b").read_text() == "2"

    def half(folder: Path) -> None:
        (folder / "a").write_text("1")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        durable.publish_directory(tmp_path / "v2", half)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]
    with pytest.raises(durable.TargetExists):
        durable.publish_directory(tmp_path / "v1", fill)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]


def test_publish_directory_refuses_a_target_that_appears_during_the_write(tmp_path):
    def racing(folder: Path) -> None:
        (folder / "a").write_text("mine")
        (tmp_path / "v1").mkdir()
        (tmp_path / "v1" / "a").write_text("theirs")

    with pytest.raises(durable.TargetExists):
        durable.publish_directory(tmp_path / "v1", racing)
    assert (tmp_path / "v1" / "a").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["v1"]


def test_append_line_adds_whole_lines(tmp_path):
    log = tmp_path / "events.jsonl"
    durable.append_line(log, '{"n": 1}')
    durable.append_line(log, '{"n": 2}')
    assert log.read_text() == '{"n": 1}\n{"n": 2}\n'


def _hand_written_durability(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name) and (owner.id, node.func.attr) in FORBIDDEN_CALLS:
                found.append(f"{owner.id}.{node.func.attr} at line {node.lineno}")
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            names = {alias.name for alias in node.names}
            if names & {"replace", "rename", "fsync", "fdatasync"}:
                found.append(f"from os import {', '.join(sorted(names))} at line {node.lineno}")
    return found


def test_no_module_of_edge_runtime_or_the_daemon_renames_or_fsyncs_by_hand():
    offenders = {}
    packages = ("edge_runtime", "trt_plugins", "daemon")
    for path in sorted(p for package in packages for p in (ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in HAND_WRITTEN_ALLOWED and (found := _hand_written_durability(path)):
            offenders[rel] = found
    assert offenders == {}, f"write durable files through edge_runtime/durable.py: {offenders}"


def test_a_secret_is_owner_only_from_its_first_byte_whatever_the_umask(tmp_path, monkeypatch):
    seen = []
    real_fsync = durable.os.fsync

    def fsync(fd):  # the temporary, before the rename: already owner-only
        seen.append(os.stat(fd).st_mode & 0o777)
        real_fsync(fd)

    monkeypatch.setattr(durable.os, "fsync", fsync)
    old = os.umask(0)
    try:
        durable.write_bytes(tmp_path / "key", b"secret", mode=0o600)
        durable.write_text(tmp_path / "plain", "x")
    finally:
        os.umask(old)
    assert seen[0] == 0o600 and (tmp_path / "key").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "key").read_bytes() == b"secret"
    assert (tmp_path / "plain").stat().st_mode & 0o777 == 0o666  # no mode: the umask decides, as before
