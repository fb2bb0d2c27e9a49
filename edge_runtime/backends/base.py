"""`Backend`: what the engine may ask of a backend (run a batch, say what memory it holds, say
which engine features it can serve). Every backend states it implements it; the engine asks
this interface, never a backend's name or private members.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from edge_runtime.model.llama import LoraApplier
    from edge_runtime.sched.batch import Batch


@runtime_checkable
class Backend(Protocol):
    """Runs one scheduled batch on the engine's model, KV cache and adapters."""

    name: str  # "torch", "onnxruntime", "tensorrt": stats, cost-cache keys, logs
    # Decode KV pruning and compaction (docs/kv.md) write a per-head retained layout that only
    # the torch attention reads; the exported graphs attend to every position.
    reads_pruned_kv: bool = False
    # Whether the backend runs exported weights in `config.onnx_quantization`'s format (so the
    # format it serves is that one, not "none").
    runs_onnx_weights: bool = False
    # Whether `execute` feeds a decode row's draft tokens (ScheduledSeq.draft) and returns the
    # logits of each of its rows (speculative decoding, edge_runtime.spec).
    verifies_drafts: bool = False

    @property
    def held_bytes(self) -> int:
        """Bytes it holds beside the model and the paged KV cache (an exported graph's own
        weights, dense KV rows): weight-like, counted by the ledger, shed by nothing."""
        return 0

    @property
    def reserved_bytes(self) -> int:
        """The most `held_bytes` may grow to while serving (part of the derived memory budget)."""
        return 0

    def execute(self, batch: Batch, lora: LoraApplier | None = None) -> torch.Tensor:
        """Logits [rows that sample, vocab] in float32, in batch order (an item with a draft
        yields `num_logits` rows, its fed rows' in order); the batch's new keys and values are
        written to the KV cache. `lora`: an explicit applier (torch only)."""
        ...

    def stats(self) -> dict:
        """Backend-specific figures for the engine's stats (the torch backend's CUDA graphs)."""
        return {}

    def determinism(self) -> tuple[bool, str]:
        """Whether a row's logits depend on that row alone (its request, adapter and position),
        never on the rows beside it, how its prompt was chunked or whether its past came from the
        prefix cache (issue #31; docs/scheduler.md), and why."""
        return False, f"the {self.name} backend's kernels are not known to be row-invariant"
