"""Policy names -> classes, and the one constructor the engine and tools use."""

from __future__ import annotations

from typing import Any

from edge_runtime.sched.baselines import (
    AptPolicy,
    ContinuousPolicy,
    FIFOPolicy,
    PeriodicPolicy,
    TokenLevelPolicy,
)
from edge_runtime.sched.mace import MacePolicy
from edge_runtime.sched.policy import FCFSPolicy, Policy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (MacePolicy, FCFSPolicy, PeriodicPolicy, ContinuousPolicy, FIFOPolicy, TokenLevelPolicy, AptPolicy)
}


def make_policy(name: str, params: dict[str, Any] | None = None) -> Policy:
    """A fresh policy (policies may keep state, e.g. periodic's next window: one per engine)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    return cls(**(params or {}))
