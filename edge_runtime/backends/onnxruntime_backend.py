"""The ONNX Runtime backend: runs each scheduled batch through the exported step graph.

Same contract as `TorchBackend.execute` (logits of the sampling rows, float32, batch order); the
engine, scheduler, paged KV cache and per-request adapters are ours and unchanged. The cache
slab is bound to the session by pointer (no copy); each run returns this step's keys/values,
which are written into their slots here. Providers: TensorRT EP -> CUDA EP -> CPU, as present.
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from edge_runtime.backends.base import Backend
from edge_runtime.backends.dense_kv import DenseKV
from edge_runtime.backends.onnx_export import model_hash
from edge_runtime.backends.onnx_spec import (
    TORCH_KV_DTYPES,
    GraphSpec,
    rope_by_row,
    rope_table_rows,
    weight_format,
    with_gqa_window,
)
from edge_runtime.backends.ort_graphs import StepGraphs
from edge_runtime.backends.ort_session import (
    GPU_PROVIDERS,
    OrtSession,
    bind_cpu_inputs,
    onnx_type,
    pick_providers,
    run_options,
)
from edge_runtime.backends.step_inputs import (
    DecodeInputs,
    StepItem,
    StepPlan,
    pad_lone_row,
    place_logits,
    plan_dense_step,
    plan_gqa_step,
    plan_step,
    split_groups,
    split_groups_gqa,
)
from edge_runtime.errors import ModelNotAvailable
from edge_runtime.kv.cache import KVCache
from edge_runtime.lora.registry import AdapterRegistry
from edge_runtime.model.llama import LlamaModel, LoraApplier

if TYPE_CHECKING:
    from edge_runtime.sched.scheduler import Batch


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    runs_onnx_weights = True
    verifies_drafts = True  # a draft's rows run as a continuation chunk, each yielding logits

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        adapters: AdapterRegistry | None = None,
        *,
        quantization: str = "none",
        flavour: str | None = None,
        cache_dir: str | Path | None = None,
        num_threads: int = 0,
        pad_single_row: bool = False,
        providers: list | None = None,
        max_batch: int = 32,
        max_tokens: int = 256,
        max_context: int = 0,
        kv_layout: str = "dense",
        dense_kv_bytes: int = 0,
        row_invariant: bool = False,
    ) -> None:
        self.model = model
        self.cfg = model.cfg
        self.cache = cache
        self.adapters = adapters
        self.device = cache.data.device
        self.pad_single_row = pad_single_row
        kv_dtype = TORCH_KV_DTYPES.get(cache.data.dtype)
        if kv_dtype is None:
            raise ValueError(f"the ONNX backends cannot bind a {cache.data.dtype} KV cache")
        root = Path(cache_dir) if cache_dir else None
        self.providers = providers or pick_providers(root / "trt" if root else None, self.device)
        names = [p[0] if isinstance(p, tuple) else p for p in self.providers]
        if self.device.type == "cuda" and not any(name in GPU_PROVIDERS for name in names):
            raise ModelNotAvailable(
                f"the KV cache is on {self.device}, but this onnxruntime build has no GPU provider "
                f"(it has {', '.join(names)}): install onnxruntime-gpu (on a Jetson, NVIDIA's wheel for "
                "JetPack), or load the engine with device='cpu'"
            )
        if flavour is None:
            # TensorRT takes only standard ops; ONNX Runtime's own kernels prefer the fused ones.
            flavour = "standard" if "TensorrtExecutionProvider" in names else "ort"
        if flavour != "ort":
            kv_layout = "paged"  # the dense layout is GroupQueryAttention's shared buffer
        # Decode rows as two-row queries, each in a run of its own (step_inputs.query_pad, #31).
        self.row_invariant = row_invariant and flavour == "ort"
        spec = GraphSpec(**weight_format(quantization), flavour=flavour, kv_dtype=kv_dtype,  # type: ignore[arg-type]
                         kv_layout=kv_layout, rope_positions=rope_table_rows(self.cfg, flavour, max_context, cache.num_blocks * cache.block_size))
        # A sliding window's GroupQueryAttention attribute, as the kernels these providers run count it
        # (TensorRT takes no contrib op, so its EP is left out of the probe).
        self.spec = with_gqa_window(spec, model, tuple(n for n in names if n != "TensorrtExecutionProvider"))
        # Dense layout: per-sequence rows beside the paged cache (dense_kv.py), at most `dense_kv_bytes` (0 = as many token positions as the paged cache has, in float32); never past the rotary table.
        self.dense: DenseKV | None = None
        if kv_layout == "dense":
            limit = dense_kv_bytes or cache.data.shape[2] * DenseKV(cache, None, 0).token_bytes
            self.dense = DenseKV(cache, limit, self.spec.rope_positions or max_context or self.cfg.max_position_embeddings)
        self.cache_dir = cache_dir
        self.num_threads = num_threads
        self.max_batch, self.max_tokens, self.max_context = max_batch, max_tokens, max_context
        # Rotary table rows as an input: the "ort" graph's for LongRoPE / partial rotary ("standard": always).
        self.rope_rows = flavour == "ort" and rope_by_row(self.cfg)
        # The export key's digest of every weight, taken once: the LoRA graph's export reuses it.
        self.weights_digest = model_hash(model)  # the prefix store keys its KV blocks by it too
        # The graphs without LoRA nodes (16 fewer a layer) and with them, each opened on first use.
        self.graphs = StepGraphs(model, self.spec, cache_dir, num_threads, self.weights_digest, self._providers_for,
                                 self._bind_cache_of if self.dense is None else None, adapters)
        self._decode_inputs: DecodeInputs | None = None  # the dense layout's steady decode step
        self.model_path = self._session(lora=False).path

    def determinism(self) -> tuple[bool, str]:
        gpu = [n for n in (p[0] if isinstance(p, tuple) else p for p in self.providers) if n in GPU_PROVIDERS]
        if gpu:
            return False, (f"ONNX Runtime on {gpu[0]}: GPU kernels and TensorRT engines are chosen by the "
                           "step's shapes, so a row's rounding can follow its batch")
        grid = "ONNX Runtime on the CPU: prefill chunks on the block grid, never a prompt row alone (#31)"
        return True, grid + ("; each decode row a two-row query in a run of its own" if self.row_invariant else
                             "; not a decode row against the same position in a chunk (engine.deterministic)")

    # -- sessions and binding -------------------------------------------------------------------

    def _session(self, lora: bool) -> OrtSession:
        return self.graphs.session(lora)

    @property
    def _sessions(self) -> dict[bool, OrtSession]:
        """The open sessions by whether the graph has LoRA inputs (tests and tools inspect them)."""
        return self.graphs.sessions

    def _providers_for(self, path: Path) -> list:
        """TensorRT EP gets one explicit shape profile (edge_runtime.backends.shape_profiles), so it never
        rebuilds engines when a step's shapes change."""
        out = []
        for p in self.providers:
            if isinstance(p, tuple) and p[0] == "TensorrtExecutionProvider":
                from edge_runtime.backends.shape_profiles import StepLimits, ort_trt_profile_options

                limits = StepLimits(max_batch=self.max_batch, max_tokens=self.max_tokens,
                                    max_context=self.max_context or self.cfg.max_position_embeddings,
                                    cache_rows=self.cache.data.shape[2] * self.cfg.num_kv_heads)
                p = (p[0], {**p[1], **ort_trt_profile_options(path, limits)})
            out.append(p)
        return out

    @property
    def held_bytes(self) -> int:
        """Memory beside the engine's model and paged KV cache, for the ledger: what opening each
        graph added to resident memory (pre-packed weights, initializers still mapped; the data
        file's size where /proc cannot say) and the dense KV rows at their byte limit (they grow
        inside a run, where the ledger cannot look)."""
        return self.graphs.held_bytes + self._dense_limit()

    @property
    def reserved_bytes(self) -> int:
        """The most `held_bytes` may become (`StepGraphs.reserved_bytes`)."""
        return self.graphs.reserved_bytes + self._dense_limit()

    def _dense_limit(self) -> int:
        return 0 if self.dense is None else self.dense.limit_bytes or 0

    @property
    def session(self):
        """The base-model session (benchmarks and tools inspect it)."""
        return self._session(lora=False).inference

    def _ort_device(self) -> tuple[str, int]:
        return ("cuda", self.device.index or 0) if self.device.type == "cuda" else ("cpu", 0)

    def _bind_cache_of(self, session: OrtSession) -> None:
        self._bind_cache(session.binding)

    def _bind_cache(self, binding) -> None:
        """Bind every layer's key and value slab [slots * kv_heads, head_dim] in place."""
        dev, idx = self._ort_device()
        elem = onnx_type(self.cache.data.dtype)
        d = self.cfg.head_dim
        for layer in range(self.cfg.num_layers):
            for kv, kind in enumerate(("key", "value")):
                slab = self.cache.data[layer, kv]
                assert slab.is_contiguous()
                binding.bind_input(f"cache.{layer}.{kind}", dev, idx, elem, [slab.numel() // d, d], slab.data_ptr())

    # -- execution ----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: Batch, lora: LoraApplier | None = None) -> torch.Tensor:
        """Logits [rows that sample, vocab] in float32, in batch order; each item's pinned adapter
        version applies to its rows."""
        if lora is not None:
            raise ValueError("the ONNX backends apply each row's pinned adapter from the registry; an explicit "
                             "LoRA applier is a torch-backend argument")
        refs = [item.seq.request.served if self.adapters is not None else None for item in batch.items]
        if self.dense is not None:
            return self._execute_dense(batch, refs)
        out: list[torch.Tensor | None] = [None] * len(batch.items)
        q_lens = [item.num_tokens for item in batch.items]
        if self.spec.flavour == "ort":
            groups = split_groups_gqa(q_lens, [item.seq.num_computed for item in batch.items], 2.0, self.row_invariant)
        else:
            groups = split_groups(q_lens)
        for group in groups:
            place_logits(out, group, batch.items, self.run_items([batch.items[i] for i in group], [refs[i] for i in group]))
        return self._joined(out)

    def _joined(self, out: list[torch.Tensor | None]) -> torch.Tensor:
        sampled = [t for t in out if t is not None]
        return torch.cat(sampled) if sampled else torch.empty(0, self.cfg.vocab_size)

    def _execute_dense(self, batch: Batch, refs: list) -> torch.Tensor:
        """Dense layout: decode rows in one run over rows [first, last] of the per-sequence
        buffer (rows of sequences not in this step ride along idle), first chunks in runs of
        consecutive rows, continuation chunks alone."""
        dense = self.dense
        assert dense is not None
        items = batch.items
        logits = self._decode_step(items, refs)
        if logits is not None:
            return logits
        dense.release_stale(id(item.seq) for item in items)
        q_lens = [item.num_tokens for item in items]
        out: list[torch.Tensor | None] = [None] * len(items)
        for group in split_groups_gqa(q_lens, [item.seq.num_computed for item in items], 2.0, self.row_invariant):
            rows = dense.assign(items[i].seq for i in group)
            order = sorted(range(len(group)), key=rows.__getitem__)
            runs: list[list[tuple[int, int]]] = []
            for k in order:
                if runs and (q_lens[group[0]] == 1 or runs[-1][-1][1] == rows[k] - 1):
                    runs[-1].append((group[k], rows[k]))
                else:
                    runs.append([(group[k], rows[k])])
            for run in runs:
                logits = self._run_dense_rows([items[i] for i, _ in run], [refs[i] for i, _ in run],
                                              [r for _, r in run])
                sampling = [i for i, _ in run if items[i].samples]
                if len(sampling) == len(items) and sampling == list(range(len(items))):
                    return logits  # the usual decode step: one run, rows already in batch order
                place_logits(out, [i for i, _ in run], items, logits)
        return self._joined(out)

    def _decode_step(self, items: list, refs: list) -> torch.Tensor | None:
        """The steady decode step of the dense layout, or None where it does not apply: every
        item feeds one token and samples, the rows in use are exactly the items' (in any
        order) and already hold each context (nothing to free, assign, fill or grow). Then the
        run is `_run_dense_rows`'s over rows [0, n) (same inputs, bindings and copy to the
        paged cache) with preallocated inputs filled in place instead of a plan, and the
        graph's `logit_rows` returns the logits in batch order: this runs once per token of
        every stream, so its Python is the engine's host overhead per token."""
        dense = self.dense
        assert dense is not None
        n = len(items)
        if n == 0 or n != len(dense.owners) or self.row_invariant:
            return None
        valid, row_of = dense.valid, dense.row_of
        capacity, size = dense.capacity, self.cache.block_size
        rows, tokens, starts, slots, offsets = [], [], [], [], []
        rope = self.model.rope
        for item in items:
            seq = item.seq
            start = seq.num_computed
            row = row_of.get(id(seq))
            if (row is None or item.num_tokens != 1 or valid[row] != start or start >= capacity
                    or len(seq.token_ids) != start + 1):
                return None
            rows.append(row)
            tokens.append(seq.token_ids[start])
            starts.append(start)
            slots.append(seq.block_table[start // size] * size + start % size)
            offsets.append(rope.offset(start + 1))
        adapters = self._slots(refs)
        session = self._session_with_stack(tuple(adapters))
        lora = session.has_lora_inputs
        inputs = self._decode_inputs
        if inputs is None or inputs.rows < n:
            inputs = self._decode_inputs = DecodeInputs(max(n, dense.rows_capacity))
        inputs.fill(rows, tokens, starts, slots, [-1 if r is None else adapters[r] for r in refs] if lora else None,
                    offsets)
        key = (inputs, n)  # holds the arrays: a pointer bound here never outlives them
        if session.inputs_key != key:  # bound by pointer: later steps only refill the arrays
            for name, array in inputs.views(n, lora, self.rope_rows).items():
                session.binding.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
            session.inputs_key = key
        self._bind_dense(session, dense, 0, n)
        logits = self._run_bound(session, n)
        for row, start in zip(rows, starts, strict=True):
            valid[row] = start + 1
        dense.copy_to_cache(inputs.logit_rows[:n], inputs.positions[:n], inputs.slot_mapping[:n])
        return logits

    def _run_dense_rows(self, items: list, refs: list, rows: list[int]) -> torch.Tensor:
        """One graph run over buffer rows [rows[0], rows[-1]] (`rows` ascending, one per item);
        rows between them that have no item here run idle. Returns the sampling items' logits,
        in `items` order."""
        dense = self.dense
        assert dense is not None
        slots = self._slots(refs)
        first, last = rows[0], rows[-1]
        by_row = dict(zip(rows, range(len(items)), strict=True))
        steps, idle, real = [], [], []
        for row in range(first, last + 1):
            k = by_row.get(row)
            if k is None:  # a running sequence not in this step: one harmless dummy token
                steps.append(StepItem([0], dense.valid[row], [], False))
                idle.append(True)
                continue
            item, ref = items[k], refs[k]
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed
            steps.append(StepItem(item.tokens(), start, seq.block_table, item.samples, -1 if ref is None else slots[ref],
                                  self.model.rope.offset(seq.num_tokens), item.num_logits))
            idle.append(False)
            real.append((row, seq.block_table, start, start + n))
        steps = pad_lone_row(steps, self.model.rope.rows) if self.row_invariant else steps
        capacity = max(st.start + len(st.tokens) for st in steps)
        target, base = dense, first
        if not dense.ensure(last + 1, capacity):
            # Past the byte limit: this run gets a scratch buffer filled from the paged cache.
            target, base = DenseKV(self.cache, None, capacity), 0
            target.ensure(len(items), capacity)
            target.assign(item.seq for item in items)
            real = [(k, table, start, end) for k, (_, table, start, end) in enumerate(real)]
            steps = [st for st, i in zip(steps, idle, strict=True) if not i]
            idle = [False] * len(steps)
        for row, table, start, _ in real:
            target.fill(row, table, start)
        key = tuple(slots)
        session = self._session_with_stack(key)
        plan = plan_dense_step(steps, idle, self.cache.block_size, self.rope_rows)
        self._bind_dense(session, target, base, len(steps))
        logits, _, plan = self._run(session, plan)
        for row, _, _, end in real:
            target.valid[row] = end
        # This step's keys/values sit in the rows; the paged cache gets a copy at their slots.
        width = plan.num_tokens // len(steps)
        target.copy_to_cache(base + plan.real_rows // width, plan.real_positions, plan.slot_mapping)
        return logits  # rows are sorted, so the sampling rows come in `items` order

    @staticmethod
    def _slots(refs: list) -> dict[Hashable, int]:
        """Each adapter version's slot in the step's stacked adapters, in order of first use."""
        return {ref: i for i, ref in enumerate(dict.fromkeys(r for r in refs if r is not None))}

    def _session_with_stack(self, key: tuple[Hashable, ...]) -> OrtSession:
        return self.graphs.with_stack(key)

    def _bind_dense(self, session: OrtSession, dense: DenseKV, first: int, count: int) -> None:
        """Bind rows [first, first + count) of `dense` as every layer's past and present."""
        key = (dense.buffer.data_ptr(), dense.rows_capacity, dense.capacity, first, count)
        if session.dense_key == key:
            return
        dev, idx = self._ort_device()
        shape = [count, self.cfg.num_kv_heads, dense.capacity, self.cfg.head_dim]
        binding = session.binding
        for layer in range(self.cfg.num_layers):
            for kv, kind in enumerate(("key", "value")):
                ptr = dense.row_pointer(layer, kv, first)
                binding.bind_input(f"past.{layer}.{kind}", dev, idx, np.float32, shape, ptr)
                binding.bind_output(f"present.{layer}.{kind}", dev, idx, np.float32, shape, ptr)
        session.dense_key = key

    def run_items(self, items: list, refs: list) -> torch.Tensor:
        """One graph run over scheduled items (all decode rows, or a group of prefill chunks)."""
        slots = self._slots(refs)
        steps = []
        for item, ref in zip(items, refs, strict=True):
            seq = item.seq
            start = seq.num_computed
            steps.append(StepItem(item.tokens(), start, seq.block_table, item.samples, -1 if ref is None else slots[ref],
                                  self.model.rope.offset(seq.num_tokens), item.num_logits))
        steps = pad_lone_row(steps, self.model.rope.rows) if self.row_invariant else steps
        key = tuple(slots)
        session = self._session_with_stack(key)
        logits, new_kv, plan = self._run(session, self.plan(steps))
        if plan.real_rows is None:
            new_kv = new_kv[:, : plan.real_tokens]
        else:
            new_kv = new_kv[:, torch.from_numpy(plan.real_rows).to(self.device)]
        self._write_kv(new_kv, plan.slot_mapping[: plan.real_tokens])
        return logits

    def plan(self, steps: list[StepItem], pad_single_row: bool | None = None) -> StepPlan:
        cfg = self.cfg
        pad = self.pad_single_row if pad_single_row is None else pad_single_row
        if self.spec.flavour == "ort":
            return plan_gqa_step(steps, self.cache.block_size, cfg.num_kv_heads, pad, self.rope_rows)
        return plan_step(steps, self.cache.block_size, cfg.num_heads, cfg.num_kv_heads, cfg.layer_windows, pad)

    def _run(self, session: OrtSession, plan: StepPlan):
        cfg = self.cfg
        if not session.has_lora_inputs:
            plan.inputs.pop("lora_index", None)
        bind_cpu_inputs(session, plan.inputs)
        new_kv = None
        if self.dense is None:  # the dense layout's new keys/values stay in its rows
            dev, idx = self._ort_device()
            new_kv = torch.empty(cfg.num_layers, plan.num_tokens, 2 * cfg.kv_size, dtype=self.cache.data.dtype,
                                 device=self.device)
            session.binding.bind_output("new_kv", dev, idx, onnx_type(new_kv.dtype), list(new_kv.shape),
                                        new_kv.data_ptr())
        return self._run_bound(session, len(plan.sampling_items), plan.num_tokens), new_kv, plan

    def _run_bound(self, session: OrtSession, rows: int, tokens: int = 0) -> torch.Tensor:
        """Run with the inputs already bound over `tokens` tokens (0: `rows`); returns the
        logits of `rows` sampling rows (a fresh tensor each run: callers may keep it)."""
        binding = session.binding
        dev, idx = self._ort_device()
        logits = torch.empty(rows, self.cfg.vocab_size, dtype=torch.float32, device=self.device)
        if rows:
            binding.bind_output("logits", dev, idx, np.float32, [rows, self.cfg.vocab_size], logits.data_ptr())
        else:
            binding.bind_output("logits", dev, idx)
        session.inference.run_with_iobinding(binding, run_options(tokens or rows))
        return logits

    def _write_kv(self, new_kv: torch.Tensor, slot_mapping: np.ndarray) -> None:
        write_new_kv(self.cache, new_kv, slot_mapping)

    # -- scoring (benchmarks, accuracy reports) -------------------------------------------------

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [n, vocab] at every position of one fresh sequence, base model; the KV cache
        is neither read (every key is new) nor written."""
        n = len(token_ids)
        blocks = -(-n // self.cache.block_size)
        item = StepItem(list(token_ids), 0, [0] * blocks, True, rope_offset=self.model.rope.offset(n))
        session = self._session_with_stack(())
        if self.dense is None:
            plan = self.plan([item], pad_single_row=False)
        else:  # a scratch row: the engine's rows and paged cache stay untouched
            scratch = DenseKV(self.cache, None, n)
            scratch.ensure(1, n)
            plan = plan_dense_step([item], [False], self.cache.block_size, self.rope_rows)
            self._bind_dense(session, scratch, 0, 1)
        plan.inputs["logit_rows"] = np.arange(n, dtype=np.int64)
        if not session.has_lora_inputs:
            plan.inputs.pop("lora_index")
        bind_cpu_inputs(session, plan.inputs)
        if self.dense is None:
            session.binding.bind_output("new_kv", *self._ort_device())
        return self._run_bound(session, n).cpu()


def write_new_kv(cache: KVCache, new_kv: torch.Tensor, slot_mapping: np.ndarray) -> None:
    """Store a run's keys/values, new_kv [layers, T, 2 * kv_heads * head_dim], at their slots."""
    layers, t = new_kv.shape[0], new_kv.shape[1]
    heads, d = cache.data.shape[3], cache.data.shape[4]
    src = new_kv.reshape(layers, t, 2, heads, d).permute(0, 2, 1, 3, 4)
    cache.data.index_copy_(2, torch.from_numpy(slot_mapping).to(cache.data.device), src)
