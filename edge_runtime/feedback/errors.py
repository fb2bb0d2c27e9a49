"""Typed errors of the feedback store, each with a `code` the daemon maps onto protocol errors.

Every one of them is raised before anything is written (or after the transaction is rolled back),
so a caller that gets one knows the store is unchanged.
"""

from __future__ import annotations

from edge_runtime.errors import BadRequest, MaceError, UnknownRequest


class ConsentRequired(MaceError):
    """The user has not consented (or withdrew consent): nothing is stored or trained for them."""

    code = "consent_required"


class UnknownUser(MaceError):
    """The store holds nothing on this user id."""

    code = "unknown_user"


class UnknownInteraction(UnknownRequest):
    """Feedback names a request id that was never recorded for this user (or was erased)."""

    code = "unknown_request"


class UnknownPair(MaceError):
    """A preference-pair id that does not exist (erased, expired, or never created)."""

    code = "unknown_pair"


class DuplicateFeedback(MaceError):
    """The same kind of feedback on the same target was already recorded; the first one stands."""

    code = "duplicate_feedback"


class DuplicateInteraction(MaceError):
    """This user's request id was already recorded; request ids are single-use per user."""

    code = "duplicate_request"


class InvalidFeedback(BadRequest):
    """Feedback that cannot apply (candidate index out of range, rating outside 1-5, empty edit)."""

    code = "bad_request"


class StoreClosed(MaceError):
    """The store was closed (daemon shutting down); retry after restart."""

    code = "store_unavailable"


class StoreUnavailable(MaceError):
    """SQLite failed to commit (disk full, I/O error); nothing of the failed batch was acknowledged."""

    code = "store_unavailable"
