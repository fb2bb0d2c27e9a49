"""Speculative decoding without a second model (docs/speculative.md): prompt-lookup drafts
(`lookup.py`) and per-request acceptance bookkeeping that decides whether a request speculates
(`acceptance.py`); `drafter.py` ties them to the scheduler's decode rows."""

from edge_runtime.spec.acceptance import Acceptance
from edge_runtime.spec.drafter import Drafter, SpecState, drafter_for
from edge_runtime.spec.lookup import NgramIndex

__all__ = ["Acceptance", "Drafter", "NgramIndex", "SpecState", "drafter_for"]
