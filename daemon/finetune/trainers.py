"""The per-user trainer's moves between jobs, on the engine thread: train on from the served version
(after a rollback or a refused degenerate candidate), on top of the served fleet version, and
cancel every queued update. No scheduling, no store."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edge_runtime.engine import Engine
    from edge_runtime.train.trainer import AdapterTrainer


def reset_trainer(engine: Engine, user: str, trainer: AdapterTrainer, base_if_none: bool = False) -> None:
    """Train on from the user's served version; with none served, from a fresh adapter (the
    base) if `base_if_none`, else leave the trainer as it is."""
    import torch

    from edge_runtime.lora.weights import LoraWeights

    served = engine.adapters.newest(user)
    if served is not None:
        trainer.reset(engine.adapters.weights(served).to(torch.float32))
    elif base_if_none:
        trainer.reset(LoraWeights.init(trainer.model.cfg, trainer.weights.settings, seed=trainer.dpo.seed))


def train_on_served_fleet(engine: Engine, trainer: AdapterTrainer) -> None:
    """Put the fleet version new requests are served with beneath the user's adapter, so the
    next batch trains on top of what is served (called between a user's batches, when none of
    its tasks is in flight)."""
    from edge_runtime.lora.registry import FLEET

    ref = engine.adapters.newest(FLEET)
    key = "" if ref is None else ref.key
    if key != trainer.fleet_key:
        trainer.set_fleet(None if ref is None else engine.adapters.weights(ref), key)


def cancel_all(engine: Engine) -> int:
    users = {job.user for job in engine.scheduler.finetune.jobs.values()}
    return sum(engine.cancel_finetune(user=user) for user in users if user is not None)
