"""The single writer thread of the feedback store: group commit of queued write jobs.

Writes never run on the asyncio event loop. Jobs queued while a commit's fsync is in flight are
folded into the next transaction, so N concurrent writers share one fsync. Each job runs in its
own SAVEPOINT: a job that raises is rolled back alone and the others of its batch still commit.
A job's future resolves only after COMMIT returned, which is what "acknowledged" means.
"""

from __future__ import annotations

import queue
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from edge_runtime.feedback.errors import StoreClosed, StoreUnavailable

T = TypeVar("T")
Job = Callable[[sqlite3.Connection], Any]


@dataclass
class _Work:
    job: Job
    future: Future
    # An exclusive job runs alone and outside any transaction (VACUUM, checkpoints) and manages
    # its own transactions.
    exclusive: bool = False


@dataclass
class WriterStats:
    transactions: int = 0
    jobs: int = 0
    largest_batch: int = 0
    failed_commits: int = 0

    @property
    def mean_batch(self) -> float:
        return self.jobs / self.transactions if self.transactions else 0.0


_STOP = object()


class GroupCommitWriter:
    """Owns the write connection; everything that writes goes through `submit`."""

    def __init__(self, conn: sqlite3.Connection, max_batch: int = 512, name: str = "feedback-writer") -> None:
        self._conn = conn
        self._max_batch = max_batch
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._close_lock = threading.Lock()
        self.stats = WriterStats()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[sqlite3.Connection], T], *, exclusive: bool = False) -> Future:
        """Queue a job; the returned future resolves after its transaction committed."""
        future: Future = Future()
        with self._close_lock:
            if self._closed:
                raise StoreClosed("the feedback store is closed")
            self._queue.put(_Work(job, future, exclusive))
        return future

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish every job queued so far, then stop the thread and close the connection."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError("feedback writer thread did not stop in time")
        self._conn.close()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            # A bug in the loop itself must not leave callers waiting forever.
            with self._close_lock:
                self._closed = True
            error = StoreUnavailable(f"feedback writer thread died: {exc!r}")
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP and item.future.set_running_or_notify_cancel():
                    item.future.set_exception(error)
            raise

    def _loop(self) -> None:
        carry: Any = None
        while True:
            item = carry if carry is not None else self._queue.get()
            carry = None
            if item is _STOP:
                return
            if item.exclusive:
                self._run_exclusive(item)
                continue
            batch = [item]
            while len(batch) < self._max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP or nxt.exclusive:
                    carry = nxt
                    break
                batch.append(nxt)
            self._run_batch(batch)

    def _run_exclusive(self, work: _Work) -> None:
        if not work.future.set_running_or_notify_cancel():
            return
        try:
            result = work.job(self._conn)
        except Exception as exc:  # handed to the caller, who re-raises it
            if isinstance(exc, sqlite3.Error):
                exc = StoreUnavailable(f"feedback store operation failed: {exc}")
            work.future.set_exception(exc)
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
        else:
            work.future.set_result(result)

    def _run_batch(self, batch: list[_Work]) -> None:
        conn = self._conn
        # A job cancelled before it ran writes nothing; the rest can no longer be cancelled.
        batch = [work for work in batch if work.future.set_running_or_notify_cancel()]
        if not batch:
            return
        outcomes: list[tuple[_Work, bool, Any]] = []
        try:
            conn.execute("BEGIN IMMEDIATE")
            for work in batch:
                conn.execute("SAVEPOINT job")
                try:
                    result = work.job(conn)
                except Exception as exc:  # the job's own error: undo only this job
                    conn.execute("ROLLBACK TO job")
                    conn.execute("RELEASE job")
                    outcomes.append((work, False, exc))
                else:
                    conn.execute("RELEASE job")
                    outcomes.append((work, True, result))
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            # BEGIN or COMMIT failed (disk full, I/O error, lock timeout): none of the batch is
            # durable, so none of it may be acknowledged.
            self.stats.failed_commits += 1
            error = StoreUnavailable(f"feedback store could not commit: {exc}")
            for work in batch:
                work.future.set_exception(error)
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            return
        self.stats.transactions += 1
        self.stats.jobs += len(outcomes)
        self.stats.largest_batch = max(self.stats.largest_batch, len(outcomes))
        for work, ok, value in outcomes:
            if ok:
                work.future.set_result(value)
            else:
                work.future.set_exception(value)
