"""Latency and memory estimates for the fine-tune stages, from a cost model measured at start-up.

Costs are affine in token rows, per layer: a fixed part per layer call (reading the layer's
weights, which bounds a small window's GEMMs: on this project's 2-core CPU a 1-row window costs
about a fifth of a 64-row one) plus a part per row. The LM head is priced the same way per
scored row. `profile()` times a few layers at two window sizes on the actual machine and counts
the bytes autograd saves, so the scheduler sees this device's numbers, not a guess.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from edge_runtime.lora.config import LoraSettings
from edge_runtime.lora.weights import LoraWeights, TrainingLora
from edge_runtime.model.dense import DenseCausalContext
from edge_runtime.model.llama import LlamaModel
from edge_runtime.model.qweights import CHUNK_ELEMENTS, QuantWeight
from edge_runtime.train.logprobs import token_logps
from edge_runtime.train.optim import LoraOptimizer, OptimizerSettings

log = logging.getLogger(__name__)

# A profiled call this long is timed once after its warm-up, not `repeats` times: its timer and
# allocator noise is a few percent of it (the online correction follows the machine's load), and
# at the 8B shape read in place every repeat of a 64-row call costs seconds (issue #28).
LONG_CALL_S = 0.5


@dataclass(frozen=True)
class StageEstimate:
    seconds: float
    peak_bytes: int  # transient memory while the stage runs (beyond what the task already holds)
    held_bytes: int  # activations the task holds once the stage is done (kept for backward)


@dataclass(frozen=True)
class StageCostModel:
    nograd_s_per_row_layer: float
    grad_fwd_s_per_row_layer: float
    bwd_s_per_row_layer: float
    head_s_per_row: float  # LM head forward, no grad
    head_grad_s_per_row: float  # LM head forward + backward
    optimizer_s_per_param: float
    saved_bytes_per_row_layer: float  # what autograd keeps per token row per layer
    hidden_size: int
    vocab_size: int
    # The fixed part of each call (per layer of a window, per LM-head call), whatever its rows.
    nograd_s_per_layer: float = 0.0
    grad_fwd_s_per_layer: float = 0.0
    bwd_s_per_layer: float = 0.0
    head_s: float = 0.0
    head_grad_s: float = 0.0
    intermediate_size: int = 0  # the MLP's (0: four times hidden_size, for profiles cached before it)
    # The thread's buffer a quantised weight is de-quantised into a piece at a time (qweights),
    # allocated by the first stage that reads a weight in torch (0 for a float model).
    workspace_bytes: int = 0
    # The element size of the model's activations (bf16: 2) and one layer's keys' width per token
    # (values the same): what a window keeps for the backward is each layer's input and the keys
    # and values the later windows attend to (measured on an H200 at the 1B shape: exactly that).
    activation_bytes: int = 4
    kv_size: int = 0  # 0: a profile cached before it (no keys counted)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def nominal(cls, model: LlamaModel) -> StageCostModel:
        """Order-of-magnitude figures (SmolLM2-135M, fp32, 2 CPU threads) for when no profile ran."""
        cfg = model.cfg
        per_layer_flops = 2 * (cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
                               + 3 * cfg.hidden_size * cfg.intermediate_size)
        flops_per_s = 80e9  # measured order for fp32 GEMMs on 2 AVX-512 cores
        row_layer = per_layer_flops / flops_per_s
        head = 2 * cfg.hidden_size * cfg.vocab_size / flops_per_s
        # A call reads all of a layer's weights whatever its rows (the fixed part of a small
        # window); order of a CPU's memory bandwidth.
        bytes_per_s = 10e9
        layer_read = (per_layer_flops / 2) * 4 / bytes_per_s
        return cls(
            nograd_s_per_row_layer=row_layer,
            grad_fwd_s_per_row_layer=1.1 * row_layer,
            bwd_s_per_row_layer=1.2 * row_layer,
            head_s_per_row=head,
            head_grad_s_per_row=2.3 * head,
            optimizer_s_per_param=1e-8,
            saved_bytes_per_row_layer=4.0 * (6 * cfg.hidden_size + 3 * cfg.intermediate_size + cfg.q_size),
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            intermediate_size=cfg.intermediate_size,
            workspace_bytes=workspace_bytes(model),
            activation_bytes=model.dtype.itemsize,
            kv_size=cfg.kv_size,
            nograd_s_per_layer=layer_read,
            grad_fwd_s_per_layer=layer_read,
            bwd_s_per_layer=2 * layer_read,
            head_s=cfg.hidden_size * cfg.vocab_size * 4 / bytes_per_s,
            head_grad_s=2 * cfg.hidden_size * cfg.vocab_size * 4 / bytes_per_s,
        )

    @classmethod
    def profile(cls, model: LlamaModel, settings: LoraSettings, rows: int = 64, layers: int = 2, repeats: int = 2,
                small_rows: int = 8, long_call_s: float = LONG_CALL_S,
                calls: dict[str, int] | None = None) -> StageCostModel:
        """Time `layers` layers (no-grad, grad forward, backward), the LM head and an AdamW step
        on windows of `small_rows` and of `rows` tokens, and fit each cost's fixed and per-row
        parts through the two; count the activation bytes autograd saves. Each call is warmed up
        once, then timed `repeats` times, or once when the warm-up took `long_call_s` or more.
        `calls` (if given) receives how many of each were run: layer forwards and backwards
        (one per layer), LM-head forwards and backwards."""
        if not 0 < small_rows < rows:
            raise ValueError(f"profile needs 0 < small_rows < rows, got {small_rows} and {rows}")
        started = time.perf_counter()
        counts = calls if calls is not None else {}
        for key in ("layer_forwards", "layer_backwards", "head_forwards", "head_backwards"):
            counts[key] = 0
        cfg = model.cfg
        layers = min(layers, cfg.num_layers)
        weights = LoraWeights.init(cfg, settings, seed=0)
        for b in weights.b.values():
            b.normal_(0.0, 0.01)  # a zero B would make autograd skip A's gradient work
        weights = weights.trainable(model.device)
        applier = TrainingLora(weights, dropout=0.0)
        params = {p.data_ptr() for p in model.parameters()} | {p.data_ptr() for p in weights.parameters()}

        def timed(fn: Callable[[], None]) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        def best(fn: Callable[[], None]) -> float:
            # The warm-up pays for allocator growth and kernel selection; a long one says
            # that one more call is a fair timing. Each window size keeps its own warm-up: past
            # FUSED_MAX_ROWS rows a GGUF matrix is read through de-quantised tiles, not the
            # fused kernel, and a first 64-row call without one doubled the 1B estimates.
            warm = timed(fn)
            return min(timed(fn) for _ in range(1 if warm >= long_call_s else repeats))

        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        def measure(n: int) -> dict[str, float]:
            ids = torch.randint(0, cfg.vocab_size, (n,), device=model.device)
            pos = torch.arange(n, device=model.device)
            x0 = model.embed_tokens(ids).detach()

            def nograd() -> None:
                counts["layer_forwards"] += layers
                with torch.no_grad():
                    model.run_layers(x0, pos, DenseCausalContext(1, n, lora=applier), 0, layers)

            out_holder: list[torch.Tensor] = []

            def grad_fwd() -> None:
                counts["layer_forwards"] += layers
                out_holder.clear()
                saved.clear()
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    x = x0.clone().requires_grad_(True)
                    out_holder.append(model.run_layers(x, pos, DenseCausalContext(1, n, lora=applier), 0, layers))

            def bwd() -> None:
                counts["layer_backwards"] += layers
                out_holder[0].backward(torch.ones_like(out_holder[0]))

            t_nograd = best(nograd)
            warm = timed(grad_fwd) + timed(bwd)
            t_fwd, t_bwd = [], []
            for _ in range(1 if warm >= long_call_s else repeats):
                t_fwd.append(timed(grad_fwd))
                t_bwd.append(timed(bwd))
            saved_bytes = sum(saved.values())  # of the last forward (the graph still alive)

            hidden = torch.randn(n, cfg.hidden_size, device=model.device, dtype=model.dtype)
            targets = torch.randint(0, cfg.vocab_size, (n,), device=model.device)

            # The head as the stages read it (`token_logps`: a piece of the vocabulary at a time,
            # each piece's mapped block pages given back once read where another backend
            # serves): `model.logits` kept the whole tied table's pages (206 MiB at 1B) and the
            # [rows, vocab] logits resident, the first pair's peak in the daemon (#28).
            def head() -> None:
                counts["head_forwards"] += 1
                with torch.no_grad():
                    token_logps(model, hidden, targets)

            def head_grad() -> None:
                counts["head_forwards"] += 1
                counts["head_backwards"] += 1
                h = hidden.clone().requires_grad_(True)
                token_logps(model, h, targets).sum().backward()

            return {"nograd": t_nograd / layers, "grad_fwd": min(t_fwd) / layers, "bwd": min(t_bwd) / layers,
                    "head": best(head), "head_grad": best(head_grad), "saved": saved_bytes / (n * layers)}

        small, large = measure(small_rows), measure(rows)
        fit = {k: _affine(small[k], large[k], small_rows, rows) for k in ("nograd", "grad_fwd", "bwd", "head", "head_grad")}

        opt = LoraOptimizer(weights.parameters(), OptimizerSettings(learning_rate=1e-4, max_grad_norm=None))

        zeros = [torch.zeros_like(p) for p in weights.parameters()]

        def step() -> None:  # the trainer's own AdamW (torch.optim would import torch._dynamo: #28)
            for p, g in zip(weights.parameters(), zeros, strict=True):
                p.grad = g
            opt.accumulate()

        t_opt = best(step)
        log.info("profiled the fine-tune stage costs in %.1f s: %s", time.perf_counter() - started,
                 ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items()))
        return cls(
            nograd_s_per_row_layer=fit["nograd"][1],
            grad_fwd_s_per_row_layer=fit["grad_fwd"][1],
            bwd_s_per_row_layer=fit["bwd"][1],
            head_s_per_row=fit["head"][1],
            head_grad_s_per_row=fit["head_grad"][1],
            optimizer_s_per_param=t_opt / max(1, weights.num_params),
            saved_bytes_per_row_layer=large["saved"],
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            intermediate_size=cfg.intermediate_size,
            workspace_bytes=workspace_bytes(model),
            activation_bytes=model.dtype.itemsize,
            kv_size=cfg.kv_size,
            nograd_s_per_layer=fit["nograd"][0],
            grad_fwd_s_per_layer=fit["grad_fwd"][0],
            bwd_s_per_layer=fit["bwd"][0],
            head_s=fit["head"][0],
            head_grad_s=fit["head_grad"][0],
        )

    def for_model(self, model: LlamaModel) -> StageCostModel:
        """This model with the model's own figures where they are missing (0), and its
        activations' element size."""
        if self.intermediate_size and (self.workspace_bytes or not workspace_bytes(model)) \
                and self.kv_size and self.activation_bytes == model.dtype.itemsize:
            return self
        return replace(self, intermediate_size=self.intermediate_size or model.cfg.intermediate_size,
                       workspace_bytes=self.workspace_bytes or workspace_bytes(model),
                       activation_bytes=model.dtype.itemsize, kv_size=self.kv_size or model.cfg.kv_size)

    # -- estimates per stage -----------------------------------------------------------------

    def logits_bytes(self, scored_rows: int) -> int:
        """The LM head's log-probs read the vocabulary a piece at a time (`train/logprobs.py`):
        one piece's logits, their float32 post-processing and exponentials (the backward's seed
        in their place) exist at once, never the whole [rows, vocab]."""
        piece = min(self.vocab_size, max(1, CHUNK_ELEMENTS // self.hidden_size))
        return 3 * 4 * scored_rows * piece

    def layer_input_bytes(self, rows: int, layers: int, kv: bool = True) -> int:
        """What the recomputing forward keeps per window: each layer's input [rows, hidden] and
        (`kv`) its keys and values, which the pair's later windows attend to; the last window's
        forward lets the keys and values go (train/staged.py), so the backward holds inputs only."""
        return self.activation_bytes * rows * layers * self.hidden_size + (self.kv_bytes(rows, layers) if kv else 0)

    def _head(self, scored: int, grad: bool) -> float:
        if scored <= 0:
            return 0.0
        if grad:
            return self.head_grad_s + self.head_grad_s_per_row * scored
        return self.head_s + self.head_s_per_row * scored

    def _working(self, rows: int) -> int:
        """One layer's transient tensors (hidden, q/k/v, the MLP's gate/up and activation; their
        gradients in a backward) plus the de-quantisation buffer."""
        inter = self.intermediate_size or 4 * self.hidden_size
        return self.activation_bytes * rows * (6 * self.hidden_size + 4 * inter) + self.workspace_bytes

    def _gradients(self, rows: int) -> int:
        """The gradients alive at once in one layer's backward: the MLP's gate/up gradient and the
        residual stream's (at the 1B shape on an H200, 7.1 MiB of 208 rows' backward against this
        7.3), plus the de-quantisation buffer the recomputed forward takes."""
        inter = self.intermediate_size or 4 * self.hidden_size
        return self.activation_bytes * rows * (2 * inter + self.hidden_size) + self.workspace_bytes

    def score(self, rows: int, layers: int, scored: int, with_reference: bool) -> StageEstimate:
        passes = 2 if with_reference else 1
        seconds = passes * ((self.nograd_s_per_layer + self.nograd_s_per_row_layer * rows) * layers
                            + self._head(scored, grad=False))
        # One layer's transients, the keys and values of every layer (the pair's later windows
        # attend to them) and one head piece's logits with their float32 post-processing (the
        # exponentials of the online logsumexp): measured so at the 1B shape on an H200.
        peak = self._working(rows) + self.kv_bytes(rows, layers) + self.logits_bytes(scored)
        return StageEstimate(seconds, int(peak), 0)

    def kv_bytes(self, rows: int, layers: int) -> int:
        """The keys and values `rows` tokens leave in `layers` layers."""
        return self.activation_bytes * rows * layers * 2 * self.kv_size

    def forward_window(self, rows: int, layers: int, scored: int, held_before: int,
                       recompute: bool = True) -> StageEstimate:
        """`recompute`: the window runs without grad and keeps each layer's input (staged.py's
        default); otherwise it keeps what autograd saves for every layer."""
        if recompute:
            seconds = (self.nograd_s_per_layer + self.nograd_s_per_row_layer * rows) * layers + self._head(scored, grad=True)
            held = held_before + self.layer_input_bytes(rows, layers) + self.activation_bytes * scored * self.hidden_size
            return StageEstimate(seconds, held - held_before + self._working(rows) + self.logits_bytes(scored), held)
        seconds = (self.grad_fwd_s_per_layer + self.grad_fwd_s_per_row_layer * rows) * layers + self._head(scored, grad=True)
        held = held_before + int(self.saved_bytes_per_row_layer * rows * layers)
        return StageEstimate(seconds, held - held_before + self.logits_bytes(scored) + self.workspace_bytes, held)

    def backward_group(self, rows: int, layers: int, held_before: int, windows: int = 1,
                       recompute: bool = True) -> StageEstimate:
        """`rows` over all of the pair's windows in `windows` calls of each layer (one per window
        where each runs alone: LoRA dropout's replay, or graphs kept from the forward; else one).
        `recompute`: each layer's grad forward runs again here, and one layer's graph (over
        every window) exists at a time; otherwise the group's graphs were held since the forward."""
        grads = self._gradients(rows)
        if recompute:
            per_layer = (self.grad_fwd_s_per_layer + self.bwd_s_per_layer) * windows
            per_row = self.grad_fwd_s_per_row_layer + self.bwd_s_per_row_layer
            peak = int(self.saved_bytes_per_row_layer * rows) + grads
            return StageEstimate((per_layer + per_row * rows) * layers, peak,
                                 max(0, held_before - self.layer_input_bytes(rows, layers, kv=False)))
        freed = int(self.saved_bytes_per_row_layer * rows * layers)
        seconds = (self.bwd_s_per_layer * windows + self.bwd_s_per_row_layer * rows) * layers
        # Gradients of one group's activations exist only while that group runs backward.
        return StageEstimate(seconds, freed // 2 + grads, max(0, held_before - freed))

    def optimizer(self, num_params: int, steps: bool) -> StageEstimate:
        if not steps:
            return StageEstimate(0.0, 0, 0)
        return StageEstimate(self.optimizer_s_per_param * num_params, 4 * num_params, 0)


def workspace_bytes(model: LlamaModel) -> int:
    """The de-quantisation buffer's most: the largest quantised weight, at most CHUNK_ELEMENTS."""
    sizes = [m.shape[0] * m.shape[1] for m in model.modules() if isinstance(m, QuantWeight)]
    return model.dtype.itemsize * min(CHUNK_ELEMENTS, max(sizes)) if sizes else 0


def _affine(t_small: float, t_large: float, n_small: int, n_large: int) -> tuple[float, float]:
    """(fixed, per row) of the line through two timings; neither part negative (a noisy pair of
    timings can put the line's intercept below zero or make it fall)."""
    per_row = max(0.0, (t_large - t_small) / (n_large - n_small))
    fixed = max(0.0, t_small - per_row * n_small)
    if per_row == 0.0:
        per_row = t_large / n_large  # timings that fell: price it all per row, as before
        fixed = 0.0
    return fixed, per_row
