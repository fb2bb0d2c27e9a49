"""The engine: requests in, tokens out, one iteration at a time.

`step()` is the whole algorithm (MACE's Algorithm 1): pack a bin of decode steps, prefill
chunks and fine-tune stages, run it, sample, and commit the results (stream tokens, stop, free
blocks, re-queue what is unfinished). Not thread-safe: the daemon calls it from one engine thread
and hands work in through queues.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from edge_runtime.backends.auto import SELF_CHECK_PROMPTS, choose_backend, first_candidate
from edge_runtime.chat import (
    ChatMessages,
    ChatPrompt,
    encode_prompt,
    forced_call_constraint,
    tool_style,
)
from edge_runtime.config import EngineConfig
from edge_runtime.constraints import GrammarCompiler, unpack_masks
from edge_runtime.device import pick_device, pick_dtype
from edge_runtime.errors import BadRequest, EngineBroken, InsufficientMemory, UnknownRequest
from edge_runtime.ids import validate_request_id, validate_user_id
from edge_runtime.kv.block_pool import BlockPool
from edge_runtime.kv.cache import KVCache, bytes_per_block
from edge_runtime.kv.compaction import compact
from edge_runtime.kv.pruning import HeadPruning, PruningSettings
from edge_runtime.lora.registry import FLEET, AdapterRef, AdapterRegistry
from edge_runtime.lora.weights import LoraWeights
from edge_runtime.memory import MemoryKind, MemoryLedger, ShedReport
from edge_runtime.model.config import ModelConfig
from edge_runtime.model.llama import LlamaModel
from edge_runtime.model.tokenizer import Tokenizer
from edge_runtime.model.weights import load_llama
from edge_runtime.outputs import RequestMetrics, RequestOutput, TokenEvent, TokenLogprob
from edge_runtime.sampling import (
    SamplingError,
    SamplingParams,
    choose,
    mask_rows,
    sample_next,
    shape_logits,
    token_logprobs,
)
from edge_runtime.sched.batch import ScheduledSeq
from edge_runtime.sched.cost_model import activation_sizes, load_cost_model, load_stage_costs
from edge_runtime.sched.finetune import FineTuneJob, FineTuneWork
from edge_runtime.sched.kv_relief import PruneUnderPressure
from edge_runtime.sched.registry import make_policy
from edge_runtime.sched.scheduler import Batch, Scheduler, must_finish
from edge_runtime.sequence import Request, SeqStatus, Sequence

# Text, chat messages, a chat with tools or a prefill (ChatPrompt), or token ids.
Prompt = str | ChatMessages | ChatPrompt | list[int]
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
        check_memory_budget(config, cfg, model.dtype, _weights_bytes(model))
        num_blocks = max(2, self._kv_budget_bytes() // per_block)
        self.max_context = min(cfg.max_position_embeddings, num_blocks * config.block_size)
        if config.max_context:
            self.max_context = min(self.max_context, config.max_context)
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
        self.backend, self.backend_choice = choose_backend(config, model, self.cache, self.adapters,
                                                           self.pool, prompts)
        self.kv_pruning = PruningSettings.from_config(config)
        if self.kv_pruning is not None and (not self.backend.reads_pruned_kv or any(w is not None for w in cfg.layer_windows)
                                            or cfg.attn_softcap is not None):
            raise ValueError("KV pruning runs on the torch backend, for models without sliding windows or attention "
                             "soft-capping, so far (docs/kv.md); set kv_prune_policy='off'")
        self.clock = time.monotonic  # the one scheduling clock (tests may substitute a fake)
        # With cost_profile "background", a machine without a cached calibration serves on
        # nominal costs at once and calibrates while idle (`calibrate_step`).
        self.costs, self._calibration = load_cost_model(
            cfg, model.dtype, model.device, self._costs_key, self.backend.execute, self.pool, per_block,
            mode=config.cost_profile, cache_dir=config.cost_cache_dir)
        self.ledger = MemoryLedger(self._memory_budget_bytes())
        self.ledger.set(MemoryKind.WEIGHTS, "model", _weights_bytes(model))
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
        self._set_slo()
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._req_ids = itertools.count()
        self._job_ids = itertools.count()
        self.iterations = 0
        self.tokens_generated = 0
        self.kv_compactions = 0  # times a pruned sequence's KV was packed and blocks given back
        self.last_iteration_s = 0.0
        # Called (engine thread) once an iteration's tokens are emitted and before its
        # fine-tune stages run, so a host can hand those tokens on without waiting for them.
        self.on_tokens_emitted: Callable[[], None] | None = None

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def load(cls, model: str | Path | None = None, config: EngineConfig | None = None, **overrides: Any) -> Engine:
        """Load a model (None = the default SmolLM2-135M-Instruct) and build an engine for it."""
        config = (config or EngineConfig()).replace(**overrides) if overrides else (config or EngineConfig())
        if model is not None:
            config = config.replace(model=str(model))
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        path, name = _resolve(config.model)
        device = _engine_device(config)
        dtype_name = config.dtype
        if dtype_name == "auto" and config.backend == "auto" and device.type == "cpu" \
                and first_candidate(device) != "torch":
            dtype_name = "float32"  # ONNX Runtime's CPU kernels and the dense KV rows are float32
        dtype = pick_dtype(dtype_name, device)
        if config.memory_budget_bytes:  # refuse before reading gigabytes of weights
            cfg = ModelConfig.from_dir(path)
            with torch.device("meta"):
                shell = LlamaModel(cfg)
            check_memory_budget(config, cfg, dtype, _weights_bytes(shell, dtype))
        net = load_llama(path, dtype=dtype, device=device)
        return cls(net, Tokenizer(path), config, name=name)

    def _set_slo(self) -> None:
        """The TBT SLO and the iteration's latency budgets: configured, or a multiple of the
        cost model's unloaded decode step (set again when a background calibration lands)."""
        config = self.config
        slo_tbt_s = (config.slo_tbt_ms / 1000 if config.slo_tbt_ms > 0
                     else config.slo_tbt_factor * self.costs.unloaded_decode_s())
        self.scheduler.slo_tbt_s = slo_tbt_s
        self.scheduler.latency_budget_s = self.scheduler.iteration_budget_s = config.iteration_budget_fraction * slo_tbt_s
        self.scheduler.max_latency_budget_s = slo_tbt_s * max(config.iteration_budget_fraction,
                                                              config.iteration_budget_max_fraction)

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

    def _kv_budget_bytes(self) -> int:
        if self.config.kv_cache_bytes:
            return self.config.kv_cache_bytes
        import psutil

        available = psutil.virtual_memory().available
        if self.model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.model.device)
            available = min(available, free)  # on Jetson both views share one DRAM
        return int(min(self.config.kv_cache_max_bytes, available * self.config.kv_cache_fraction))

    def _memory_budget_bytes(self) -> int:
        """The ledger's budget until telemetry sets one: what the engine holds by construction
        (weights, the KV cache, the adapter cache), one full iteration's activations, and the
        configured room for fine-tuning."""
        if self.config.memory_budget_bytes:
            return self.config.memory_budget_bytes
        forward = (self.costs.inference_bytes(self.config.max_batched_tokens, False)
                   + self.config.max_num_seqs * self.costs.logits_bytes_per_row)
        return (_weights_bytes(self.model) + self.cache.nbytes + self.adapters.cache.capacity_bytes
                + forward + self.config.finetune_memory_bytes + self.backend.reserved_bytes)

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
        fleet: bool = True,
    ) -> str:
        """Queue a prompt (text or chat messages); returns its request id. `adapter`: a user id
        (that user's newest adapter version, pinned until the request ends; the base model if
        the user has none yet), a specific `AdapterRef`, or None for the base model. Beneath it
        the fleet adapter's newest version is pinned likewise when one is published (`fleet=False`:
        the base model's own weights only)."""
        params = params or SamplingParams()
        if request_id is None:
            request_id = f"req-{next(self._req_ids)}"
        validate_request_id(request_id)
        if request_id in self.requests:
            raise BadRequest(f"request id {request_id!r} is already in flight")
        if isinstance(prompt, str) and len(prompt) > self.config.max_prompt_chars:
            raise BadRequest(f"prompt has {len(prompt)} characters; the limit is {self.config.max_prompt_chars}",
                             param="prompt")
        if isinstance(prompt, ChatPrompt):
            forced = forced_call_constraint(prompt, tool_style(self.tokenizer))
            if forced is not None:
                if params.constraint is not None:
                    raise BadRequest("a forced tool call and a response format cannot both shape one answer",
                                     param="response_format")
                params = dataclasses.replace(params, constraint=forced)
        text, ids = encode_prompt(self.tokenizer, prompt)
        if len(ids) >= self.max_context:
            raise BadRequest(
                f"prompt has {len(ids)} tokens; this engine holds at most {self.max_context - 1} "
                "prompt tokens per sequence (model limit and KV cache size)", param="prompt"
            )
        vocab = self.model.cfg.vocab_size
        if any(t >= vocab for t, _ in params.logit_bias):
            raise BadRequest(f"logit_bias names a token id outside this model's vocabulary of {vocab}",
                             param="logit_bias")
        # One compile per request (a schema or grammar that does not compile is the request's
        # fault); each candidate gets its own copy of the grammar's state.
        matcher = self.grammars.matcher(params.constraint) if params.constraint is not None else None
        now = self.clock()
        pinned = self._pin_adapter(adapter)
        try:
            pinned_fleet = self.adapters.acquire(FLEET) if fleet else None
        except BaseException:
            self.adapters.release(pinned)
            raise
        try:
            request = Request(request_id, text, ids, params, now, on_token=on_token, adapter=pinned,
                              adapter_key=pinned.key if pinned is not None else "", fleet=pinned_fleet)
            request.metrics = RequestMetrics(arrival_time=now, prompt_tokens=len(ids))
            for index in range(params.n):
                generator = None
                if not params.greedy:
                    seed = params.seed + index if params.seed is not None else secrets.randbits(63)
                    generator = torch.Generator().manual_seed(seed)
                seq = Sequence(next(self._seq_ids), request, index, list(ids), self.tokenizer.stream_decoder(),
                               generator)
                if self.kv_pruning is not None and self.kv_pruning.when == "always":
                    self._start_pruning(seq)
                if matcher is not None:
                    seq.matcher = matcher if index == 0 else matcher.deep_copy()
                request.seqs.append(seq)
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
                    self._emit(seq, "", None, finished=True)
                except Exception:  # a broken callback must not keep the request in flight
                    log.exception("request %s: its final event could not be delivered", request.request_id)
        request.metrics.finish_time = self.clock() if now is None else now
        return request.output()

    def has_unfinished(self) -> bool:
        """Requests in flight, or fine-tune jobs queued (and not paused)."""
        return bool(self.requests) or self.scheduler.has_work()

    # -- adapters ---------------------------------------------------------------------------

    def _pin_adapter(self, adapter: str | AdapterRef | None) -> AdapterRef | None:
        if adapter is None:
            return None
        # A user's adapter only: the fleet's reserved name is not a user id.
        if isinstance(adapter, AdapterRef):
            validate_user_id(adapter.user)
            return self.adapters.pin(adapter)
        return self.adapters.acquire(validate_user_id(adapter))

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
        job_id = job_id or f"ft-{next(self._job_ids)}"
        now = self.clock()
        job = FineTuneJob(job_id, task, arrival if arrival is not None else now,
                          arrival if arrival is not None else now, dpo_loss, user, on_done,
                          shed_first=shed_first)
        self.scheduler.add_finetune(job)
        return job_id

    def cancel_finetune(self, job_id: str | None = None, *, user: str | None = None) -> int:
        """Drop one queued job, or every job of `user` (erasure): activations are freed and the
        adapter released; `on_done` sees `job.error == "cancelled"`. A job whose backward has
        begun is run to its end instead (a torn update would leak into the adapter's next
        step) and retires as done. Returns how many were dropped."""
        jobs = [j for j in list(self.scheduler.finetune.jobs.values())
                if (job_id is not None and j.job_id == job_id) or (user is not None and j.user == user)]
        dropped = 0
        for job in jobs:
            dropped += not must_finish(job)
            self._drop_job(job, "cancelled", finish=True)
        return dropped

    def _fail_finetunes_that_cannot_fit(self) -> None:
        """Nothing else runs and still no stage was packed: a job whose next stage needs more
        memory than the ledger can free would wait forever (a 1B model's DPO window under the
        default `finetune_memory_bytes`, say). Fail it with the figures instead. A job whose
        backward has begun is left alone: it must run to its optimizer stage."""
        for job in list(self.scheduler.finetune.jobs.values()):
            costs = job.stage_costs(1)
            if not costs or must_finish(job):
                continue
            need = costs[0].memory_bytes
            if need <= self.ledger.free or self.ledger.reclaim(need).satisfied:
                continue
            reason = (f"its next stage ({costs[0].kind}) needs {need / 2**20:.1f} MiB and only "
                      f"{max(0, self.ledger.free) / 2**20:.1f} MiB of the {self.ledger.budget / 2**20:.0f} MiB "
                      "memory budget is free with nothing else running: raise engine.finetune_memory_bytes "
                      "(or memory_budget_bytes), or train with smaller windows (dpo window_tokens)")
            log.warning("fine-tune job %s cannot run: %s", job.job_id, reason)
            self._drop_job(job, f"no memory: {reason}")

    def _drop_job(self, job: FineTuneJob, reason: str, finish: bool = False) -> None:
        queue = self.scheduler.finetune
        if finish and must_finish(job):
            # Its gradient is partly in the adapter's leaves: a torn update would leak into the
            # next pair's optimizer step. Run the few stages left (backward groups, the
            # optimizer) instead; it then retires as done, not dropped.
            try:
                self._finish_now(job)
            except Exception as exc:
                log.exception("fine-tune job %s failed while finishing", job.job_id)
                if job.job_id in queue.jobs:
                    queue.retire(job, self.clock(), error=f"{reason}; finishing failed: {exc}")
            self.ledger.drop(MemoryKind.ACTIVATIONS, job.job_id)
            return
        try:
            if job.work.held_bytes or queue.owners.get(id(job.work.trainer)) is job:
                queue.abandon(job)
        finally:
            queue.retire(job, self.clock(), error=reason)
            self.ledger.drop(MemoryKind.ACTIVATIONS, job.job_id)

    def _finish_now(self, job: FineTuneJob) -> None:
        queue = self.scheduler.finetune
        while job.job_id in queue.jobs:
            stage = job.work.next_stage()
            if stage is None:
                queue.retire(job, self.clock())
                break
            queue.before_stage(job, stage.kind.value)
            job.work.run_next()
            queue.after_stage(job, stage.seconds or 0.0, self.clock())

    def pause_finetune(self, reason: str) -> None:
        """Stop scheduling fine-tune stages (admission says shed) and give activations back;
        `shed_first` jobs (a fleet round) are dropped, the others wait for `resume_finetune`."""
        self.scheduler.finetune_paused = reason
        self.scheduler.drop_shed_first(reason)
        for job in self.scheduler.finetune.holding():
            if not must_finish(job):  # those run on to their optimizer stage, then wait
                self.scheduler.finetune.abandon(job)
        self.scheduler.sync_memory()

    def resume_finetune(self) -> None:
        self.scheduler.finetune_paused = None

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
        queue = self.scheduler.finetune
        return {
            "finetune_queued": len(queue),
            "finetune_pairs_done": queue.pairs_done,
            "finetune_failed": queue.failed,
            "finetune_stages_run": queue.stages_run,
            "finetune_seconds": round(queue.seconds, 3),
            "finetune_paused": self.scheduler.finetune_paused,
        }

    # -- the iteration ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration, Algorithm 1 in plain words: by priority, pack this iteration's bin
        (decode steps, prefill chunks, fine-tune stages) within the latency budget and the
        ledger's free memory; run the forward; run the fine-tune stages; commit: advance
        sequences, stream and sample tokens, re-queue unfinished work with its new waiting time.
        Returns the requests it finished."""
        start = self.clock()
        self.ledger.set(MemoryKind.ADAPTERS, "cache", self.adapters.cache.nbytes)
        self._note_backend_memory()
        self._compact_pruned_kv()
        batch = self.scheduler.schedule(start)
        if batch.empty:
            self.ledger.release_reservation()
            if not self.requests:
                self._fail_finetunes_that_cannot_fit()
            return []
        failed: list[RequestOutput] = []
        logits = self._run_forward(batch, failed)
        sampling = [item.seq for item in batch.items if item.samples]
        # The forward's tokens go out before the bin's fine-tune stages run: on one thread the
        # stages delay the next token (the TBT the latency budget bounds), not this one.
        self.scheduler.commit_inference(batch, self.clock())
        finished = failed + (self._commit_tokens(sampling, logits) if logits is not None else [])
        if batch.finetune:
            if self.on_tokens_emitted is not None and sampling:
                self.on_tokens_emitted()
            self._run_finetune(batch)
        self.scheduler.commit_finetune(batch)
        self.iterations += 1
        self.last_iteration_s = self.clock() - start
        return finished

    def _compact_pruned_kv(self) -> None:
        """A pruned stream about to need another block first packs what its heads retain into the
        blocks that holds and gives the rest back (edge_runtime.kv.compaction), so the scheduler
        and the ledger count the budget's share of its KV, not every position's. One never compacted
        (or recomputed after a preemption, every position whole again) also tries at its first
        decode step and every `block_size` steps after (a try that frees nothing costs a few ms).
        Any sequence with a pruning state, whether the engine's settings gave it one or not. Only
        a backend that `reads_pruned_kv` reads a compacted layout."""
        if not self.backend.reads_pruned_kv:
            return
        layers, kv_heads = self.model.cfg.num_layers, self.model.cfg.num_kv_heads
        for seq in self.scheduler.running:
            state = seq.kv_pruning
            if state is None or seq.in_prefill or not state.length:
                continue
            due = self.scheduler.blocks_needed(seq, 1) > 0
            if not due and (seq.kv_layout is not None or (state.steps - 1) % self.pool.block_size):
                continue
            n = seq.num_computed
            retained = torch.ones(layers, kv_heads, n, dtype=torch.bool)
            seen = min(state.length, n)  # positions its decode steps have not seen yet are all retained
            retained[:, :, :seen] = state.retained[:, :, :seen].cpu()
            if not due and n - -(-int(retained.sum()) // (layers * kv_heads)) < self.pool.block_size:
                continue
            done = compact(seq.kv_layout, retained, seq.block_table, self.pool, self.cache)
            if done is not None:
                seq.kv_layout, seq.block_table = done.layout, done.block_table
                self.kv_compactions += 1

    def _run_forward(self, batch: Batch, failed: list[RequestOutput]) -> torch.Tensor | None:
        """The bin's forward. If it raises, the requests whose rows make it fail are found and
        failed alone (into `failed`), their items leave the batch, and the rest still run."""
        if not batch.items:
            return None
        started = time.perf_counter()
        try:
            logits = self.backend.execute(batch).cpu()
        except Exception as exc:
            return self._isolate_forward_fault(batch, exc, failed)
        self.costs.observe_forward(batch.planned_forward_s, time.perf_counter() - started)
        return logits

    def _isolate_forward_fault(self, batch: Batch, exc: Exception, failed: list[RequestOutput]) -> torch.Tensor | None:
        """Run the items again in halves until each failure is pinned on single items; their
        requests fail, every other item keeps the logits of a run that worked (rewriting a
        position's keys and values is harmless: same tokens, same slots). When no item runs even
        alone, a one-token probe on a scratch sequence tells a broken engine (raise
        `EngineBroken`) from requests that break the forward (they fail, the engine goes on)."""
        log.warning("the forward of %d sequence(s) failed (%s: %s); retrying in parts to find the cause",
                    len(batch.items), type(exc).__name__, exc)
        rows: dict[int, torch.Tensor] = {}  # id(item) -> its logits row, for items that sample
        culprits: dict[int, Exception] = {}  # id(item) -> what it raised alone

        def attempt(items: list[ScheduledSeq], error: Exception | None) -> None:
            if error is None:
                try:
                    out = self.backend.execute(Batch(items, [])).cpu()
                except Exception as exc:
                    error = exc
                else:
                    for row, item in zip(out, (i for i in items if i.samples), strict=True):
                        rows[id(item)] = row
                    return
            if len(items) == 1:
                culprits[id(items[0])] = error
                return
            half = len(items) // 2
            attempt(items[:half], None)
            attempt(items[half:], None)

        items = list(batch.items)
        attempt(items, exc)
        bad = [item for item in items if id(item) in culprits]
        for item in bad:
            request = item.seq.request
            if request.request_id in self.requests:
                cause = culprits[id(item)]
                failed.append(self._fail_request(
                    request, f"the forward failed on this request: {type(cause).__name__}: {cause}"))
        batch.items = [item for item in items if item.seq.status is not SeqStatus.FINISHED]
        if len(bad) == len(items) and not self._forward_works():
            raise EngineBroken(f"the forward fails for every request and for a one-token probe: "
                               f"{type(exc).__name__}: {exc}") from exc
        if not batch.items:
            return None
        sampled = [rows[id(item)] for item in batch.items if item.samples]
        return torch.stack(sampled) if sampled else torch.empty(0, self.model.cfg.vocab_size)

    def _forward_works(self) -> bool:
        """One token of a scratch sequence on the base model, in a block of its own."""
        if not self.pool.num_free:
            return False
        block = self.pool.allocate()
        probe = Request("engine-probe", "", [0], SamplingParams(max_tokens=1), self.clock())
        seq = Sequence(-1, probe, 0, [0], self.tokenizer.stream_decoder(), block_table=[block])
        probe.seqs.append(seq)
        try:
            self.backend.execute(Batch([ScheduledSeq(seq, 1)], []))
        except Exception:
            log.exception("the engine's one-token probe failed too")
            return False
        finally:
            seq.status = SeqStatus.FINISHED
            self.pool.release(block)
        return True

    def _fail_request(self, request: Request, why: str) -> RequestOutput:
        """End one request now with finish reason "error" (its blocks and adapter go back) and
        return its output, `error` set; every other request goes on."""
        log.error("request %s failed alone: %s", request.request_id, why)
        request.error = why
        return self._end_request(request, "error")

    def _run_finetune(self, batch: Batch) -> None:
        queue = self.scheduler.finetune
        for scheduled in batch.finetune:
            job = scheduled.job
            for _ in range(scheduled.num_stages):
                stage = job.work.next_stage()
                if stage is None:
                    break
                kind = stage.kind.value
                estimate_s = job.estimate_s(stage)
                queue.before_stage(job, kind)
                try:
                    job.work.run_next()
                except Exception as exc:  # a failing update must not take inference down with it
                    log.exception("fine-tune job %s failed in stage %s", job.job_id, stage.name)
                    self._drop_job(job, f"{stage.name} failed: {exc}")
                    break
                self.costs.observe_stage(kind, estimate_s, stage.seconds or 0.0)
                queue.after_stage(job, stage.seconds or 0.0, self.clock())

    def _commit_tokens(self, seqs: list[Sequence], logits: torch.Tensor) -> list[RequestOutput]:
        done: list[RequestOutput] = []
        now = self.clock()
        logits = self._apply_grammars(seqs, logits)
        greedy = _greedy_tokens(logits) if any(seq.params.greedy for seq in seqs) else None
        for row, seq in enumerate(seqs):
            if seq.status is SeqStatus.FINISHED:
                continue  # its request failed on an earlier row of this step
            try:
                output = self._commit_token(seq, logits[row], greedy[row] if greedy is not None else None, now)
            except Exception as exc:  # sampling, stop check, detokenising, the callback: this request's
                output = self._fail_request(seq.request, f"{type(exc).__name__}: {exc}")
            if output is not None:
                done.append(output)
        return done

    def _apply_grammars(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """The step's logits with every constrained row's disallowed tokens at -inf (a float32
        copy; `logits` itself when no row is constrained), the masks computed together; a
        request whose grammar fails here fails alone."""
        rows = [row for row, s in enumerate(seqs) if s.matcher is not None and s.status is not SeqStatus.FINISHED]
        if not rows:
            return logits
        try:
            packed = self.grammars.masks([seqs[row].matcher for row in rows])
        except Exception as exc:
            for row in rows:
                if seqs[row].request.request_id in self.requests:
                    self._fail_request(seqs[row].request, f"the grammar's mask failed: {type(exc).__name__}: {exc}")
            return logits
        return mask_rows(logits, rows, unpack_masks(packed, self.model.cfg.vocab_size))

    def _commit_token(self, seq: Sequence, logits: torch.Tensor, greedy: int | None,
                      now: float) -> RequestOutput | None:
        """Shape the row (its grammar's mask already applied), choose, stream and stop-check one
        sequence's new token; its request's output when this token finished the request."""
        params = seq.params
        row = logits
        if params.shapes_logits:
            row = shape_logits(logits, params, seq.counts)
            token = choose(row, params, seq.generator)
        elif params.greedy and greedy is not None:
            token = greedy
        else:
            token = sample_next(logits, params, seq.generator)
        logprob = self._logprob(row, token, params.logprobs) if params.logprobs is not None else None
        grammar_done = False
        if seq.matcher is not None:
            if not seq.matcher.consume_token(token):
                raise SamplingError(f"the grammar refused token {token}: {seq.matcher.get_error()}")
            grammar_done = seq.matcher.is_stopped()
        if params.presence_penalty or params.frequency_penalty:
            seq.counts[token] = seq.counts.get(token, 0) + 1
        seq.token_ids.append(token)
        self.tokens_generated += 1
        metrics = seq.request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.generated_tokens += 1
        reason = None
        eos = token in self.tokenizer.eos_ids and (not params.ignore_eos or seq.matcher is not None)
        if eos or token in params.stop_token_ids:
            reason = "stop"
            logprob = None  # the stop token makes no text
        else:
            seq.text += seq.decoder.step(token)
            if logprob is not None:
                seq.logprobs.append(logprob)
            if params.stop:
                cut = _find_stop(seq.text, params.stop, seq.emitted)
                if cut is not None:
                    seq.text = seq.text[:cut]
                    reason = "stop"
            if reason is None and grammar_done:
                reason = "stop"  # the grammar is complete and can take nothing more
        if reason is None and (seq.num_generated >= params.max_tokens or seq.num_tokens >= self.max_context):
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
        else:
            self.scheduler.token_appended(seq)  # LongRoPE: past the switch, the sequence is recomputed
        self._emit(seq, self._releasable(seq, reason is not None), token, finished=reason is not None,
                   logprob=logprob)
        request = seq.request
        if reason is not None and request.finished and request.request_id in self.requests:
            return self._end_request(request, reason, now)
        return None

    def _releasable(self, seq: Sequence, finished: bool) -> str:
        """Text that can be streamed now: all of it at the end, otherwise all but a tail that
        could still turn out to be the start of a stop string."""
        hold = 0 if finished or not seq.params.stop else max(len(s) for s in seq.params.stop) - 1
        upto = max(seq.emitted, len(seq.text) - hold)
        piece = seq.text[seq.emitted : upto]
        seq.emitted = upto
        return piece

    def _logprob(self, row: torch.Tensor, token: int, k: int) -> TokenLogprob:
        chosen, top = token_logprobs(row, token, k)
        spell = self.grammars.token_bytes
        return TokenLogprob(token, chosen, spell(token), [(t, lp, spell(t)) for t, lp in top])

    def _emit(self, seq: Sequence, text: str, token: int | None, finished: bool,
              logprob: TokenLogprob | None = None) -> None:
        callback = seq.request.on_token
        if callback is not None:
            callback(TokenEvent(seq.request.request_id, seq.index, token, text, finished,
                                seq.finish_reason if finished else None, logprob))

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
        from edge_runtime.embeddings import MAX_INPUTS, embed_ids

        if not 1 <= len(inputs) <= MAX_INPUTS:
            raise BadRequest(f"give 1-{MAX_INPUTS} inputs to embed")
        encoded = []
        for i, item in enumerate(inputs):
            if isinstance(item, str) and not item:
                raise BadRequest(f"input {i} is empty")
            _, ids = encode_prompt(self.tokenizer, item)
            if len(ids) > self.max_context:
                raise BadRequest(f"input {i} has {len(ids)} tokens; this engine embeds at most {self.max_context}")
            encoded.append(ids)
        return [embed_ids(self.model, ids) for ids in encoded], sum(len(ids) for ids in encoded)

    def stats(self) -> dict[str, Any]:
        pool = self.pool
        return {
            "model": self.model_name,
            "backend": self.backend.name,
            "device": str(self.model.device),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "policy": self.scheduler.policy.name,
            "requests_in_flight": len(self.requests),
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_used,
            "kv_blocks_cached_free": pool.num_cached_free,
            "kv_cache_bytes": self.cache.nbytes,
            "block_size": pool.block_size,
            "max_context": self.max_context,
            "prefix_cache_hit_rate": round(pool.stats.hit_rate, 4),
            "prefix_cache_hit_blocks": pool.stats.hit_blocks,
            "prefix_cache_queried_blocks": pool.stats.queried_blocks,
            "preemptions": self.scheduler.num_preemptions,
            "rope_recomputes": self.scheduler.num_rope_recomputes,
            # sequences kv_prune_when = "pressure" turned pruning on for
            "kv_prune_turned_on": self.scheduler.kv_relief.turned_on if self.scheduler.kv_relief else 0,
            "iterations": self.iterations,
            "tokens_generated": self.tokens_generated,
            "last_iteration_ms": round(self.last_iteration_s * 1000, 3),
            "scheduler_overhead_ms": round(self.scheduler.overhead_s * 1000, 4),
            "slo_tbt_ms": round(self.scheduler.slo_tbt_s * 1000, 3),
            "iteration_budget_ms": (round(self.scheduler.latency_budget_s * 1000, 3)
                                    if math.isfinite(self.scheduler.latency_budget_s) else None),
            # what the last iteration packed to (grows with the streams' TBT headroom under mace)
            "last_iteration_budget_ms": (round(self.scheduler.iteration_budget_s * 1000, 3)
                                         if math.isfinite(self.scheduler.iteration_budget_s) else None),
            "policy_params": self.scheduler.policy.params,
            **self.finetune_stats(),
            **self.adapters.stats(),
            "memory": self.ledger.snapshot(),
            "cost_model": self.costs.describe(),
        }


def _weights_bytes(model: LlamaModel, dtype: torch.dtype | None = None) -> int:
    """Bytes of the parameters and buffers; `dtype`: of the parameters once converted to it
    (for a shell built on the meta device before loading)."""
    params = sum(p.numel() * (p.element_size() if dtype is None else torch.empty((), dtype=dtype).element_size())
                 for p in model.parameters())
    return params + sum(b.numel() * b.element_size() for b in model.buffers())


def memory_needs(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, weights_bytes: int) -> dict[str, int]:
    """What serving needs at the least, in bytes: the weights, KV blocks for one full prompt
    chunk (`max_batched_tokens`), and one such iteration's activations and logits."""
    per_token, per_row = activation_sizes(cfg, dtype)
    chunk_blocks = -(-config.max_batched_tokens // config.block_size)
    return {
        "weights": weights_bytes,
        "kv_minimum": chunk_blocks * bytes_per_block(cfg, config.block_size, dtype),
        "activations": config.max_batched_tokens * per_token + config.max_num_seqs * per_row,
    }


def check_memory_budget(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, weights_bytes: int) -> None:
    """Raise `InsufficientMemory` when a configured budget (`memory_budget_bytes`) is below
    `memory_needs`: the engine would hold more than its budget before serving anything."""
    budget = config.memory_budget_bytes
    if not budget:
        return  # derived from what the engine holds: fits by construction
    needs = memory_needs(config, cfg, dtype, weights_bytes)
    total = sum(needs.values())
    if budget < total:
        mib = 2**20
        raise InsufficientMemory(
            f"the memory budget ({budget / mib:.0f} MiB, engine.memory_budget_bytes) is below what serving this "
            f"model needs: {total / mib:.0f} MiB = weights {needs['weights'] / mib:.0f} MiB "
            f"({str(dtype).removeprefix('torch.')}) + KV cache minimum {needs['kv_minimum'] / mib:.1f} MiB (one "
            f"{config.max_batched_tokens}-token chunk) + one iteration's activations {needs['activations'] / mib:.1f} "
            f"MiB; raise the budget, or lower the dtype, max_batched_tokens or max_num_seqs")


def _greedy_tokens(logits: torch.Tensor) -> list[int] | None:
    """Every row's argmax in one call (the first maximal index, like `torch.argmax`), or None
    where numpy cannot read the logits in place. NumPy's float32 argmax is vectorised: ~15x
    torch's on one thread, ~0.9 ms a step at 16 rows of a 49k vocabulary."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2 or logits.requires_grad:
        return None
    return logits.numpy().argmax(axis=1).tolist()


def _find_stop(text: str, stops: tuple[str, ...], emitted: int) -> int | None:
    """Earliest index where a stop string starts, searching only text not yet streamed (plus
    the overlap a stop string could straddle)."""
    best = None
    for stop in stops:
        idx = text.find(stop, max(0, emitted - len(stop) + 1))
        if idx != -1 and (best is None or idx < best):
            best = idx
    return best



def _engine_device(config: EngineConfig) -> torch.device:
    """Where the weights and the KV cache live. `device = "auto"` means CUDA when torch sees a
    GPU, except for the onnxruntime backend on a build without a GPU provider: its graphs run on
    the CPU and read the cache there, so the engine stays on the CPU too."""
    device = pick_device(config.device)
    if device.type == "cuda" and config.device == "auto" and config.backend == "onnxruntime":
        from edge_runtime.backends.ort_session import onnxruntime_has_gpu

        if not onnxruntime_has_gpu():
            log.warning("this onnxruntime build has no GPU provider: the onnxruntime backend runs on "
                        "the CPU (install onnxruntime-gpu to run it on the GPU)")
            return torch.device("cpu")
    return device

def _resolve(spec: str | None) -> tuple[Path, str]:
    if spec is not None and Path(spec).is_dir():
        return Path(spec), Path(spec).name
    from edge_runtime.model.source import resolve_model

    resolved = resolve_model(spec)
    return Path(resolved.path), resolved.name
