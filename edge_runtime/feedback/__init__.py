"""Feedback store: users' interactions and feedback in SQLite, preference pairs for DPO, and the
GDPR rights over them (consent, export, erasure, retention). Imports neither torch nor transformers.
"""

from __future__ import annotations

from edge_runtime.feedback.aio import AsyncFeedbackStore
from edge_runtime.feedback.config import FeedbackStoreConfig
from edge_runtime.feedback.errors import (
    ConsentRequired,
    DuplicateFeedback,
    DuplicateInteraction,
    InvalidFeedback,
    StoreClosed,
    StoreUnavailable,
    UnknownInteraction,
    UnknownPair,
    UnknownUser,
)
from edge_runtime.feedback.records import (
    HELDOUT,
    PENDING,
    SKIPPED,
    TRAIN,
    TRAINED,
    AdapterVersionRecord,
    Choice,
    ConsentState,
    Edit,
    ErasureReport,
    Feedback,
    FeedbackAck,
    FleetMaterial,
    PreferencePair,
    Rating,
    RetentionReport,
    StoreStats,
    Thumbs,
    UnpairedExample,
    feedback_from_dict,
)
from edge_runtime.feedback.store import FeedbackStore, default_db_path

__all__ = [
    "AdapterVersionRecord", "AsyncFeedbackStore", "Choice", "ConsentRequired", "ConsentState", "DuplicateFeedback",
    "DuplicateInteraction", "Edit", "ErasureReport", "Feedback", "FeedbackAck", "FeedbackStore",
    "FeedbackStoreConfig", "FleetMaterial", "HELDOUT", "InvalidFeedback", "PENDING", "PreferencePair", "Rating",
    "RetentionReport", "SKIPPED", "StoreClosed", "StoreStats", "StoreUnavailable", "TRAIN",
    "TRAINED", "Thumbs", "UnknownInteraction", "UnpairedExample", "UnknownPair", "UnknownUser", "default_db_path",
    "feedback_from_dict",
]
