"""One example's update (a pair's DPO, a judged answer's KTO: its `Objective`) cut into stages the scheduler can fit into iteration budgets:

  score     no-grad policy log-probs, one token window per stage (the windows the forward uses),
            and the reference (cached) -> the objective's loss (the priority input); windowed so a
            stage fits the slack of an iteration's latency budget like the forward windows do
  reference (only without score, and only the first time a pair is seen) the base model's
            log-probs with the adapter off; cached for good since the base is frozen
  forward   one token window through every layer without grad, keeping each layer's input
            ([rows, hidden]) and the RNG state it ran with; the LM head is applied and
            differentiated per window right away, keeping only a [rows, hidden] gradient
  backward  one layer group, last to first, a layer at a time: the layer's forward over every window
            again (one call; per window where LoRA dropout draws) from its kept inputs, with grad, then its
            backward seeded by the layer above (the top: the objective); one layer's graph at a time
  optimizer AdamW on the LoRA parameters once `accumulation_steps` pairs have added gradients

`FineTuneTask.recompute = False` keeps the forward's graphs instead (each group's input a
detached leaf, every layer's activations held from the forward to the backward: about 0.45 GiB
at 208 rows of a 1B model, against 27 MiB of layer inputs; the recompute costs one more grad
forward of the layers per pair).

The gradients equal one full-sequence autograd pass of the same loss (tests check it); each
stage reports an estimate of its latency and memory before it runs. The task reaches the adapter
it trains only through `AdapterSide` (AdapterTrainer implements it).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from edge_runtime import c_heap
from edge_runtime.c_heap import give_heap_back
from edge_runtime.lora.weights import draws_dropout
from edge_runtime.model import held_floats
from edge_runtime.model.qweights import QuantWeight
from edge_runtime.train.costs import StageCostModel, StageEstimate
from edge_runtime.train.logprobs import token_logps
from edge_runtime.train.objectives import Objective, Score
from edge_runtime.train.pairs import PairTokens
from edge_runtime.train.windows import PairKV, Window

if TYPE_CHECKING:
    from edge_runtime.model.llama import LlamaModel, LoraApplier


class AdapterSide(Protocol):
    """What a staged task asks of the adapter it trains."""

    model: LlamaModel
    costs: StageCostModel

    def has_reference(self, tokens: PairTokens) -> bool: ...

    def reference_logps(self, tokens: PairTokens) -> tuple[float, float]:
        """Summed log-probs of the two rows with the adapter off (cached)."""
        ...

    def applier(self, training: bool = False) -> LoraApplier | None:
        """The adapter being trained, as the forward applies it."""
        ...

    def claim(self, task: FineTuneTask) -> None:
        """Hold the adapter from the first forward to the optimizer stage (raises if taken)."""
        ...

    def release(self, task: FineTuneTask) -> None: ...

    @property
    def accumulation_steps(self) -> int: ...

    def optimizer_estimate(self) -> StageEstimate: ...

    def finish(self, task: FineTuneTask) -> bool:
        """Add the task's gradients to the optimizer (stepping when a window is full; returns
        whether it stepped) and release the adapter."""
        ...


class StageKind(enum.Enum):
    SCORE = "score"
    REFERENCE = "reference"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


@dataclass(eq=False)
class Stage:
    kind: StageKind
    name: str
    estimate_fn: Callable[[], StageEstimate]
    run_fn: Callable[[], None]
    seconds: float | None = None  # measured, once run

    def estimate(self) -> StageEstimate:
        return self.estimate_fn()

    def run(self) -> float:
        t0 = time.perf_counter()
        with c_heap.stage_blocks_mapped():
            self.run_fn()
        self.seconds = time.perf_counter() - t0
        if TRIM_AFTER_STAGE and self.seconds >= TRIM_MIN_STAGE_S:
            give_heap_back()
        return self.seconds


@dataclass
class _Activations:
    """What the forward windows leave for the backward groups."""

    kv: PairKV
    # recompute: [layer][window] each layer's input, no graph; otherwise [group][window] the
    # detached leaf inputs (group 0 has none)
    inputs: list[list[Tensor]]
    outputs: list[list[Tensor]]  # without recompute: [group][window] outputs, graph attached
    rng: list[list[tuple[Tensor, Tensor | None]]] = field(default_factory=list)  # recompute, dropout: [layer][window]
    head_grads: list[tuple[Tensor, Tensor, Tensor]] = field(default_factory=list)  # per window
    seeds: list[Tensor] = field(default_factory=list)  # recompute: d loss / d (next layer's input), per window
    sums: Tensor = field(default_factory=lambda: torch.zeros(2, dtype=torch.float64))


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    """The generators LoRA dropout draws from, so a recomputed layer draws the same mask."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state: tuple[Tensor, Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class StageCursor:
    """Runs a work's `stages` in order, one per `run_next()` (the driving side of
    edge_runtime.sched.finetune.FineTuneWork); `_cursor` is the next stage's index."""

    stages: list[Stage]
    _cursor: int

    @property
    def done(self) -> bool:
        return self._cursor >= len(self.stages)

    def next_stage(self) -> Stage | None:
        return None if self.done else self.stages[self._cursor]

    def remaining(self) -> list[Stage]:
        return self.stages[self._cursor :]

    def run_next(self) -> Stage:
        stage = self.stages[self._cursor]
        stage.run()
        self._cursor += 1
        return stage


class FineTuneTask(StageCursor):
    """Stages of one example's update. Run them in order (`run_next()`), all at once (`run()`),
    or shed the held activations under memory pressure (`abandon()`) and redo the forward later.
    `windows` are the token windows of `tokens`, `groups` the (start, stop) layer groups."""

    recompute = True  # layers' forward again in the backward (see the module docstring)

    def __init__(self, trainer: AdapterSide, tokens: PairTokens, objective: Objective,
                 windows: list[Window], groups: list[tuple[int, int]], score: bool = True,
                 pair_id: object = None) -> None:
        self.trainer = trainer  # jobs of one trainer hold its adapter one at a time (scheduler)
        self.tokens = tokens
        self.objective = objective
        self.pair_id = pair_id
        self.windows = windows
        self.groups = groups
        self.score: Score | None = None  # from the score stage (before training)
        self.result: Score | None = None  # the log-probs the gradient was taken at
        self.stepped = False  # whether this pair's optimizer stage applied an update
        self.recompute = self.recompute  # the class's setting when the task was made, for all its stages
        self._acts: _Activations | None = None
        self._costs: tuple[StageCostModel, StageCostModel] | None = None  # (the trainer's, filled in)
        self._held = 0  # estimated bytes held between forward and backward
        self._held_layer: int | None = None  # `held_floats.layer_bytes` of the model, once asked
        self.stages: list[Stage] = []
        self._score_kv: PairKV | None = None  # between score windows
        self._score_sums = torch.zeros(2, dtype=torch.float64)
        if score:
            for w in self.windows:
                self.stages.append(Stage(StageKind.SCORE, f"score[{w.part} {w.start}:{w.stop}]",
                                         self._estimator_score(w.index), self._runner_score(w.index)))
        elif not trainer.has_reference(tokens):
            self.stages.append(Stage(StageKind.REFERENCE, "reference", self._estimate_reference,
                                     lambda: trainer.reference_logps(tokens)))
        for w in self.windows:
            self.stages.append(Stage(StageKind.FORWARD, f"forward[{w.part} {w.start}:{w.stop}]",
                                     self._estimator_forward(w.index), self._runner_forward(w.index)))
        for g in reversed(range(len(self.groups))):
            start, stop = self.groups[g]
            self.stages.append(Stage(StageKind.BACKWARD, f"backward[layers {start}:{stop}]",
                                     self._estimator_backward(g), self._runner_backward(g)))
        self.stages.append(Stage(StageKind.OPTIMIZER, "optimizer", self._estimate_optimizer, self._run_optimizer))
        self._cursor = 0

    @property
    def costs(self) -> StageCostModel:
        """The trainer's cost model with what it knows of this model filled in (a profile
        cached before those fields existed lacks them)."""
        source = self.trainer.costs
        if self._costs is None or self._costs[0] is not source:
            self._costs = (source, source.for_model(self.trainer.model))
        return self._costs[1]

    # -- driving ---------------------------------------------------------------------------

    def run(self) -> Score:
        while not self.done:
            self.run_next()
        assert self.result is not None
        return self.result

    @property
    def held_bytes(self) -> int:
        """Estimated activation bytes this task holds right now (a memory-ledger entry)."""
        return self._held if self._acts is not None else 0

    @property
    def can_abandon(self) -> bool:
        """True until the first backward stage has run (after that, gradients are partly in)."""
        first_backward = next(i for i, s in enumerate(self.stages) if s.kind is StageKind.BACKWARD)
        return self._cursor <= first_backward

    def abandon(self) -> None:
        """Drop held activations (first to go when memory shrinks); the task restarts at its
        first forward window, and the adapter is free for another task meanwhile. Refused once
        the backward has begun: it frees memory group by group anyway."""
        if not self.can_abandon:
            raise RuntimeError("the backward of this pair has begun; run it to the end instead of abandoning")
        self._acts = None
        self._held = 0
        self.trainer.release(self)
        first_forward = next(i for i, s in enumerate(self.stages) if s.kind is StageKind.FORWARD)
        self._cursor = min(self._cursor, first_forward)

    def seconds_by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.stages:
            if s.seconds is not None:
                out[s.kind.value] = out.get(s.kind.value, 0.0) + s.seconds
        return out

    # -- score -------------------------------------------------------------------------------

    def _estimator_score(self, j: int) -> Callable[[], StageEstimate]:
        def estimate() -> StageEstimate:
            t, w = self.trainer, self.windows[j]
            layers = t.model.cfg.num_layers
            est = self.costs.score(w.num_rows, layers, int(w.score_rows.numel()), with_reference=False)
            if j == 0 and not t.has_reference(self.tokens):  # the first window also fills the cache
                ref = self.costs.score(self.tokens.num_rows, layers, self._scored_rows(), with_reference=False)
                est = StageEstimate(est.seconds + ref.seconds, max(est.peak_bytes, ref.peak_bytes), 0)
            return est
        return estimate

    def _runner_score(self, j: int) -> Callable[[], None]:
        return lambda: self._run_score(j)

    def _run_score(self, j: int) -> None:
        """Window j of the no-grad score. Score windows are not exclusive (another update of the
        adapter may step between two of them); the loss they give is a priority input only."""
        trainer, model = self.trainer, self.trainer.model
        if j == 0:
            trainer.reference_logps(self.tokens)
            self._score_kv = PairKV(model.cfg.num_layers, model.cfg.layer_windows, model.cfg.attn_softcap)
            self._score_sums = torch.zeros(2, dtype=torch.float64)
        kv = self._score_kv
        if kv is None:
            raise RuntimeError("score windows must run in order from the first")
        win = self.windows[j]
        device = model.device
        with torch.no_grad():
            ctx = kv.context(win, trainer.applier())
            hidden = model.run_layers(model.embed_tokens(win.input_ids.to(device)), win.positions.to(device), ctx)
            if win.score_rows.numel():
                logp = token_logps(model, hidden.index_select(0, win.score_rows.to(device)), win.targets.to(device))
                self._score_sums.index_add_(0, win.owners, logp.double().cpu())
        if j == len(self.windows) - 1:
            self.score = self._scored(self._score_sums)
            self._score_kv = None

    def _estimate_reference(self) -> StageEstimate:
        t = self.trainer
        est = self.costs.score(self.tokens.num_rows, t.model.cfg.num_layers, self._scored_rows(), with_reference=False)
        return est  # `pair_logps` runs every window in one call of the layers: no layer's floats held

    def _scored_rows(self) -> int:
        return sum(int(w.score_rows.numel()) for w in self.windows)

    # -- forward windows ---------------------------------------------------------------------

    def _estimator_forward(self, j: int) -> Callable[[], StageEstimate]:
        def estimate() -> StageEstimate:
            w = self.windows[j]
            costs, layers = self.costs, self.trainer.model.cfg.num_layers
            held = sum(costs.forward_window(x.num_rows, layers, 0, 0, self.recompute).held_bytes
                       for x in self.windows[:j])
            return costs.forward_window(w.num_rows, layers, int(w.score_rows.numel()), held, self.recompute)
        return estimate

    def _runner_forward(self, j: int) -> Callable[[], None]:
        return lambda: self._run_forward(j)

    def _run_forward(self, j: int) -> None:
        trainer, model = self.trainer, self.trainer.model
        recompute = self.recompute
        if j == 0:
            trainer.claim(self)
            trainer.reference_logps(self.tokens)  # needed by the top backward group (normally cached)
            n = model.cfg.num_layers if recompute else len(self.groups)
            self._acts = _Activations(PairKV(model.cfg.num_layers, model.cfg.layer_windows, model.cfg.attn_softcap),
                                      [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)])
            self._held = 0
        acts = self._acts
        if acts is None:
            raise RuntimeError("forward windows must run in order from the first")
        win = self.windows[j]
        device = model.device
        applier = trainer.applier(training=True)
        ctx = acts.kv.context(win, applier)
        positions = win.positions.to(device)
        with torch.set_grad_enabled(not recompute):
            x = model.embed_tokens(win.input_ids.to(device))
            if recompute:
                for layer in range(model.cfg.num_layers):
                    acts.inputs[layer].append(x)
                    if draws_dropout(applier):  # only a dropout draw is replayed (window by window)
                        acts.rng[layer].append(_rng_state(device))
                    x = model.run_layers(x, positions, ctx, layer, layer + 1)
            else:
                for g, (start, stop) in enumerate(self.groups):
                    if g > 0:
                        # The cut that makes each group's backward its own graph.
                        x = x.detach().requires_grad_(True)
                        acts.inputs[g].append(x)
                    x = model.run_layers(x, positions, ctx, start, stop)
                    acts.outputs[g].append(x)
        with torch.enable_grad():
            rows = win.score_rows.to(device)
            if rows.numel():
                # Differentiate the head now and keep d(sum log p)/d(hidden) of the scored rows:
                # [n, hidden] instead of [n, vocab] logits waiting for the loss.
                top = x.detach().index_select(0, rows).requires_grad_(True)
                logp = token_logps(model, top, win.targets.to(device))
                logp.sum().backward()
                acts.head_grads.append((rows, top.grad, win.owners.to(device)))
                acts.sums.index_add_(0, win.owners, logp.detach().double().cpu())
            else:
                acts.head_grads.append((rows, x.new_zeros(0, x.shape[1]), win.owners.to(device)))
        self._held = self._estimator_forward(j)().held_bytes
        if j == len(self.windows) - 1:
            self.result = self._scored(acts.sums)
            acts.kv = PairKV(0)  # no window is left to attend to its keys/values (a recompute keeps its own)
            self._held -= self.costs.kv_bytes(self.tokens.num_rows, model.cfg.num_layers) if recompute else 0

    # -- backward by layer groups ------------------------------------------------------------

    def _estimator_backward(self, g: int) -> Callable[[], StageEstimate]:
        def estimate() -> StageEstimate:
            start, stop = self.groups[g]
            dropout = self.recompute and draws_dropout(self.trainer.applier(training=True))
            calls = len(self.windows) if dropout or not self.recompute else 1  # else every window in one call
            est = self.costs.backward_group(self.tokens.num_rows, stop - start, self._held, calls, self.recompute)
            return replace(est, peak_bytes=est.peak_bytes + self._held_layer_bytes()) if dropout else est
        return estimate

    def _held_layer_bytes(self) -> int:
        if self._held_layer is None:
            self._held_layer = held_floats.layer_bytes(self.trainer.model, QuantWeight)
        return self._held_layer

    def _runner_backward(self, g: int) -> Callable[[], None]:
        return lambda: self._run_backward(g)

    def _scored(self, sums: Tensor) -> Score:
        """The example's score from the policy's summed log-probs of its two rows."""
        return self.objective.score((float(sums[0]), float(sums[1])), self.trainer.reference_logps(self.tokens))

    def _top_seeds(self, acts: _Activations, shapes: list[Tensor]) -> list[Tensor]:
        """The objective's gradient w.r.t. the last layer's output, per window (`shapes`: a
        tensor of each window's output shape and dtype)."""
        assert self.result is not None
        coeff = self.objective.seed(self.result, self.trainer.accumulation_steps)
        seeds = []
        for like, (rows, grad, owners) in zip(shapes, acts.head_grads, strict=True):
            seed = torch.zeros_like(like)
            if rows.numel():
                scale = coeff.to(grad.dtype).to(grad.device)[owners][:, None]
                seed.index_add_(0, rows, (grad * scale).to(like.dtype))
            seeds.append(seed)
        acts.head_grads = []
        return seeds

    def _run_backward(self, g: int) -> None:
        acts = self._acts
        start, stop = self.groups[g]
        if acts is None or not (acts.inputs[stop - 1] if self.recompute else acts.outputs[g]):
            raise RuntimeError("backward groups must run after the forward windows, last group first")
        if self.recompute:
            self._recompute_backward(acts, start, stop)
        else:
            outputs = acts.outputs[g]
            if g == len(self.groups) - 1:
                seeds = self._top_seeds(acts, outputs)
            else:
                seeds = [x.grad if x.grad is not None else torch.zeros_like(x) for x in acts.inputs[g + 1]]
                acts.inputs[g + 1] = []
            torch.autograd.backward(outputs, seeds)
            acts.outputs[g] = []
        self._held = self.costs.backward_group(self.tokens.num_rows, stop - start, self._held,
                                                       len(self.windows), self.recompute).held_bytes
        if g == 0:
            self._acts = None
            self._held = 0

    def _recompute_backward(self, acts: _Activations, start: int, stop: int) -> None:
        """Layers [start, stop), last first: each one's forward over every window again (in
        order, so later windows attend to the earlier ones' keys/values in the same graph) from
        its kept inputs and RNG states, then its backward; the gradient on its inputs seeds the
        layer below."""
        model = self.trainer.model
        cfg, device = model.cfg, model.device
        applier = self.trainer.applier(training=True)
        if stop == cfg.num_layers:
            acts.seeds = self._top_seeds(acts, acts.inputs[stop - 1])
        if not draws_dropout(applier):
            self._recompute_together(acts, start, stop, applier)
            return
        outer = _rng_state(device)  # the recompute leaves the generators as it found them
        try:
            with held_floats.arena(self._held_layer_bytes()):  # one buffer for every layer's held floats
                for layer in reversed(range(start, stop)):
                    kv = PairKV(cfg.num_layers, cfg.layer_windows, cfg.attn_softcap)
                    leaves, outputs = [], []
                    # Window by window (each replays its draw); the layer's floats held till done.
                    with held_floats.holding():
                        with torch.enable_grad():
                            for win, kept, rng in zip(self.windows, acts.inputs[layer], acts.rng[layer], strict=True):
                                x = kept.detach().requires_grad_(layer > 0)  # the embedding is frozen
                                _set_rng_state(rng, device)
                                outputs.append(model.run_layers(x, win.positions.to(device), kv.context(win, applier),
                                                                layer, layer + 1))
                                leaves.append(x)
                        torch.autograd.backward(outputs, acts.seeds)
                        del outputs
                    acts.seeds = [x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves] if layer else []
                    acts.inputs[layer], acts.rng[layer] = [], []
        finally:
            _set_rng_state(outer, device)

    def _recompute_together(self, acts: _Activations, start: int, stop: int, applier: LoraApplier | None) -> None:
        """No dropout draws: every window in one call of each layer (`WindowsContext`), no floats held (#28)."""
        model, cfg = self.trainer.model, self.trainer.model.cfg
        positions = torch.cat([win.positions for win in self.windows]).to(model.device)
        for layer in reversed(range(start, stop)):
            kv = PairKV(cfg.num_layers, cfg.layer_windows, cfg.attn_softcap)
            x = torch.cat(acts.inputs[layer]).detach().requires_grad_(layer > 0)  # the embedding is frozen
            acts.inputs[layer], acts.rng[layer] = [], []
            with torch.enable_grad():
                out = model.run_layers(x, positions, kv.contexts(self.windows, applier), layer, layer + 1)
            torch.autograd.backward(out, torch.cat(acts.seeds))
            grad = x.grad if x.grad is not None else torch.zeros_like(x)
            acts.seeds = list(grad.split([win.num_rows for win in self.windows])) if layer else []

    # -- optimizer ---------------------------------------------------------------------------

    def _estimate_optimizer(self) -> StageEstimate:
        return self.trainer.optimizer_estimate()

    def _run_optimizer(self) -> None:
        if self.result is not None:
            self.objective.stepped(self.result)
        self.stepped = self.trainer.finish(self)
        if TRIM_AFTER_PAIR:
            give_heap_back()


# glibc keeps the heap a pair's stages freed (tensors under its mmap threshold: up to 32 MiB
# each) resident until asked; serving then runs beside it. docs/onnx.md measures it.
TRIM_AFTER_PAIR = True
# In the daemon the stages run on the engine thread, whose glibc arena is a chain of 64 MiB
# heaps that give back only their top: the freed tensors of one stage stayed resident under the
# next one's (the pair climbed ~400 MiB above its start at 1B). Trimmed after each stage (tens
# of ms against stages of seconds), each starts from what is live. docs/onnx.md measures it.
TRIM_AFTER_STAGE = True
TRIM_MIN_STAGE_S = 0.2  # shorter stages (tests, tiny models) skip the trim: it would cost more than they do


