"""The daemon's hook for per-user fine-tuning (DPO on LoRA adapters): the interface the service
calls, and the stand-in used while no trainer is wired in (base model only, store-backed lists).

The trainer itself lives in edge_runtime.train / edge_runtime.lora; this module only adapts it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

from daemon.wire import ProtocolError

if TYPE_CHECKING:
    from edge_runtime.feedback import FeedbackStore


class FineTuner(Protocol):
    """What the service needs from the fine-tuning side. Called on the event loop; anything that
    touches the engine must go through the engine thread (`EngineThread.call`)."""

    name: str

    def status(self) -> dict[str, Any]:
        """Progress and alignment metrics for `macectl status` (JSON-ready)."""
        ...

    def memory_bytes(self) -> dict[str, int]:
        """Ledger entries this side holds: cached adapters, activations, optimizer state."""
        ...

    def resolve_adapter(self, user: str | None, choice: str | int) -> tuple[Any, str | None]:
        """(the engine's `adapter=` argument or None for the base model, a label like 'alice@3')."""
        ...

    async def adapters(self, user: str | None) -> list[dict[str, Any]]: ...

    async def rollback(self, user: str, version: int) -> dict[str, Any]: ...

    def on_feedback(self, user: str, pair_ids: tuple[int, ...]) -> None:
        """New preference pairs are durable: schedule training."""
        ...

    async def forget(self, user: str) -> bool:
        """The user is being erased: stop training for them and drop every adapter version the
        engine holds of theirs (the store deletes whatever files are left right after). True
        when this removed the user's adapter folder, so the erasure receipt can say so."""
        ...

    def pause(self, reason: str) -> None:
        """Admission says shed fine-tuning: release activations, stop scheduling stages."""
        ...

    def resume(self) -> None: ...

    async def checkpoint(self) -> None:
        """Shutdown: persist what must survive a restart (published versions already are)."""
        ...

    def holds_model(self) -> str | None:
        """Why fine-tuning needs the model loaded now (engine.keep_alive), or None."""
        ...


class BaseModelOnly:
    """No trainer wired in: every request runs on the base model; adapter versions the store knows
    of are listed, but none is served or rolled back."""

    name = "none"

    def __init__(self, store: FeedbackStore | None) -> None:
        self.store = store
        self.paused_reason: str | None = None

    def status(self) -> dict[str, Any]:
        return {"available": False, "trainer": self.name, "paused": self.paused_reason,
                "note": "fine-tuning is not wired into this daemon build; pairs wait in the store"}

    def memory_bytes(self) -> dict[str, int]:
        return {}

    def resolve_adapter(self, user: str | None, choice: str | int) -> tuple[Any, str | None]:
        if isinstance(choice, int):
            raise ProtocolError("adapter_unavailable", f"adapter version {choice} cannot be served: "
                                "fine-tuning is not available in this daemon build (base model only)")
        return None, None

    async def adapters(self, user: str | None) -> list[dict[str, Any]]:
        if self.store is None or user is None:
            return []
        records = await asyncio.to_thread(self.store.adapter_versions, user)
        return [{"user": r.user_id, "version": r.version, "created_at": r.created_at,
                 "pairs": len(r.pair_ids), "active": False} for r in records]

    async def rollback(self, user: str, version: int) -> dict[str, Any]:
        raise ProtocolError("not_supported", "adapter rollback needs the fine-tuning runtime, which is "
                            "not wired into this daemon build")

    def on_feedback(self, user: str, pair_ids: tuple[int, ...]) -> None:
        return None

    async def forget(self, user: str) -> bool:
        return False

    def pause(self, reason: str) -> None:
        self.paused_reason = reason

    def resume(self) -> None:
        self.paused_reason = None

    async def checkpoint(self) -> None:
        return None

    def holds_model(self) -> str | None:
        return None
