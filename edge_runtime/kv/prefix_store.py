"""The prefix cache's disk tier: full KV blocks of prefixes that were reused, kept per owner under
the state directory so a restart starts warm; checked on read, bounded in bytes, erased with the
user they belong to. Files and a writer thread only; `kv/prefix_tier.py` joins it to the slab.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import shutil
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from edge_runtime import durable
from edge_runtime.kv.block_pool import block_hash

log = logging.getLogger(__name__)

FORMAT = 1
MAGIC = b"MACEKV1\n"
SUFFIX = ".kvb"
ANONYMOUS = "_anonymous"  # requests that name no user (tools, tests, the self-check)
_HEADER_LEN = struct.Struct("<I")


def owner_folder(owner: str) -> str:
    """A user's folder name: a digest, so no user id (personal data) is a name on disk and no id
    can spell a path."""
    if not owner:
        return ANONYMOUS
    return hashlib.blake2b(owner.encode(), digest_size=16, person=b"mace-prefix").hexdigest()


@dataclass
class StoredBlock:
    """One block as read back: what the slab's block gets, and what it was computed from."""

    parent: bytes | None
    tokens: list[int]
    salt: str
    payload: bytes


@dataclass
class StoreStats:
    written_blocks: int = 0
    restored_blocks: int = 0
    refused_files: int = 0  # failed a check on read and were deleted
    evicted_blocks: int = 0  # over the byte bound
    dropped_writes: int = 0  # the writer's queue was full


class PrefixStore:
    """`<root>/<model key>/<owner folder>/<block hash>.kvb`. A file holds a JSON header (format,
    hash, parent, salt, token ids, shape, dtype, payload digest) and the block's raw K/V bytes."""

    def __init__(self, root: str | Path, model_key: str, block_shape: Sequence[int], dtype: str,
                 limit_bytes: int, queue_blocks: int = 4096) -> None:
        self.folder = Path(root) / model_key
        self.block_shape = [int(n) for n in block_shape]
        self.dtype = dtype
        self.limit_bytes = limit_bytes
        self.stats = StoreStats()
        self._lock = threading.Lock()  # the index, the byte count, and a write against an erasure
        # (owner folder, hash) -> bytes on disk, least recently used first.
        self._index: OrderedDict[tuple[str, bytes], int] = OrderedDict()
        self._bytes = 0
        self._epoch: dict[str, int] = {}  # an owner's erasures so far: queued writes of before are void
        self._queue: queue.Queue[tuple[str, int, bytes, bytes] | None] = queue.Queue(maxsize=queue_blocks)
        self._pending: set[tuple[str, bytes]] = set()
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="prefix-store", daemon=True)
        self._writer.start()
        atexit.register(self.flush)  # a daemon that stops cleanly leaves every queued block on disk

    # -- the index ------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Index what an earlier run left (names and sizes only; contents are checked on read),
        oldest access first, and remove temporaries a crash left behind."""
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        found = []
        for owner_dir in self.folder.iterdir():
            if not owner_dir.is_dir():
                continue
            for path in owner_dir.iterdir():
                if path.name.startswith("."):
                    path.unlink(missing_ok=True)
                    continue
                try:
                    digest = bytes.fromhex(path.name.removesuffix(SUFFIX))
                    st = path.stat()
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime, owner_dir.name, digest, st.st_size))
        for _, owner, digest, size in sorted(found):
            self._index[(owner, digest)] = size
            self._bytes += size
        self._trim()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._index)

    def holds(self, owner: str, digest: bytes) -> bool:
        key = (owner_folder(owner), digest)
        with self._lock:
            return key in self._index or key in self._pending

    def _path(self, folder: str, digest: bytes) -> Path:
        return self.folder / folder / f"{digest.hex()}{SUFFIX}"

    def _trim(self) -> None:
        """Evict least recently used blocks until the store fits its bound (lock held)."""
        while self._bytes > self.limit_bytes and self._index:
            (folder, digest), size = self._index.popitem(last=False)
            self._bytes -= size
            self._path(folder, digest).unlink(missing_ok=True)
            self.stats.evicted_blocks += 1

    # -- writing --------------------------------------------------------------------------------

    def save(self, owner: str, digest: bytes, parent: bytes | None, tokens: Sequence[int], salt: str,
             payload: bytes) -> bool:
        """Queue one block for the writer; False if it is held or queued already, or the queue is
        full (a cache: dropping a write only costs a recompute after a restart)."""
        folder = owner_folder(owner)
        header = json.dumps({
            "format": FORMAT, "hash": digest.hex(), "parent": parent.hex() if parent else None,
            "salt": salt, "tokens": [int(t) for t in tokens], "shape": self.block_shape, "dtype": self.dtype,
            "payload": hashlib.blake2b(payload, digest_size=16).hexdigest(),
        }, separators=(",", ":")).encode()
        with self._lock:
            key = (folder, digest)
            if key in self._index or key in self._pending:
                return False
            try:
                self._queue.put_nowait((folder, self._epoch.get(folder, 0), digest,
                                        MAGIC + _HEADER_LEN.pack(len(header)) + header + payload))
            except queue.Full:
                self.stats.dropped_writes += 1
                return False
            self._pending.add(key)
        return True

    def _write_loop(self) -> None:
        """Writes outside the lock (an fsync must never stall the engine thread's lookups), then
        checks under it that the owner was not erased meanwhile; if they were, the file goes."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            folder, epoch, digest, data = item
            path = self._path(folder, digest)
            try:
                with self._lock:
                    self._pending.discard((folder, digest))
                    if self._epoch.get(folder, 0) != epoch or len(data) > self.limit_bytes:
                        continue  # the owner was erased after this block was queued
                (self.folder / folder).mkdir(exist_ok=True, mode=0o700)
                durable.write_bytes(path, data, mode=0o600)
                with self._lock:
                    if self._epoch.get(folder, 0) != epoch:
                        path.unlink(missing_ok=True)
                        _remove_if_empty(path.parent)
                        continue
                    self._index[(folder, digest)] = len(data)
                    self._bytes += len(data)
                    self.stats.written_blocks += 1
                    self._trim()
            except OSError as exc:  # a full or read-only disk costs the tier, never the engine
                log.warning("prefix store: writing a block failed: %s", exc)
            finally:
                self._queue.task_done()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued block is on disk (shutdown, tests), at most `timeout_s`; False
        if some were still queued then (a cache: they are recomputed after the restart)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush (bounded: a stop must stay inside its own deadline) and end the writer."""
        atexit.unregister(self.flush)
        self.flush(timeout_s)
        self._queue.put(None)
        self._writer.join(timeout=1.0)

    # -- reading --------------------------------------------------------------------------------

    def load(self, owner: str, digest: bytes, block_bytes: int) -> StoredBlock | None:
        """The block with hash `digest` stored for `owner`, if its file passes every check (format,
        shape, dtype, size, payload digest, and the hash recomputed from its parent, tokens and
        salt); a file that fails one is deleted and reads as a miss."""
        folder = owner_folder(owner)
        key = (folder, digest)
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self._path(folder, digest)
        try:
            data = path.read_bytes()
            block = self._parse(data, digest, block_bytes)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("prefix store: %s refused (%s); recomputing", path.name, exc)
            with self._lock:
                size = self._index.pop(key, 0)
                self._bytes -= size
            path.unlink(missing_ok=True)
            self.stats.refused_files += 1
            return None
        try:
            os.utime(path)  # the order of eviction survives a restart
        except OSError:
            pass
        self.stats.restored_blocks += 1
        return block

    def _parse(self, data: bytes, digest: bytes, block_bytes: int) -> StoredBlock:
        if not data.startswith(MAGIC):
            raise ValueError("not a KV block file")
        (length,) = _HEADER_LEN.unpack_from(data, len(MAGIC))
        start = len(MAGIC) + _HEADER_LEN.size
        header = json.loads(data[start : start + length])
        payload = data[start + length :]
        if header["format"] != FORMAT or header["shape"] != self.block_shape or header["dtype"] != self.dtype:
            raise ValueError("written for another block shape or format")
        if len(payload) != block_bytes or hashlib.blake2b(payload, digest_size=16).hexdigest() != header["payload"]:
            raise ValueError("payload damaged")
        parent = bytes.fromhex(header["parent"]) if header["parent"] else None
        tokens = [int(t) for t in header["tokens"]]
        if block_hash(parent, tokens, header["salt"]) != digest or header["hash"] != digest.hex():
            raise ValueError("tokens do not hash to the file's name")
        return StoredBlock(parent, tokens, header["salt"], payload)

    # -- erasure --------------------------------------------------------------------------------

    def erase(self, owner: str) -> int:
        """Remove every block stored for `owner`, and void their queued writes. Returns how many
        blocks were on disk."""
        folder = owner_folder(owner)
        with self._lock:
            self._epoch[folder] = self._epoch.get(folder, 0) + 1
            self._pending = {k for k in self._pending if k[0] != folder}
            gone = [k for k in self._index if k[0] == folder]
            for key in gone:
                self._bytes -= self._index.pop(key)
            shutil.rmtree(self.folder / folder, ignore_errors=True)
        durable.fsync_dir(self.folder)
        return len(gone)


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass


def forget_stored_prefixes(root: str | Path, owner: str) -> int:
    """Remove `owner`'s blocks under every model's folder of `root` (erasure while no engine runs,
    or of blocks stored for another model or weight format); how many files there were."""
    removed = 0
    root = Path(root)
    if not owner or not root.is_dir():
        return 0
    for model_folder in root.iterdir():
        target = model_folder / owner_folder(owner)
        if target.is_dir():
            removed += sum(1 for p in target.iterdir() if p.suffix == SUFFIX)
            shutil.rmtree(target, ignore_errors=True)
            durable.fsync_dir(model_folder)
    return removed
