"""Per-user LoRA adapters: settings, tensors, PEFT-format snapshots, the version registry with
its cache, and the batched multi-LoRA applier the engine's forward calls."""

from edge_runtime.lora.batched import BatchedLoraApplier, applier_for
from edge_runtime.lora.config import AdapterError, LoraSettings
from edge_runtime.lora.registry import AdapterRef, AdapterRegistry
from edge_runtime.lora.weights import LoraWeights, TrainingLora

__all__ = [
    "AdapterError",
    "AdapterRef",
    "AdapterRegistry",
    "BatchedLoraApplier",
    "LoraSettings",
    "LoraWeights",
    "TrainingLora",
    "applier_for",
]
