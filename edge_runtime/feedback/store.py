"""`FeedbackStore`: the synchronous facade over the feedback database (thread-safe).

Every write is a job on the group-commit writer thread and returns only once committed
(acknowledged = durable); reads use a second connection. Torch-free by design.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from edge_runtime.errors import BadRequest, MaceError
from edge_runtime.feedback import gdpr, recording
from edge_runtime.feedback import training_queue as tq
from edge_runtime.feedback.config import FeedbackStoreConfig
from edge_runtime.feedback.errors import StoreClosed, UnknownPair, UnknownUser
from edge_runtime.feedback.records import (
    PENDING,
    SKIPPED,
    TRAIN,
    AdapterVersionRecord,
    ConsentState,
    ErasureReport,
    Feedback,
    FeedbackAck,
    FleetMaterial,
    PreferencePair,
    RetentionReport,
    StoreStats,
    UnpairedExample,
)
from edge_runtime.feedback.schema import connect, prepare_database
from edge_runtime.feedback.validation import (
    check_adapter_version,
    check_candidates,
    check_feedback_shape,
    check_text,
    check_timings,
)
from edge_runtime.feedback.writer import GroupCommitWriter, WriterStats
from edge_runtime.ids import validate_request_id, validate_user_id
from edge_runtime.paths import state_dir

T = TypeVar("T")
log = logging.getLogger(__name__)

DB_FILENAME = "feedback.sqlite3"


def default_db_path() -> Path:
    return state_dir() / DB_FILENAME


class FeedbackStore:
    """Users' interactions, feedback and preference pairs, with their GDPR rights.

    `adapters_root` is where per-user adapters live (`<root>/<user_id>/v<N>/`); `forget()`
    deletes `<root>/<user_id>/` and nothing outside `adapters_root`.
    """

    def __init__(
        self,
        path: Path | str | None = None,
        *,
        adapters_root: Path | str | None = None,
        config: FeedbackStoreConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path) if path is not None else default_db_path()
        self.adapters_root = Path(adapters_root) if adapters_root is not None else None
        self.config = config or FeedbackStoreConfig()
        self._clock = clock  # wall clock: timestamps users read and retention ages compare
        _create_private_file(self.path)
        writer_conn = connect(self.path, self.config.busy_timeout_ms)
        try:
            prepare_database(writer_conn, self.config.heldout_fraction)
        except BaseException:
            writer_conn.close()
            raise
        self._reader = connect(self.path, self.config.busy_timeout_ms)
        # One reader connection shared under a lock: reads are short, and forget() holds the
        # lock while it truncates the WAL so no read snapshot pins the erased pages.
        self._read_lock = threading.Lock()
        self._writer = GroupCommitWriter(writer_conn, self.config.max_batch)
        self._closed = False
        self._stop_janitor = threading.Event()
        self._janitor: threading.Thread | None = None
        if self.config.retention_interval_s is not None:
            self._janitor = threading.Thread(target=self._retention_loop, name="feedback-retention",
                                             daemon=True)
            self._janitor.start()

    # --- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._stop_janitor.set()
        if self._janitor is not None:
            self._janitor.join()
        self._closed = True
        self._writer.close()
        with self._read_lock:
            self._reader.close()

    def __enter__(self) -> FeedbackStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def writer_stats(self) -> WriterStats:
        return self._writer.stats

    # --- consent -------------------------------------------------------------------------------

    def set_consent(self, user_id: str, granted: bool) -> bool:
        """Grant or withdraw consent; returns whether it changed. Withdrawal keeps stored data
        (use `forget` to erase) but stops recording and training for the user at once."""
        user_id = validate_user_id(user_id)
        if not isinstance(granted, bool):
            raise BadRequest(f"consent must be true or false; got {granted!r}")
        now = self._clock()
        return self._write(lambda conn: gdpr.set_consent(conn, user_id, granted, now)).result()

    def has_consent(self, user_id: str) -> bool:
        user_id = validate_user_id(user_id)
        row = self._read(lambda c: c.execute(
            "SELECT consent FROM users WHERE user_id = ?", (user_id,)).fetchone())
        return bool(row and row[0])

    def set_fleet_consent(self, user_id: str, granted: bool) -> bool:
        """Grant or withdraw consent to training the shared fleet adapter; returns whether it
        changed. Granting raises ConsentRequired without feedback consent; withdrawal removes the
        user from every later round (`fleet_material`)."""
        user_id = validate_user_id(user_id)
        if not isinstance(granted, bool):
            raise BadRequest(f"fleet consent must be true or false; got {granted!r}")
        now = self._clock()
        return self._write(lambda conn: gdpr.set_fleet_consent(conn, user_id, granted, now)).result()

    def consent_state(self, user_id: str) -> ConsentState:
        """Both consents of a user (false for a user the store does not know)."""
        user_id = validate_user_id(user_id)
        return self._read(lambda c: gdpr.consent_state(c, user_id))

    # --- recording -----------------------------------------------------------------------------

    def submit_interaction(
        self,
        user_id: str,
        request_id: str,
        prompt: str,
        candidates: Sequence[str],
        *,
        model: str,
        adapter_version: int | None = None,
        timings: Mapping[str, float] | None = None,
    ) -> Future:
        """Queue an interaction; the future gives its id once durable (see `record_interaction`)."""
        user_id = validate_user_id(user_id)
        request_id = validate_request_id(request_id)
        prompt = check_text(prompt, "prompt", self.config.max_text_bytes)
        texts = check_candidates(candidates, self.config)
        model = check_text(model, "model", self.config.max_model_chars)
        version = None if adapter_version is None else check_adapter_version(adapter_version)
        timing = check_timings(timings, self.config)
        now = self._clock()
        return self._write(lambda conn: recording.insert_interaction(
            conn, user_id=user_id, request_id=request_id, prompt=prompt, candidates=texts,
            model=model, adapter_version=version, timings=timing, now=now))

    def record_interaction(
        self,
        user_id: str,
        request_id: str,
        prompt: str,
        candidates: Sequence[str],
        *,
        model: str,
        adapter_version: int | None = None,
        timings: Mapping[str, float] | None = None,
    ) -> int:
        """Store a prompt and every candidate shown; raises ConsentRequired without consent."""
        return self.submit_interaction(
            user_id, request_id, prompt, candidates, model=model,
            adapter_version=adapter_version, timings=timings,
        ).result()

    def submit_feedback(self, user_id: str, request_id: str, feedback: Feedback) -> Future:
        """Queue feedback; the future gives a `FeedbackAck` once durable."""
        user_id = validate_user_id(user_id)
        request_id = validate_request_id(request_id)
        check_feedback_shape(feedback, self.config)
        now = self._clock()
        fraction = self.config.heldout_fraction
        return self._write(lambda conn: recording.insert_feedback(
            conn, user_id=user_id, request_id=request_id, feedback=feedback, now=now,
            heldout_fraction=fraction))

    def record_feedback(self, user_id: str, request_id: str, feedback: Feedback) -> FeedbackAck:
        """Store feedback on a recorded request and derive its pairs; returns once durable."""
        return self.submit_feedback(user_id, request_id, feedback).result()

    # --- training queue ------------------------------------------------------------------------

    def next_pairs(
        self, user_id: str | None = None, limit: int = 32, split: str = TRAIN, status: str = PENDING
    ) -> list[PreferencePair]:
        """Pairs to train (oldest first), consented users only; `split="heldout"` to evaluate."""
        if user_id is not None:
            user_id = validate_user_id(user_id)
        return self._read(lambda c: tq.next_pairs(c, user_id, limit, split, status))

    def heldout_pairs(self, user_id: str) -> list[PreferencePair]:
        user_id = validate_user_id(user_id)
        return self._read(lambda c: tq.heldout_pairs(c, user_id))

    def get_pair(self, pair_id: int) -> PreferencePair:
        return self._read(lambda c: tq.get_pair(c, pair_id))

    def pending_counts(self) -> dict[str, int]:
        return self._read(tq.pending_counts)

    def mark_trained(self, pair_id: int, dpo_loss: float) -> None:
        self.mark_trained_batch([(pair_id, dpo_loss)])

    def mark_trained_batch(self, results: Iterable[tuple[int, float]]) -> None:
        """Report one DPO step's pairs and losses in one commit (all or nothing)."""
        checked = tq.check_losses(results)
        now = self._clock()
        self._write(lambda conn: tq.mark_trained(conn, checked, now)).result()

    def mark_skipped(self, pair_id: int) -> None:
        """The trainer cannot use this pair (e.g. too long): never draw it again."""
        now = self._clock()
        self._write(lambda conn: tq.set_status(conn, pair_id, SKIPPED, now)).result()

    def next_unpaired(
        self, user_id: str | None = None, limit: int = 32, split: str = TRAIN, status: str = PENDING
    ) -> list[UnpairedExample]:
        """Unpaired examples (thumbs, ratings) to train by KTO, oldest first, consented users only."""
        if user_id is not None:
            user_id = validate_user_id(user_id)
        return self._read(lambda c: tq.next_unpaired(c, user_id, limit, split, status))

    def heldout_unpaired(self, user_id: str) -> list[UnpairedExample]:
        user_id = validate_user_id(user_id)
        return self._read(lambda c: tq.heldout_unpaired(c, user_id))

    def pending_unpaired_counts(self) -> dict[str, int]:
        return self._read(lambda c: tq.pending_counts(c, "unpaired"))

    def mark_unpaired_trained(self, example_id: int, kto_loss: float) -> None:
        checked = tq.check_losses([(example_id, kto_loss)])
        now = self._clock()
        self._write(lambda conn: tq.mark_unpaired_trained(conn, checked, now)).result()

    def fleet_material(self, split: str = TRAIN) -> FleetMaterial:
        """What a fleet round may train on (`split="heldout"`: evaluate on): the pairs and unpaired
        examples of users holding both consents at this moment; skipped rows are left out."""
        return self._read(lambda c: tq.fleet_material(c, split), snapshot=True)

    # --- adapters ------------------------------------------------------------------------------

    def record_adapter_version(
        self, user_id: str, version: int, path: Path | str, pair_ids: Iterable[int],
        unpaired_ids: Iterable[int] = (),
    ) -> None:
        """Register a published adapter version and the pairs and unpaired examples it was trained on.

        If the user or any pair was erased meanwhile, the adapter files at `path` are deleted
        (they hold erased data) and UnknownUser / UnknownPair is raised.
        """
        user_id = validate_user_id(user_id)
        version = check_adapter_version(version)
        adapter_path = Path(path)
        user_dir = None if self.adapters_root is None else self.adapters_root / user_id
        if user_dir is not None and not gdpr.inside(adapter_path, user_dir):
            raise BadRequest(f"adapter path {adapter_path} is not inside {user_dir}")
        ids, example_ids = [], []
        for out, given in ((ids, pair_ids), (example_ids, unpaired_ids)):
            for row_id in given:
                if not isinstance(row_id, int) or isinstance(row_id, bool):
                    raise BadRequest(f"pair and example ids must be integers; got {row_id!r}")
                out.append(row_id)
        now = self._clock()

        def job(conn: sqlite3.Connection) -> None:
            try:
                tq.insert_adapter_version(conn, user_id, version, str(adapter_path), ids, now)
                tq.link_adapter_unpaired(conn, user_id, version, example_ids)
            except (UnknownUser, UnknownPair) as exc:
                if user_dir is None or not gdpr.remove_tree(adapter_path):
                    raise
                raise type(exc)(f"{exc}; the adapter at {adapter_path} was deleted because it "
                                "was trained on erased data") from exc

        self._write(job).result()

    def adapter_versions(self, user_id: str) -> list[AdapterVersionRecord]:
        user_id = validate_user_id(user_id)
        return self._read(lambda c: tq.adapter_versions(c, user_id))

    # --- GDPR ----------------------------------------------------------------------------------

    def export_user(self, user_id: str) -> dict[str, Any]:
        """Art. 15/20: everything held on the user as JSON-ready data (the export is audited)."""
        user_id = validate_user_id(user_id)
        now = self._clock()
        data = self._read(lambda c: gdpr.export_user(c, user_id, now), snapshot=True)
        counts = {"interactions": len(data["interactions"]), "pairs": len(data["preference_pairs"]),
                  "unpaired": len(data["unpaired_examples"])}
        self._write(lambda conn: gdpr.write_audit(conn, "export", user_id, counts, now)).result()
        return data

    def forget(self, user_id: str, adapters_removed: bool = False,
               elsewhere: Mapping[str, int] | None = None) -> ErasureReport:
        """Art. 17: erase the user's rows, pairs and adapters; overwrite and reclaim the space.
        `adapters_removed`: the serving runtime already deleted the user's adapter folder as
        part of this erasure (the receipt and the audit row count it as removed here);
        `elsewhere`: likewise, what it erased outside the store, counted by kind (stored prompt
        prefixes, stored responses): a user with only those is still erased, not unknown."""
        elsewhere = {kind: int(n) for kind, n in (elsewhere or {}).items()}
        user_id = validate_user_id(user_id)
        target = gdpr.adapter_dir(self.adapters_root, user_id)
        now = self._clock()

        def job(conn: sqlite3.Connection) -> ErasureReport:
            conn.execute("BEGIN IMMEDIATE")
            counts = gdpr.count_user_rows(conn, user_id)
            has_adapters = (target is not None and target.exists()) or adapters_removed
            if counts is None and not has_adapters and not any(elsewhere.values()):
                raise UnknownUser(f"the feedback store holds nothing on user {user_id!r}")
            counts = counts or dict.fromkeys(("interactions", "feedback", "pairs", "unpaired", "adapter_versions"), 0)
            gdpr.delete_user_rows(conn, user_id)
            gdpr.write_audit(conn, "erasure", user_id, {**counts, "adapter_dir": has_adapters, **elsewhere}, now)
            conn.execute("COMMIT")
            # Files go after the commit: if we crash in between, a second forget() still finds the
            # folder and finishes the job. Running on the writer thread orders this after (or
            # before) any record_adapter_version of the same user.
            removed = gdpr.remove_tree(target) if target is not None else False
            with self._read_lock:
                truncated = gdpr.reclaim_space(conn, full_vacuum=self.config.vacuum_on_forget)
            return ErasureReport(user_id=user_id, adapter_dir_removed=removed or adapters_removed,
                                 wal_truncated=truncated, elsewhere=elsewhere, **counts)

        return self._write(job, exclusive=True).result()

    def apply_retention(self) -> RetentionReport:
        """Delete what is past the age limit or each user's row cap (also run on a timer)."""
        now = self._clock()
        cfg = self.config

        def job(conn: sqlite3.Connection) -> RetentionReport:
            conn.execute("BEGIN IMMEDIATE")
            report = gdpr.apply_retention(
                conn, cfg.retention_max_age_s, cfg.retention_max_interactions_per_user, now)
            conn.execute("COMMIT")
            if report.interactions_deleted or report.pairs_deleted or report.unpaired_deleted:
                with self._read_lock:
                    gdpr.reclaim_space(conn, full_vacuum=False)
            return report

        return self._write(job, exclusive=True).result()

    def _retention_loop(self) -> None:
        period = self.config.retention_interval_s
        assert period is not None
        while True:
            try:
                report = self.apply_retention()
            except StoreClosed:
                return
            except MaceError as exc:  # e.g. the disk is full: try again next period
                log.warning("feedback retention failed: %s", exc)
            else:
                if report.interactions_deleted or report.pairs_deleted:
                    log.info("feedback retention removed %d interactions and %d pairs of %d users",
                             report.interactions_deleted, report.pairs_deleted, report.users_affected)
            if self._stop_janitor.wait(period):
                return

    def audit_log(self, user_id: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """Recent GDPR operations (newest first); subjects are keyed hashes of user ids."""
        if user_id is not None:
            user_id = validate_user_id(user_id)
        return self._read(lambda c: gdpr.read_audit(c, user_id, limit))

    # --- status --------------------------------------------------------------------------------

    def stats(self) -> StoreStats:
        def query(c: sqlite3.Connection) -> dict[str, int]:
            def one(sql: str) -> int:
                return int(c.execute(sql).fetchone()[0] or 0)

            pairs = {(split, status): int(n) for split, status, n in c.execute(
                "SELECT split, status, count(*) FROM pairs GROUP BY split, status")}
            return {
                "users": one("SELECT count(*) FROM users"),
                "consented_users": one("SELECT sum(consent) FROM users"),
                "fleet_users": one("SELECT count(*) FROM users WHERE consent = 1 AND fleet_consent = 1"),
                "interactions": one("SELECT count(*) FROM interactions"),
                "feedback": one("SELECT count(*) FROM feedback"),
                "pairs_pending": pairs.get((TRAIN, PENDING), 0),
                "pairs_trained": pairs.get((TRAIN, "trained"), 0),
                "pairs_skipped": pairs.get((TRAIN, SKIPPED), 0),
                "pairs_heldout": sum(n for (split, _), n in pairs.items() if split != TRAIN),
                "adapter_versions": one("SELECT count(*) FROM adapter_versions"),
                "unpaired_pending": one("SELECT count(*) FROM unpaired WHERE split = 'train' AND status = 'pending'"),
                "unpaired_trained": one("SELECT count(*) FROM unpaired WHERE split = 'train' AND status = 'trained'"),
                "unpaired_heldout": one("SELECT count(*) FROM unpaired WHERE split = 'heldout'"),
            }

        counts = self._read(query, snapshot=True)
        return StoreStats(db_bytes=_size(self.path), wal_bytes=_size(Path(f"{self.path}-wal")),
                          **counts)

    # --- plumbing ------------------------------------------------------------------------------

    def _write(self, job: Callable[[sqlite3.Connection], T], *, exclusive: bool = False) -> Future:
        if self._closed:
            raise StoreClosed("the feedback store is closed")
        return self._writer.submit(job, exclusive=exclusive)

    def _read(self, query: Callable[[sqlite3.Connection], T], *, snapshot: bool = False) -> T:
        """Run a query on the reader; `snapshot=True` wraps it in one read transaction."""
        with self._read_lock:
            if self._closed:
                raise StoreClosed("the feedback store is closed")
            if not snapshot:
                return query(self._reader)
            self._reader.execute("BEGIN")
            try:
                return query(self._reader)
            finally:
                self._reader.execute("COMMIT")


def _create_private_file(path: Path) -> None:
    """Create the database (and its folder) readable by the daemon's user only."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # SQLite gives the -wal and -shm files the main file's permissions.
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
