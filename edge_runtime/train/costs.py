"""Latency and memory estimates for the fine-tune stages, from a cost model measured at start-up.

Costs are linear in token rows x layers (the GEMMs dominate at edge sequence lengths), with the
LM head priced per scored row. `profile()` times a few layers on the actual machine and counts
the bytes autograd saves, so the scheduler sees this device's numbers, not a guess.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from edge_runtime.lora.config import LoraSettings
from edge_runtime.lora.weights import LoraWeights, TrainingLora
from edge_runtime.model.dense import DenseCausalContext
from edge_runtime.model.llama import LlamaModel


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
        )

    @classmethod
    def profile(cls, model: LlamaModel, settings: LoraSettings, rows: int = 64, layers: int = 2, repeats: int = 2) -> StageCostModel:
        """Time `layers` layers on `rows` tokens (no-grad, grad forward, backward), the LM head,
        and an AdamW step; count the activation bytes autograd saves."""
        cfg = model.cfg
        layers = min(layers, cfg.num_layers)
        weights = LoraWeights.init(cfg, settings, seed=0)
        for b in weights.b.values():
            b.normal_(0.0, 0.01)  # a zero B would make autograd skip A's gradient work
        weights = weights.trainable()
        applier = TrainingLora(weights, dropout=0.0)
        ids = torch.randint(0, cfg.vocab_size, (rows,), device=model.device)
        pos = torch.arange(rows, device=model.device)
        params = {p.data_ptr() for p in model.parameters()} | {p.data_ptr() for p in weights.parameters()}

        def best(fn: Callable[[], None]) -> float:
            fn()  # warm-up: first calls pay for allocator growth and kernel selection
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return min(times)

        x0 = model.embed_tokens(ids).detach()

        def nograd() -> None:
            with torch.no_grad():
                model.run_layers(x0, pos, DenseCausalContext(1, rows, lora=applier), 0, layers)

        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        out_holder: list[torch.Tensor] = []

        def grad_fwd() -> None:
            out_holder.clear()
            saved.clear()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                x = x0.clone().requires_grad_(True)
                out_holder.append(model.run_layers(x, pos, DenseCausalContext(1, rows, lora=applier), 0, layers))

        def bwd() -> None:
            out_holder[0].backward(torch.ones_like(out_holder[0]))

        t_nograd = best(nograd)
        grad_fwd()
        bwd()
        t_fwd, t_bwd = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            grad_fwd()
            t_fwd.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            bwd()
            t_bwd.append(time.perf_counter() - t0)
        saved_bytes = sum(saved.values())  # of the last forward (the graph still alive)

        hidden = torch.randn(rows, cfg.hidden_size, device=model.device, dtype=model.dtype)
        targets = torch.randint(0, cfg.vocab_size, (rows,), device=model.device)

        def head() -> None:
            with torch.no_grad():
                model.logits(hidden)

        def head_grad() -> None:
            h = hidden.clone().requires_grad_(True)
            logits = model.logits(h).float()
            (logits.gather(-1, targets[:, None]) - torch.logsumexp(logits, -1, keepdim=True)).sum().backward()

        opt = torch.optim.AdamW(weights.parameters(), lr=1e-4)
        for p in weights.parameters():
            p.grad = torch.zeros_like(p)

        def step() -> None:
            opt.step()

        t_opt = best(step)
        norm = rows * layers
        return cls(
            nograd_s_per_row_layer=t_nograd / norm,
            grad_fwd_s_per_row_layer=min(t_fwd) / norm,
            bwd_s_per_row_layer=min(t_bwd) / norm,
            head_s_per_row=best(head) / rows,
            head_grad_s_per_row=best(head_grad) / rows,
            optimizer_s_per_param=t_opt / max(1, weights.num_params),
            saved_bytes_per_row_layer=saved_bytes / norm,
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
        )

    # -- estimates per stage -----------------------------------------------------------------

    def logits_bytes(self, scored_rows: int) -> int:
        return 3 * 4 * scored_rows * self.vocab_size  # logits, softmax work, grad (float32)

    def score(self, rows: int, layers: int, scored: int, with_reference: bool) -> StageEstimate:
        passes = 2 if with_reference else 1
        seconds = passes * (self.nograd_s_per_row_layer * rows * layers + self.head_s_per_row * scored)
        peak = 16 * 4 * rows * self.hidden_size + self.logits_bytes(scored) // 3
        return StageEstimate(seconds, int(peak), 0)

    def forward_window(self, rows: int, layers: int, scored: int, held_before: int) -> StageEstimate:
        seconds = self.grad_fwd_s_per_row_layer * rows * layers + self.head_grad_s_per_row * scored
        held = held_before + int(self.saved_bytes_per_row_layer * rows * layers)
        return StageEstimate(seconds, held - held_before + self.logits_bytes(scored), held)

    def backward_group(self, rows: int, layers: int, held_before: int) -> StageEstimate:
        freed = int(self.saved_bytes_per_row_layer * rows * layers)
        seconds = self.bwd_s_per_row_layer * rows * layers
        # Gradients of one group's activations exist only while that group runs backward.
        return StageEstimate(seconds, freed // 2 + 8 * 4 * rows * self.hidden_size, max(0, held_before - freed))

    def optimizer(self, num_params: int, steps: bool) -> StageEstimate:
        if not steps:
            return StageEstimate(0.0, 0, 0)
        return StageEstimate(self.optimizer_s_per_param * num_params, 4 * num_params, 0)
