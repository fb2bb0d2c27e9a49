"""The prefix cache's disk tier (edge_runtime/kv/prefix_store.py, prefix_tier.py): reused prefixes'
KV blocks survive a restart, read back bit for bit; a damaged or foreign file is refused; the store
keeps to its bound; erasing a user removes their blocks (and voids their queued writes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_runtime import SamplingParams
from edge_runtime.kv.block_pool import block_hash
from edge_runtime.kv.prefix_store import SUFFIX, PrefixStore, forget_stored_prefixes, owner_folder
from tests.engine.helpers import make_engine

SHAPE = (2, 2, 4, 1, 8)  # layers, k/v, block size, kv heads, head dim
BLOCK = 2 * 2 * 4 * 1 * 8 * 4  # float32 bytes


def _store(root: Path, limit: int = 1 << 20) -> PrefixStore:
    return PrefixStore(root, "model-a", SHAPE, "float32", limit)


def _block(store: PrefixStore, owner: str, tokens: list[int], parent: bytes | None = None, fill: int = 1) -> bytes:
    digest = block_hash(parent, tokens, "")
    assert store.save(owner, digest, parent, tokens, "", bytes([fill]) * BLOCK)
    return digest


def test_a_block_reads_back_as_written_in_a_new_store(tmp_path: Path) -> None:
    store = _store(tmp_path)
    digest = _block(store, "alice", [1, 2, 3, 4], fill=7)
    assert not store.save("alice", digest, None, [1, 2, 3, 4], "", b"x" * BLOCK)  # held already
    store.close()
    again = _store(tmp_path)  # a restart: the index comes from the folder
    assert again.holds("alice", digest) and not again.holds("bob", digest)
    block = again.load("alice", digest, BLOCK)
    assert block is not None and block.payload == bytes([7]) * BLOCK and block.tokens == [1, 2, 3, 4]
    assert again.load("bob", digest, BLOCK) is None
    # no user id is a name on disk, and a secret-like owner-only mode
    path = next(tmp_path.rglob(f"*{SUFFIX}"))
    assert "alice" not in str(path) and path.parent.name == owner_folder("alice")
    assert path.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("damage", ["payload", "tokens", "shape", "truncated"])
def test_a_damaged_or_foreign_file_is_refused_and_deleted(tmp_path: Path, damage: str) -> None:
    store = _store(tmp_path)
    digest = _block(store, "alice", [5, 6, 7, 8])
    store.flush()
    path = next(tmp_path.rglob(f"*{SUFFIX}"))
    data = bytearray(path.read_bytes())
    if damage == "payload":
        data[-1] ^= 0xFF
    elif damage == "tokens":
        data = bytearray(bytes(data).replace(b"[5,6,7,8]", b"[5,6,7,9]"))
    elif damage == "truncated":
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))
    if damage == "shape":
        store = PrefixStore(tmp_path, "model-a", (2, 2, 4, 2, 4), "float32", 1 << 20)
    assert store.load("alice", digest, BLOCK) is None
    assert not path.exists() and store.stats.refused_files == 1 and not store.holds("alice", digest)


def test_the_store_keeps_to_its_bound_dropping_the_least_recently_used(tmp_path: Path) -> None:
    store = _store(tmp_path / "s", limit=3 * (BLOCK + 400))
    first = _block(store, "alice", [1, 1, 1, 1])
    second = _block(store, "alice", [2, 2, 2, 2])
    store.flush()
    assert store.load("alice", first, BLOCK) is not None  # first is now the most recently used
    third = _block(store, "alice", [3, 3, 3, 3])
    fourth = _block(store, "alice", [4, 4, 4, 4])
    store.flush()
    assert store.nbytes <= store.limit_bytes and store.stats.evicted_blocks == 1
    assert not store.holds("alice", second)
    assert all(store.holds("alice", d) for d in (first, third, fourth))


def test_erasure_removes_the_owners_blocks_and_voids_their_queued_writes(tmp_path: Path) -> None:
    store = _store(tmp_path)
    kept = _block(store, "bob", [9, 9, 9, 9], fill=2)
    for i in range(20):
        _block(store, "alice", [i, i, i, i], fill=3)
    assert store.erase("alice") >= 0
    store.flush()
    assert not store.holds("alice", block_hash(None, [0, 0, 0, 0], ""))
    assert not (tmp_path / "model-a" / owner_folder("alice")).exists()
    assert store.holds("bob", kept)
    # byte for byte: nothing on disk holds alice's payload any more
    assert all(bytes([3]) * BLOCK not in p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    # blocks stored for another model (another weight format) go too
    other = PrefixStore(tmp_path, "model-b", SHAPE, "float32", 1 << 20)
    _block(other, "alice", [1, 2, 3, 4])
    other.flush()
    assert forget_stored_prefixes(tmp_path, "alice") == 1 and not other.folder.joinpath(owner_folder("alice")).exists()


def test_a_restarted_engine_reads_a_reused_prefix_back_and_answers_as_before(tiny_model_dir: Path, tmp_path: Path) -> None:
    store_dir = str(tmp_path / "prefix-cache")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    system = " ".join(f"word{i % 37}" for i in range(60))
    first = make_engine(tiny_model_dir, prefix_store_dir=store_dir)
    first.generate(system + " question one", params)
    warm = first.generate(system + " question two", params)  # a reuse: its blocks go to disk
    assert first.stats()["prefix_cache_hit_blocks"] > 0
    first.prefixes.store.flush()
    stored = first.stats()["prefix_store_blocks"]
    assert stored == first.stats()["prefix_cache_hit_blocks"]

    again = make_engine(tiny_model_dir, prefix_store_dir=store_dir)  # a restart
    after = again.generate(system + " question two", params)
    stats = again.stats()
    assert stats["prefix_store_restored_blocks"] == stored and stats["prefix_cache_hit_blocks"] == 0
    assert after[0].metrics.cached_prompt_tokens == stored * again.pool.block_size
    assert after[0].candidates[0].token_ids == warm[0].candidates[0].token_ids

    # Without the tier the same request computes its prefix again.
    cold = make_engine(tiny_model_dir).generate(system + " question two", params)
    assert cold[0].metrics.cached_prompt_tokens == 0

    # Erasure (requests without a user are the anonymous owner's): gone from the tier and the disk.
    assert again.prefixes.forget("") == (0, stored)  # the anonymous owner's blocks stay in memory
    assert not list(Path(store_dir).rglob(f"*{SUFFIX}"))


def test_an_erased_users_prefix_leaves_memory_and_apps_do_not_share_prefixes(tiny_model_dir: Path) -> None:
    """In memory (the disk tier off): after `forget`, the user's prompt prefix is computed again
    rather than served from the cache; and a request of another app's scope never hits blocks an
    app's requests left (a faster first token would tell it that app's prompt)."""
    engine = make_engine(tiny_model_dir)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    system = " ".join(f"word{i % 37}" for i in range(60))

    def cached(prompt: str, owner: str = "", scope: str = "") -> int:
        rid = engine.add_request(prompt, params, owner=owner, scope=scope)
        while True:
            for out in engine.step():
                if out.request_id == rid:
                    return out.metrics.cached_prompt_tokens

    assert cached(system + " one", owner="alice") == 0
    assert cached(system + " two", owner="alice") > 0
    in_memory, on_disk = engine.prefixes.forget("alice")
    assert in_memory > 0 and on_disk == 0
    assert cached(system + " three", owner="bob") == 0  # computed again: alice's blocks are gone
    assert cached(system + " four", owner="bob") > 0

    assert cached(system + " five", owner="carol", scope="app-b") == 0  # another app's scope
    assert cached(system + " six", owner="dave", scope="app-b") > 0  # its own app's prefix is shared
