"""A GGUF given by path is hashed once to find its model cache; later starts take the hash from
a memo keyed by the file's identity (path, inode, size, mtime), and a changed file is hashed anew."""

from __future__ import annotations

import hashlib
import os

from edge_runtime.model import source


def test_a_file_is_hashed_once_and_again_when_it_changes(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 100)
    models = tmp_path / "models"
    calls = []
    real = source._sha256
    monkeypatch.setattr(source, "_sha256", lambda p: calls.append(p) or real(p))
    want = hashlib.sha256(path.read_bytes()).hexdigest()
    assert source._known_sha256(path, models) == want
    assert source._known_sha256(path, models) == want and len(calls) == 1
    path.write_bytes(b"GGUF" + b"\1" * 100)
    os.utime(path, ns=(1, 1))  # a different modification time, whatever the clock's resolution
    assert source._known_sha256(path, models) == hashlib.sha256(path.read_bytes()).hexdigest()
    assert len(calls) == 2
