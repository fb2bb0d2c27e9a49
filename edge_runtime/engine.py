"""The engine: requests in, tokens out, one iteration at a time; the public facade.

`step()` is the whole algorithm (MACE's Algorithm 1): the scheduler packs a bin of decode steps,
prefill chunks and fine-tune stages, the runner (runner.py) runs its forward, the committer
(commit.py) samples, streams and stops, and the fine-tune supervisor (sched/supervisor.py) runs
its stages. The engine owns the requests in flight and wires these parts together. Not
thread-safe: the daemon calls it from one engine thread and hands work in through queues.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from edge_runtime import intake, sizing
from edge_runtime.backends.auto import SELF_CHECK_PROMPTS, choose_backend
from edge_runtime.backends.base import Backend
from edge_runtime.chat import ChatPrompt
from edge_runtime.commit import TokenCommitter, emit
from edge_runtime.config import EngineConfig
from edge_runtime.constraints import GrammarCompiler
from edge_runtime.errors import BadRequest, UnknownRequest
from edge_runtime.ids import validate_request_id
from edge_runtime.intake import Prompt
from edge_runtime.kv.block_pool import BlockPool
from edge_runtime.kv.cache import KVCache, bytes_per_block
from edge_runtime.kv.compaction_timing import compact_due
from edge_runtime.kv.prefix_tier import PrefixTier, weights_digest
from edge_runtime.kv.pruning import HeadPruning, PruningSettings
from edge_runtime.loading import load_model
from edge_runtime.lora.registry import FLEET, AdapterRef, AdapterRegistry
from edge_runtime.lora.weights import LoraWeights
from edge_runtime.memory import MemoryKind, MemoryLedger, ShedReport
from edge_runtime.model.llama import LlamaModel
from edge_runtime.model.mapped_weights import read_per_layer, serving_elsewhere
from edge_runtime.model.tokenizer import Tokenizer
from edge_runtime.outputs import RequestMetrics, RequestOutput, TokenEvent
from edge_runtime.runner import ForwardRunner
from edge_runtime.sampling import SamplingParams
from edge_runtime.sched.bins import settings_determinism
from edge_runtime.sched.cost_model import graph_version, load_cost_model, load_stage_costs
from edge_runtime.sched.finetune import FineTuneJob, FineTuneWork
from edge_runtime.sched.kv_relief import PruneUnderPressure
from edge_runtime.sched.registry import make_policy
from edge_runtime.sched.scheduler import Scheduler
from edge_runtime.sched.supervisor import FineTuneSupervisor
from edge_runtime.sequence import Request, SeqStatus, Sequence

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer,
        config: EngineConfig,
        name: str = "",
        adapters: AdapterRegistry | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.model_name = name
        cfg = model.cfg
        self.grammars = GrammarCompiler(tokenizer, cfg.vocab_size)  # structured output, built on first use
        per_block = bytes_per_block(cfg, config.block_size, model.dtype)
        sizing.check_memory_budget(config, cfg, model.dtype, sizing.weights_bytes(model))
        num_blocks = max(2, sizing.kv_budget_bytes(config, model.device) // per_block)
        self.max_context = sizing.max_context(config, cfg, num_blocks)
        self.limits = intake.PromptLimits(config.max_prompt_chars, self.max_context, cfg.vocab_size)
        self.cache = KVCache(cfg, num_blocks, config.block_size, model.dtype, model.device)
        self.pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_cache,
                              on_idle=self.cache.release_blocks)
        # Per-user LoRA versions; without a root (config.adapters_root) they live in memory.
        self.adapters = adapters or AdapterRegistry(
            config.adapters_root or None, cfg, model.dtype, model.device,
            cache_bytes=config.adapter_cache_bytes, base_model=name,
        )
        self.adapters.preload()
        prompts = ([tokenizer.hf.encode(text)[: config.block_size * 2] for text in SELF_CHECK_PROMPTS]
                   if config.backend == "auto" else [])
        per_layer = read_per_layer(model)  # a block cache's pages: the self-check reads them per layer
        backend, self.backend_choice = choose_backend(config, model, self.cache, self.adapters, self.pool, prompts)
        self.mapped = serving_elsewhere(per_layer, backend.runs_onnx_weights)
        self.kv_pruning = PruningSettings.from_config(config)
        if self.kv_pruning is not None and (not backend.reads_pruned_kv or any(w is not None for w in cfg.layer_windows)
                                            or cfg.attn_softcap is not None):
            raise ValueError("KV pruning runs on the torch backend, for models without sliding windows or attention "
                             "soft-capping, so far (docs/kv.md); set kv_prune_policy='off'")
        self.clock = time.monotonic  # the one scheduling clock (tests may substitute a fake)
        # The collaborators read the clock through the engine, so a substitute reaches them all.
        clock = self._read_clock
        # cost_profile "background": without a cached calibration, nominal costs until idle ones (`calibrate_step`).
        self.costs, self._calibration = load_cost_model(
            cfg, model.dtype, model.device, self._costs_key, backend.execute, self.pool, per_block,
            mode=config.cost_profile, cache_dir=config.cost_cache_dir, scale=config.cost_scale, graph=graph_version(backend),
            max_tokens=config.max_batched_tokens)
        self.runner = ForwardRunner(backend, self.costs, self.pool, cfg.vocab_size, tokenizer.stream_decoder, clock)
        self.ledger = MemoryLedger(sizing.ledger_budget_bytes(config, model, self.cache, self.adapters, self.costs,
                                                              backend, self.mapped))
        self.ledger.set(MemoryKind.WEIGHTS, "model", sizing.resident_weights_bytes(model, self.mapped))
        self._note_backend_memory()
        self.ledger.register_shedder(MemoryKind.ADAPTERS, self._shed_adapters)
        kv_relief = None
        if self.kv_pruning is not None and self.kv_pruning.when == "pressure":
            kv_relief = PruneUnderPressure(self._start_pruning, self.kv_pruning.capacity + self.kv_pruning.sinks,
                                           config.block_size)
        self.scheduler = Scheduler(
            self.pool, make_policy(config.policy, config.policy_params), self.costs, self.ledger,
            max_batched_tokens=config.max_batched_tokens, max_num_seqs=config.max_num_seqs,
            slo_ttft_factor=config.slo_ttft_factor, rope_switch=cfg.rope_switch, kv_relief=kv_relief,
        )
        self.scheduler.prefix_tier = self.prefixes = PrefixTier.open(
            config.prefix_store_dir, config.prefix_store_bytes, self.cache, self.pool, lambda: {
                "model": name, "weights": weights_digest(backend, model), "format": self._costs_key})
        # Reuse to a prompt's last token (docs/scheduler.md): rows invariant off the grid (not the ONNX graphs), in the slab.
        self.scheduler.copy_rows = self.cache.copy_rows if backend.determinism()[0] and not backend.runs_onnx_weights else None
        self._set_slo()
        self.requests: dict[str, Request] = {}
        self.committer = TokenCommitter(self.grammars, tokenizer.eos_ids, cfg.vocab_size, self.max_context,
                                        self.scheduler, self.requests, self._end_request, self._fail_request, clock, (config, backend))
        self.finetune = FineTuneSupervisor(self.scheduler, self.ledger, self.costs, clock)
        self.finetune.after_stages = self.mapped.release_all if self.mapped is not None else None
        self.scheduler.finetune.max_restarts = config.finetune_max_restarts
        self._seq_ids = itertools.count()
        self._req_ids = itertools.count()
        self.iterations = 0
        self.kv_compactions = 0  # times a pruned sequence's KV was packed and blocks given back
        self.last_iteration_s = 0.0
        # Called on the engine thread once an iteration's tokens are out, before its fine-tune stages run.
        self.on_tokens_emitted: Callable[[], None] | None = None

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def load(cls, model: str | Path | None = None, config: EngineConfig | None = None, **overrides: Any) -> Engine:
        """Load a model (None = the default SmolLM2-135M-Instruct) and build an engine for it."""
        config = (config or EngineConfig()).replace(**overrides, **({} if model is None else {"model": str(model)}))
        net, tokenizer, name = load_model(config)
        return cls(net, tokenizer, config, name=name)

    def _set_slo(self) -> None:
        """The TBT SLO and the iteration's latency budgets: configured, or a multiple of the
        cost model's unloaded decode step (set again when a background calibration lands)."""
        config = self.config
        slo_tbt_s = (config.slo_tbt_ms / 1000 if config.slo_tbt_ms > 0
                     else config.slo_tbt_factor * self.costs.unloaded_decode_s())
        self.scheduler.set_slo(slo_tbt_s, config.iteration_budget_fraction, config.iteration_budget_max_fraction)

    @property
    def calibrating(self) -> bool:
        """A background cost calibration still has shapes to measure."""
        return self._calibration is not None

    def calibrate_step(self, interrupted: Callable[[], bool] = lambda: False) -> None:
        """Measure one more shape of the background calibration (only while no request is in
        flight; fine-tune stages may be queued); the last one replaces the quick or nominal costs
        and the SLO derived from them. `interrupted` (work waiting) is asked between the shape's
        forwards: a request that arrives meanwhile waits for one forward, and the shape is
        measured again later."""
        calibration = self._calibration
        if calibration is None or self.requests:
            return
        try:
            fitted = calibration.step(interrupted)
        except Exception:  # a probe that fails costs the calibration, never the engine
            log.exception("background cost calibration failed; serving on nominal costs, corrected online")
            self._calibration = None
            return
        if calibration.done:
            self._calibration = None
            if fitted is not None:
                self.costs.recalibrate(fitted)
                self._set_slo()

    @property
    def _costs_key(self) -> str:
        """What the cost caches are keyed by besides the machine: the backend and its weights."""
        choice = self.backend_choice
        return choice.name if choice.quantization == "none" else f"{choice.name}/{choice.quantization}"

    def _read_clock(self) -> float:
        return self.clock()

    @property
    def backend(self) -> Backend:
        """The backend the runner executes batches on (tests and tools may swap it)."""
        return self.runner.backend

    @backend.setter
    def backend(self, backend: Backend) -> None:
        self.runner.backend = backend

    @property
    def tokens_generated(self) -> int:
        return self.committer.tokens_generated

    def _note_backend_memory(self) -> None:
        """What the backend holds beside the model and the paged cache (an ONNX Runtime graph's
        own weights, its dense KV rows) is weight-like: the ledger counts it, nothing sheds it."""
        self.ledger.set(MemoryKind.WEIGHTS, "backend", self.backend.held_bytes)

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        on_token: Callable[[TokenEvent], None] | None = None,
        adapter: str | AdapterRef | None = None,
        fleet: bool = True, owner: str = "", scope: str = "",
    ) -> str:
        """Queue a prompt (text or chat messages); returns its request id. `adapter`: a user id
        (that user's newest adapter version, pinned until the request ends; the base model if
        the user has none yet), a specific `AdapterRef`, or None for the base model. Beneath it
        the fleet adapter's newest version is pinned likewise when one is published (`fleet=False`:
        the base model's own weights only). `owner`: whose prompt it is (`prefixes.forget`);
        `scope`: whose prefix cache it shares (an app's own, so no hit tells one app another's)."""
        params = params or SamplingParams()
        if request_id is None:
            request_id = f"req-{next(self._req_ids)}"
        validate_request_id(request_id)
        if request_id in self.requests:
            raise BadRequest(f"request id {request_id!r} is already in flight")
        text, ids, params = intake.encode_request(prompt, params, self.tokenizer, self.limits)
        # One compile per request (a schema or grammar that does not compile is the request's
        # fault); each candidate gets its own copy of the grammar's state.
        matcher = self.grammars.matcher(params.constraint) if params.constraint is not None else None
        now = self.clock()
        pinned, pinned_fleet = intake.pin_adapters(self.adapters, adapter, fleet)
        try:
            request = Request(request_id, text, ids, params, now, on_token=on_token, adapter=pinned,
                              adapter_key=pinned.key if pinned is not None else "", fleet=pinned_fleet,
                              owner=owner, scope=scope, thinking=intake.reply_thinking(prompt, text, self.tokenizer, params))
            request.metrics = RequestMetrics(arrival_time=now, prompt_tokens=len(ids))
            always = self.kv_pruning is not None and self.kv_pruning.when == "always"
            intake.add_candidates(request, matcher, self._seq_ids, self.tokenizer.stream_decoder,
                                  self._start_pruning if always else None)
        except BaseException:
            self.adapters.release(pinned)
            self.adapters.release(pinned_fleet)
            raise
        # Only a request built whole enters the scheduler: a half-added one would run with no
        # one to answer.
        for seq in request.seqs:
            self.scheduler.add(seq)
        self.requests[request_id] = request
        return request_id

    def _start_pruning(self, seq: Sequence) -> None:
        """Decode KV pruning on for `seq` from its next decode step: its positions so far start
        retained, and its heads' norm statistics start now."""
        seq.kv_pruning = HeadPruning(self.kv_pruning, self.model.cfg.num_layers, self.model.cfg.num_kv_heads,
                                     self.model.device)

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a request now; its candidates finish with reason "abort"."""
        request = self.requests.get(request_id)
        if request is None:
            raise UnknownRequest(f"no request {request_id!r} in flight")
        return self._end_request(request, "abort")

    def _end_request(self, request: Request, reason: str, now: float | None = None) -> RequestOutput:
        """Take a request out of flight: candidates still running finish with `reason` (their
        blocks go back, their final event goes out), the adapter pin is released. Returns its
        output."""
        self.requests.pop(request.request_id, None)
        self.adapters.release(request.adapter)
        self.adapters.release(request.fleet)
        for seq in request.seqs:
            if seq.status is not SeqStatus.FINISHED:
                self.scheduler.finish(seq, reason)
                try:
                    emit(seq, "", None, finished=True)
                except Exception:  # a broken callback must not keep the request in flight
                    log.exception("request %s: its final event could not be delivered", request.request_id)
        request.metrics.finish_time = self.clock() if now is None else now
        return request.output()

    def has_unfinished(self) -> bool:
        """Requests in flight, or fine-tune jobs queued (and not paused)."""
        return bool(self.requests) or self.scheduler.has_work()

    # -- adapters ---------------------------------------------------------------------------

    def publish_adapter(self, user: str, weights: LoraWeights, **info: Any) -> AdapterRef:
        """Make `weights` the user's next version: new requests get it, running ones keep theirs."""
        return self.adapters.publish(user, weights, **info)

    def rollback_adapter(self, user: str, to_version: int | None = None, reason: str = "") -> AdapterRef | None:
        """Stop serving the user's newest version (or all newer than `to_version`)."""
        return self.adapters.rollback(user, to_version, reason)

    def publish_fleet(self, weights: LoraWeights, **info: Any) -> AdapterRef:
        """Make `weights` the fleet adapter's next version, beneath every user's adapter for new
        requests; running ones keep the fleet version they were admitted with."""
        return self.adapters.publish(FLEET, weights, **info)

    def rollback_fleet(self, to_version: int | None = None, reason: str = "") -> AdapterRef | None:
        """Stop serving the fleet's newest version (or all newer than `to_version`; 0: none)."""
        return self.adapters.rollback(FLEET, to_version, reason)

    # -- fine-tuning and memory -------------------------------------------------------------

    def add_finetune(
        self,
        task: FineTuneWork,
        *,
        user: str | None = None,
        dpo_loss: float | None = None,
        arrival: float | None = None,
        job_id: str | None = None,
        on_done: Callable[[FineTuneJob], None] | None = None,
        shed_first: bool = False,
    ) -> str:
        """Queue one staged fine-tune task (e.g. `AdapterTrainer.task(pair)`); the policy packs its
        stages into iterations beside inference. `dpo_loss` seeds MACE's gamma * L_DPO term until
        the task's score stage measures it; `arrival` is on the engine clock (default now);
        `on_done(job)` runs on the engine thread when the last stage ran (or the job failed:
        `job.error`). `shed_first`: when memory runs short the job is dropped (error "shed: ...")
        before any other job gives its activations back (a fleet round's). Returns the job id."""
        return self.finetune.add(task, user=user, dpo_loss=dpo_loss, arrival=arrival, job_id=job_id,
                                 on_done=on_done, shed_first=shed_first)

    def cancel_finetune(self, job_id: str | None = None, *, user: str | None = None) -> int:
        """Drop one queued job, or every job of `user` (erasure): activations are freed and the
        adapter released; `on_done` sees `job.error == "cancelled"`. A job whose backward has
        begun is run to its end instead (a torn update would leak into the adapter's next
        step) and retires as done. Returns how many were dropped."""
        return self.finetune.cancel(job_id, user=user)

    def pause_finetune(self, reason: str) -> None:
        """Stop scheduling fine-tune stages (admission says shed) and give activations back;
        `shed_first` jobs (a fleet round) are dropped, the others wait for `resume_finetune`."""
        self.finetune.pause(reason)

    def resume_finetune(self) -> None:
        self.finetune.resume()

    def set_memory_budget(self, nbytes: int) -> ShedReport:
        """New ledger budget (from telemetry: `MemoryBudget.ledger_capacity_bytes(
        engine.ledger.held())`); sheds now, in ARCHITECTURE.md order, if what is held no longer
        fits. Call on the engine thread."""
        self.scheduler.sync_memory()
        self.ledger.set(MemoryKind.ADAPTERS, "cache", self.adapters.cache.nbytes)
        return self.ledger.set_budget(nbytes)

    def _shed_adapters(self, want: int) -> int:
        """Idle cached adapter versions go (pinned ones, serving requests, stay)."""
        cache = self.adapters.cache
        freed = cache.shrink(max(0, cache.nbytes - want))
        self.ledger.set(MemoryKind.ADAPTERS, "cache", cache.nbytes)
        return freed

    def stage_costs(self, settings: Any = None) -> Any:
        """This machine's fine-tune stage cost model (`StageCostModel`) for LoRA `settings`
        (default `LoraSettings()`), profiled once and cached: pass it to `AdapterTrainer(costs=)`."""
        from edge_runtime.lora.config import LoraSettings

        return load_stage_costs(self.model, settings or LoraSettings(), cache_dir=self.config.cost_cache_dir,
                                backend_name=self._costs_key, block_size=self.config.block_size)

    def finetune_stats(self) -> dict[str, Any]:
        return self.finetune.stats()

    # -- the iteration ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration (MACE's Algorithm 1): schedule a bin within the latency budget and free memory,
        run its forward, stream the sampled tokens, then run its fine-tune stages (they delay the next token only)."""
        start = self.clock()
        self._before_iteration()
        batch = self.scheduler.schedule(start)
        if batch.empty:
            return self._idle()
        forward = self.runner.run(batch, self._fail_in_flight)
        self.scheduler.commit_inference(batch, self.clock())
        finished = forward.failed + self._commit_tokens(forward.seqs, forward.logits)
        self.finetune.run(batch, before=self.on_tokens_emitted if forward.seqs else None)
        self.iterations += 1
        self.last_iteration_s = self.clock() - start
        return finished

    def _before_iteration(self) -> None:
        """Bring the ledger's adapter and backend entries up to date; compact pruned KV due."""
        self.ledger.set(MemoryKind.ADAPTERS, "cache", self.adapters.cache.nbytes)
        self._note_backend_memory()
        self._compact_pruned_kv()

    def _idle(self) -> list[RequestOutput]:
        """Nothing could be packed: with no request in flight, a fine-tune job that no memory
        will ever fit fails now instead of waiting forever."""
        self.ledger.release_reservation()
        if not self.requests:
            self.finetune.fail_jobs_that_cannot_fit()
        return []

    def _compact_pruned_kv(self) -> None:
        """Pack the KV of pruned streams that are due (edge_runtime.kv.compaction_timing); only
        a backend that `reads_pruned_kv` reads a compacted layout."""
        if self.backend.reads_pruned_kv:
            cfg = self.model.cfg
            self.kv_compactions += compact_due(self.scheduler.running, self.scheduler.blocks_needed, self.pool,
                                               self.cache, cfg.num_layers, cfg.num_kv_heads)

    def _commit_tokens(self, seqs: list[Sequence], logits: torch.Tensor | None) -> list[RequestOutput]:
        """The commit step (edge_runtime.commit): each sampling sequence's next token."""
        return self.committer.commit(seqs, logits)

    def _fail_request(self, request: Request, why: str) -> RequestOutput:
        """End one request now with finish reason "error" (its blocks and adapter go back) and
        return its output, `error` set; every other request goes on."""
        log.error("request %s failed alone: %s", request.request_id, why)
        request.error = why
        return self._end_request(request, "error")

    def _fail_in_flight(self, request: Request, why: str) -> RequestOutput | None:
        return self._fail_request(request, why) if request.request_id in self.requests else None

    # -- conveniences over add_request/step -------------------------------------------------

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run prompts to completion, batched; one output per prompt, in order."""
        if isinstance(prompts, (str, ChatPrompt)) or (prompts and isinstance(prompts[0], (dict, int))):
            prompts = [prompts]  # one prompt (text, one chat conversation, token ids)
        ids = [self.add_request(p, params) for p in prompts]
        results: dict[str, RequestOutput] = {}
        while len(results) < len(ids):
            for out in self.step():
                results[out.request_id] = out
        return [results[i] for i in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text pieces of candidate 0 as they are decoded."""
        pieces: list[str] = []
        done = False

        def collect(event: TokenEvent) -> None:
            nonlocal done
            if event.index == 0:
                if event.text:
                    pieces.append(event.text)
                done = done or event.finished

        request_id = self.add_request(prompt, params, on_token=collect)
        try:
            while not done:
                self.step()
                while pieces:
                    yield pieces.pop(0)
            while pieces:
                yield pieces.pop(0)
        finally:
            if request_id in self.requests:
                self.abort(request_id)

    def embed(self, inputs: Seq[str | list[int]]) -> tuple[list[list[float]], int]:
        """Embeddings (edge_runtime/embeddings.py) of texts or token-id lists, and how many tokens
        they held. Runs now, between iterations, on the base model."""
        from edge_runtime.embeddings import embed_ids

        encoded = intake.encode_embedding_inputs(inputs, self.tokenizer, self.max_context)
        return [embed_ids(self.model, ids) for ids in encoded], sum(len(ids) for ids in encoded)

    def stats(self) -> dict[str, Any]:
        pool = self.pool
        return {
            "model": self.model_name,
            "backend": self.backend.name, **getattr(self.backend, "stats", dict)(),
            **dict(zip(("deterministic", "deterministic_reason"), settings_determinism(
                self.backend.determinism(), on_grid=self.scheduler.copy_rows is None, block_size=pool.block_size,
                max_batched_tokens=self.config.max_batched_tokens,
                kv_prune_when=None if self.kv_pruning is None else self.kv_pruning.when), strict=True)),
            "device": str(self.model.device),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "requests_in_flight": len(self.requests),
            "kv_blocks_total": pool.num_blocks, "kv_blocks_used": pool.num_used,
            "kv_blocks_cached_free": pool.num_cached_free,
            "kv_cache_bytes": self.cache.nbytes, "block_size": pool.block_size, "max_context": self.max_context,
            **pool.stats.as_dict(),
            **self.prefixes.stats(),
            "iterations": self.iterations,
            "tokens_generated": self.tokens_generated, "sampling": dict(self.committer.sampling_stats),
            "last_iteration_ms": round(self.last_iteration_s * 1000, 3),
            **self.scheduler.stats(),
            **self.finetune_stats(),
            **self.adapters.stats(),
            "memory": self.ledger.snapshot(),
            "cost_model": self.costs.describe(),
        }
