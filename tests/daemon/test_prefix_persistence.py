"""Through a real `maced`: a user's reused prompt prefix survives a restart (read back from the
state dir instead of recomputed, same greedy answer), and erasing the user removes those blocks
from disk, checked byte for byte."""

from __future__ import annotations

import time
from pathlib import Path

from edge_runtime.kv.prefix_store import SUFFIX, owner_folder
from tests.daemon.conftest import DaemonProcess

SYSTEM = {"alice": " ".join(f"rule{i % 41} applies" for i in range(80)),
          "bob": " ".join(f"law{i % 23} holds" for i in range(80))}


def _ask(d: DaemonProcess, question: str, user: str) -> str:
    with d.client() as c:
        return c.generate(f"{SYSTEM[user]}. {question}", max_tokens=6, temperature=0.0, ignore_eos=True,
                          user=user).text


def _engine(d: DaemonProcess) -> dict:
    with d.client() as c:
        return c.status()["engine"]


def test_a_reused_prefix_survives_a_restart_and_leaves_with_its_user(tmp_path: Path, tiny_model: Path) -> None:
    root = tmp_path / "maced"
    root.mkdir()
    first = DaemonProcess(root, tiny_model)
    try:
        first.wait_ready()
        _ask(first, "first question?", "alice")
        warm = _ask(first, "second question?", "alice")  # the reuse: the prefix goes to disk
        _ask(first, "bob's question?", "bob")
        _ask(first, "bob's other question?", "bob")
        assert _engine(first)["prefix_cache_hit_blocks"] > 0
    finally:
        code, _ = first.stop()
    assert code == 0, first.log()
    store = root / "state" / "prefix-cache"
    alice_files = [p for p in store.rglob(f"*{SUFFIX}") if p.parent.name == owner_folder("alice")]
    bob_files = [p for p in store.rglob(f"*{SUFFIX}") if p.parent.name == owner_folder("bob")]
    assert alice_files, sorted(str(p.relative_to(store)) for p in store.rglob("*"))
    payloads = [p.read_bytes()[-4096:] for p in alice_files]  # a piece of each block's K/V bytes

    again = DaemonProcess(root, tiny_model)
    try:
        again.wait_ready()
        assert _ask(again, "second question?", "alice") == warm
        engine = _engine(again)
        assert engine["prefix_store_restored_blocks"] >= len(alice_files) and engine["prefix_cache_hit_blocks"] == 0
        with again.client() as c:
            erased = c.forget("alice")
        assert erased["prefix_blocks"] == len(alice_files)
        assert erased["prefix_blocks_in_memory"] >= len(alice_files)  # read back: in the slab too
        left = [p for p in (root / "state").rglob("*") if p.is_file()]
        assert not any(piece in p.read_bytes() for p in left for piece in payloads)
        assert bob_files and all(p.exists() for p in bob_files)  # nothing of bob's went
        # status reads the engine thread's snapshot, published every 0.5 s: wait for one after the erasure
        deadline = time.monotonic() + 10
        while _engine(again)["prefix_store_blocks"] != len(bob_files) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _engine(again)["prefix_store_blocks"] == len(bob_files)
    finally:
        code, _ = again.stop()
    assert code == 0, again.log()
