"""The ONNX Runtime backend's two step graphs (without and with LoRA inputs): each exported and
opened on first use, what opening it added to resident memory, which of them stay open (one
pre-packed copy of the weights for a large model), and the adapters' stacks bound to them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import replace
from pathlib import Path

from edge_runtime.backends import ort_prefetch
from edge_runtime.backends.lora_stack import LoraStackCache
from edge_runtime.backends.onnx_export import DATA_FILE, export_step
from edge_runtime.backends.onnx_spec import GraphSpec
from edge_runtime.backends.ort_session import OrtSession, open_session
from edge_runtime.c_heap import give_heap_back
from edge_runtime.lora.registry import AdapterRegistry
from edge_runtime.model.llama import LlamaModel
from edge_runtime.model.mapped_weights import paging_out, resident_bytes

# A base graph holding more than this is closed when the LoRA graph opens, which then serves base
# rows too (an empty stack: their delta is exactly 0): one pre-packed copy of the weights, not two
# (an 8B graph holds ~7 GB). Smaller graphs keep both: base steps skip the LoRA nodes (~1.8 ms).
ONE_GRAPH_BYTES = 256 << 20


class StepGraphs:
    """The open sessions by `lora` (whether the graph has LoRA inputs). `bind_cache(session)` binds
    a newly opened session's KV inputs; `providers_for(path)` gives the providers of a graph."""

    def __init__(self, model: LlamaModel, spec: GraphSpec, cache_dir: str | Path | None, num_threads: int,
                 digest: str, providers_for: Callable[[Path], list],
                 bind_cache: Callable[[OrtSession], None] | None, adapters: AdapterRegistry | None) -> None:
        self.model, self.spec, self.cache_dir, self.num_threads = model, spec, cache_dir, num_threads
        self.digest = digest
        self.providers_for, self.bind_cache = providers_for, bind_cache
        self.adapters = adapters
        self.stacks = LoraStackCache(model.cfg)
        # An engine that never serves adapters never loads the LoRA graph (ONE_GRAPH_BYTES).
        self.sessions: dict[bool, OrtSession] = {}

    def session(self, lora: bool) -> OrtSession:
        session = self.sessions.get(lora) or self.sessions.get(True)  # base rows fit the LoRA graph
        if session is None:
            if lora and self.one_graph:
                del self.sessions[False]  # freed before the LoRA graph packs the same weights again
            path = export_step(self.model, replace(self.spec, lora=lora), self.cache_dir, self.digest)
            # The closed session's packed weights and the export's temporaries are freed into the C
            # heap, which keeps much of them (1B: ~380 MiB of the base graph's 1.3 GB) beside the
            # packing about to start unless trimmed (#28).
            give_heap_back()
            before = resident_bytes()
            with paging_out(path.with_name(DATA_FILE)):  # what pre-packing read and no kernel reads again
                session = open_session(path, self.providers_for(path), self.num_threads, has_lora_inputs=lora)
            after = resident_bytes()
            # What the session holds (pre-packed weights, initializers still mapped), each kind's
            # own growth: under pressure the kernel drops other file pages meanwhile (8B: 3.4 of 7 GB).
            grown = sum(max(0, a - b) for a, b in zip(after, before, strict=True))
            if sum(before) and grown and not session.prefetched:  # its thread measured it
                session.weights_bytes = grown
                if (prefetch := ort_prefetch.current()) is not None:
                    prefetch.note_opened(path, grown)
            if self.bind_cache is not None:
                self.bind_cache(session)
            self.sessions[lora] = session
        return session

    def with_stack(self, key: tuple[Hashable, ...]) -> OrtSession:
        """The session for this step (with LoRA inputs when any row has an adapter), its stacked
        adapter inputs bound to `key`'s versions in slot order (rebound only when they change)."""
        session = self.session(lora=bool(key))
        if session.has_lora_inputs and key != session.bound_stack:  # () binds the no-adapter stack
            weights = [self.adapters.served_weights(ref) for ref in key]  # type: ignore[union-attr]
            for name, array in self.stacks.get(key, weights).items():
                session.binding.bind_cpu_input(name, array)
            session.bound_stack = key
        return session

    @property
    def one_graph(self) -> bool:
        return getattr(self.sessions.get(False), "weights_bytes", -1) >= ONE_GRAPH_BYTES

    @property
    def held_bytes(self) -> int:
        """What opening each open graph added to resident memory."""
        return sum(s.weights_bytes for s in self.sessions.values())

    @property
    def reserved_bytes(self) -> int:
        """The most `held_bytes` may become: the LoRA graph opens on the first adapter row and
        holds the same weights again, beside the base graph's below `ONE_GRAPH_BYTES`."""
        graphs = 1 if self.one_graph or False not in self.sessions else 2
        return graphs * next(iter(self.sessions.values())).weights_bytes
