"""Benchmark of the feedback store: sustained acknowledged (durable) feedback per second.

Each simulated client records an interaction (2 candidates) and then a choice on it, and counts
the feedback once `record_feedback` returned (= committed with synchronous=FULL in WAL mode).
Runs 1, 8 and 32 concurrent asyncio tasks (the daemon's path) and 1 and 8 plain threads (the
trainer's path), a few seconds each, on one database warmed until its WAL file has reached its
steady size (before that every commit also grows the file, which costs a metadata flush and is
not what a long-running daemon sees); writes JSON and a markdown table.

    .venv/bin/python tools/bench_store.py [--seconds 4] [--db-dir DIR] [--out tools/results]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge_runtime.feedback import AsyncFeedbackStore, Choice, FeedbackStore  # noqa: E402

USER = "bench-user"


def open_warm_store(db_dir: Path) -> FeedbackStore:
    """A store whose WAL has wrapped at least once (SQLite's auto-checkpoint at 1000 pages)."""
    store = FeedbackStore(db_dir / "feedback.sqlite3")
    store.set_consent(USER, True)
    wal = Path(f"{store.path}-wal")
    i = 0
    while wal.stat().st_size < 1000 * 4096 or i < 20_000:
        futures = []
        for _ in range(200):
            prompt, candidates = _prompt(-1, i)
            futures.append(store.submit_interaction(USER, f"warm-{i}", prompt, candidates, model="warm"))
            i += 1
        for f in futures:
            f.result()
    return store


def _prompt(worker: int, i: int) -> tuple[str, list[str]]:
    prompt = f"worker {worker} question {i}: how do I reset my router? " * 3
    return prompt, [f"Unplug it for 30 s ({worker}.{i}).", f"Call support ({worker}.{i})."]


def _summary(
    mode: str, writers: int, acks: list[float], elapsed: float, store: FeedbackStore, before: tuple[int, int]
) -> dict:
    commits = store.writer_stats.transactions - before[0]
    jobs = store.writer_stats.jobs - before[1]
    latencies_ms = sorted(x * 1000 for x in acks)
    q = statistics.quantiles(latencies_ms, n=100) if len(latencies_ms) > 1 else [0.0] * 99
    return {
        "mode": mode,  # "asyncio" (AsyncFeedbackStore) or "threads" (FeedbackStore)
        "writers": writers,
        "seconds": round(elapsed, 3),
        "feedback_acked": len(acks),
        "feedback_per_s": round(len(acks) / elapsed, 1),
        "writes_per_s": round(2 * len(acks) / elapsed, 1),  # interaction + feedback
        "commits": commits,
        "mean_batch": round(jobs / commits, 2) if commits else 0.0,
        "ack_latency_ms_p50": round(q[49], 2),
        "ack_latency_ms_p99": round(q[98], 2),
    }


def _counters(store: FeedbackStore) -> tuple[int, int]:
    return store.writer_stats.transactions, store.writer_stats.jobs


def bench_asyncio(store: FeedbackStore, writers: int, seconds: float) -> dict:
    before = _counters(store)
    astore = AsyncFeedbackStore(store)
    acks: list[float] = []

    async def client(worker: int, deadline: float) -> None:
        i = 0
        while time.perf_counter() < deadline:
            rid = f"a{writers}-{worker}-{i}"
            prompt, candidates = _prompt(worker, i)
            await astore.record_interaction(USER, rid, prompt, candidates, model="bench")
            start = time.perf_counter()
            await astore.record_feedback(USER, rid, Choice(0))
            acks.append(time.perf_counter() - start)
            i += 1

    async def main() -> float:
        start = time.perf_counter()
        await asyncio.gather(*(client(w, start + seconds) for w in range(writers)))
        return time.perf_counter() - start

    elapsed = asyncio.run(main())
    return _summary("asyncio", writers, acks, elapsed, store, before)


def bench_threads(store: FeedbackStore, writers: int, seconds: float) -> dict:
    before = _counters(store)
    acks: list[float] = []
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def client(worker: int) -> None:
        i = 0
        mine = []
        while time.perf_counter() < deadline:
            rid = f"t{writers}-{worker}-{i}"
            prompt, candidates = _prompt(worker, i)
            store.record_interaction(USER, rid, prompt, candidates, model="bench")
            start = time.perf_counter()
            store.record_feedback(USER, rid, Choice(0))
            mine.append(time.perf_counter() - start)
            i += 1
        with lock:
            acks.extend(mine)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return _summary("threads", writers, acks, time.perf_counter() - start, store, before)


def fsync_probe(db_dir: Path, n: int = 200) -> float:
    """Median milliseconds of write+fsync of 4 KiB: the floor under one durable commit."""
    path = db_dir / "fsync-probe.bin"
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    times = []
    try:
        for _ in range(n):
            start = time.perf_counter()
            os.pwrite(fd, b"x" * 4096, 0)
            os.fsync(fd)
            times.append(time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink()
    return round(statistics.median(times) * 1000, 3)


def machine(db_dir: Path) -> dict:
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "db_dir": str(db_dir),
        "durability": "journal_mode=WAL, synchronous=FULL (fsync per commit), group commit",
    }


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        "# Feedback store benchmark (`tools/bench_store.py`)",
        "",
        f"{m['platform']}, {m['cpus']} CPUs, Python {m['python']}, SQLite {m['sqlite']}; "
        f"overwrite+fsync of 4 KiB: {report['fsync_ms_median']} ms median. {m['durability']}. "
        "One feedback = one interaction (2 candidates) + one choice, each acknowledged after commit; "
        "database warmed until its WAL reached steady size.",
        "",
        "| API | concurrent clients | acked feedback/s | writes/s | commits | mean batch | ack p50 ms | ack p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["runs"]:
        lines.append(
            f"| {r['mode']} | {r['writers']} | {r['feedback_per_s']:.0f} | {r['writes_per_s']:.0f} | "
            f"{r['commits']} | {r['mean_batch']} | {r['ack_latency_ms_p50']} | {r['ack_latency_ms_p99']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="duration of each run")
    parser.add_argument("--db-dir", type=Path, default=None,
                        help="where the databases go (default: a temp folder; use the real disk)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-store-", dir=args.db_dir) as tmp:
        db_dir = Path(tmp)
        with open_warm_store(db_dir) as store:
            runs = [bench_asyncio(store, n, args.seconds) for n in (1, 8, 32)]
            runs += [bench_threads(store, n, args.seconds) for n in (1, 8)]
            db_bytes = store.stats().db_bytes
        report = {"machine": machine(args.db_dir or Path(tempfile.gettempdir())),
                  "fsync_ms_median": fsync_probe(db_dir), "db_bytes_after": db_bytes, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_store.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (args.out / "bench_store.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
