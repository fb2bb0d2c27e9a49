"""The group-commit writer: batching under load, per-job isolation, failed commits, asyncio use."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

import pytest

from edge_runtime.feedback import (
    AsyncFeedbackStore,
    Choice,
    DuplicateInteraction,
    FeedbackStore,
    FeedbackStoreConfig,
    StoreClosed,
    StoreUnavailable,
)


def test_concurrent_writes_share_commits(store: FeedbackStore) -> None:
    store.set_consent("alice", True)
    futures = [store.submit_interaction("alice", f"r{i}", f"q{i}", ["a", "b"], model="m") for i in range(300)]
    ids = [f.result() for f in futures]
    assert len(set(ids)) == 300
    stats = store.writer_stats
    assert stats.largest_batch > 1
    assert stats.transactions < 300 / 3  # group commit: many acknowledged writes per fsync


def test_a_failing_job_is_rolled_back_alone_within_its_batch(store: FeedbackStore) -> None:
    store.set_consent("alice", True)
    futures = [store.submit_interaction("alice", rid, "q", ["a"], model="m") for rid in ("r1", "r2", "r1", "r3")]
    assert futures[0].result() and futures[1].result() and futures[3].result()
    with pytest.raises(DuplicateInteraction):
        futures[2].result()
    assert [i["request_id"] for i in store.export_user("alice")["interactions"]] == ["r1", "r2", "r3"]


def test_threads_writing_at_once_are_all_acknowledged(store: FeedbackStore) -> None:
    store.set_consent("alice", True)
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            for i in range(20):
                rid = f"w{w}-{i}"
                store.record_interaction("alice", rid, f"q {rid}", ["x", "y"], model="m")
                store.record_feedback("alice", rid, Choice(i % 2))
        except BaseException as exc:  # surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = store.stats()
    assert (stats.interactions, stats.feedback, stats.pairs_pending) == (160, 160, 160)


def test_a_commit_that_cannot_happen_acknowledges_nothing(tmp_path: Path) -> None:
    path = tmp_path / "f.sqlite3"
    with FeedbackStore(path, config=FeedbackStoreConfig(busy_timeout_ms=50)) as store:
        store.set_consent("alice", True)
        blocker = sqlite3.connect(str(path), isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        with pytest.raises(StoreUnavailable):
            store.record_interaction("alice", "r1", "q", ["a"], model="m")
        blocker.execute("ROLLBACK")
        blocker.close()
        store.record_interaction("alice", "r1", "q", ["a"], model="m")  # the same id is free
        assert store.stats().interactions == 1


def test_closed_store_refuses_writes_and_close_drains_the_queue(tmp_path: Path) -> None:
    store = FeedbackStore(tmp_path / "f.sqlite3")
    store.set_consent("alice", True)
    futures = [store.submit_interaction("alice", f"r{i}", "q", ["a"], model="m") for i in range(50)]
    store.close()
    assert all(f.done() and f.exception() is None for f in futures)
    with pytest.raises(StoreClosed):
        store.record_interaction("alice", "late", "q", ["a"], model="m")
    with FeedbackStore(tmp_path / "f.sqlite3") as reopened:
        assert reopened.stats().interactions == 50


def test_async_facade_batches_many_tasks_without_blocking_the_loop(store: FeedbackStore) -> None:
    astore = AsyncFeedbackStore(store)

    async def main() -> list[int]:
        await astore.set_consent("alice", True)
        loop_thread = threading.get_ident()
        writer_threads: set[int] = set()

        async def one(i: int) -> int:
            rid = f"a{i}"
            await astore.record_interaction("alice", rid, f"q{i}", ["good", "bad"], model="m")
            ack = await astore.record_feedback("alice", rid, Choice(0))
            return len(ack.pair_ids)

        # The writer thread, not the loop's, runs every job.
        probe = store._write(lambda conn: writer_threads.add(threading.get_ident()))
        await asyncio.wrap_future(probe)
        assert loop_thread not in writer_threads
        return await asyncio.gather(*(one(i) for i in range(64)))

    assert asyncio.run(main()) == [1] * 64
    assert store.writer_stats.largest_batch > 1
    assert asyncio.run(astore.stats()).pairs_pending == 64
