"""Awaitable facade of `FeedbackStore` for the daemon's event loop.

Hot-path writes (interactions, feedback) await the writer thread's future directly, so any
number of them can wait on one group commit without holding an executor thread each. Rare or
read operations run in the default executor. Nothing here touches SQLite on the loop thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from edge_runtime.feedback.records import (
    ConsentState,
    ErasureReport,
    Feedback,
    FeedbackAck,
    RetentionReport,
    StoreStats,
)
from edge_runtime.feedback.store import FeedbackStore


class AsyncFeedbackStore:
    def __init__(self, store: FeedbackStore) -> None:
        self.store = store

    async def record_interaction(
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
        future = self.store.submit_interaction(
            user_id, request_id, prompt, candidates, model=model,
            adapter_version=adapter_version, timings=timings,
        )
        return await asyncio.wrap_future(future)

    async def record_feedback(self, user_id: str, request_id: str, feedback: Feedback) -> FeedbackAck:
        return await asyncio.wrap_future(self.store.submit_feedback(user_id, request_id, feedback))

    async def set_consent(self, user_id: str, granted: bool) -> bool:
        return await asyncio.to_thread(self.store.set_consent, user_id, granted)

    async def set_fleet_consent(self, user_id: str, granted: bool) -> bool:
        return await asyncio.to_thread(self.store.set_fleet_consent, user_id, granted)

    async def consent_state(self, user_id: str) -> ConsentState:
        return await asyncio.to_thread(self.store.consent_state, user_id)

    async def has_consent(self, user_id: str) -> bool:
        return await asyncio.to_thread(self.store.has_consent, user_id)

    async def export_user(self, user_id: str) -> dict[str, Any]:
        return await asyncio.to_thread(self.store.export_user, user_id)

    async def forget(self, user_id: str, adapters_removed: bool = False,
                     elsewhere: dict[str, int] | None = None) -> ErasureReport:
        return await asyncio.to_thread(self.store.forget, user_id, adapters_removed, elsewhere)

    async def apply_retention(self) -> RetentionReport:
        return await asyncio.to_thread(self.store.apply_retention)

    async def stats(self) -> StoreStats:
        return await asyncio.to_thread(self.store.stats)

    async def pending_counts(self) -> dict[str, int]:
        return await asyncio.to_thread(self.store.pending_counts)
