"""Latency and memory of the work an iteration can hold, on this machine and model: a forward's
cost is linear in new tokens, attended (query, key) pairs and LM-head rows; fine-tune stages are
priced by their own estimates (`edge_runtime.train.costs`). Both are measured at start-up (the
forward's shapes timed by probe.py, fitted here; cached per model shape + device + dtype +
backend) and corrected online by moving averages of observed / predicted time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, astuple, dataclass, field
from pathlib import Path
from typing import Any

import torch

from edge_runtime import durable
from edge_runtime.kv.block_pool import BlockPool
from edge_runtime.model.config import ModelConfig
from edge_runtime.sched.batch import Batch
from edge_runtime.sched.probe import (
    SHAPES,
    ShapeInterrupted,
    attended_pairs,
    bounded,
    measure_forward,
    measure_shape,
)

log = logging.getLogger(__name__)

CACHE_VERSION = 1


@dataclass(frozen=True)
class ForwardCoefficients:
    """seconds(forward) = base + token * new tokens + attend * (query, key) pairs + logit * rows."""

    base_s: float
    token_s: float
    attend_s: float
    logit_s: float

    def seconds(self, tokens: int, attended: int, rows: int) -> float:
        return self.base_s + self.token_s * tokens + self.attend_s * attended + self.logit_s * rows

    def scaled(self, factor: float) -> ForwardCoefficients:
        return self if factor == 1.0 else ForwardCoefficients(*(factor * v for v in astuple(self)))

    @classmethod
    def nominal(cls, cfg: ModelConfig) -> ForwardCoefficients:
        """An order-of-magnitude guess (2 CPU cores, ~50 GFLOP/s) for when no calibration ran;
        the online correction takes over from the first iterations."""
        flops = 50e9
        per_token = 2 * cfg.num_layers * (cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
                                          + 3 * cfg.hidden_size * cfg.intermediate_size)
        per_pair = 4 * cfg.num_layers * cfg.q_size
        return cls(2e-3, per_token / flops, per_pair / flops, 2 * cfg.hidden_size * cfg.vocab_size / flops)


@dataclass
class Correction:
    """Moving average of observed / predicted seconds, so a profile taken on a quiet (or busy)
    machine follows what the machine does now."""

    alpha: float
    scale: float = 1.0
    error: float = 0.0  # moving average of |observed / predicted - 1|
    samples: int = 0

    def observe(self, raw_estimate: float, observed: float) -> None:
        """`raw_estimate`: the prediction before this correction was applied."""
        if raw_estimate <= 0 or observed <= 0:
            return
        ratio = min(10.0, max(0.1, observed / raw_estimate))
        miss = abs(observed / (raw_estimate * self.scale) - 1.0)
        # A running mean over the first 1/alpha samples, then an exponential average: the prior
        # (a profile taken at another load level) counts as one sample, not as the truth.
        self.samples += 1
        a = max(self.alpha, 1.0 / (self.samples + 1))
        self.error = (1 - a) * self.error + a * miss
        self.scale = (1 - a) * self.scale + a * ratio


@dataclass
class CostModel:
    """What the scheduler asks: marginal latency and memory of a decode step, a prefill chunk
    or fine-tune stages, and the fixed cost of running a forward at all."""

    forward: ForwardCoefficients
    kv_block_bytes: int
    block_size: int
    activation_bytes_per_token: int  # transient activations of one token through the forward
    logits_bytes_per_row: int
    ema_alpha: float = 0.2
    # "calibrated", "cached", "quick" or "stored" (an earlier start's quick or provisional fit:
    # both until a background calibration lands) or "nominal"
    source: str = "nominal"
    estimate_scale: float = 1.0  # EngineConfig.cost_scale: multiplies the coefficients, kept by recalibrate
    forward_fix: Correction = field(init=False)
    stage_fix: dict[str, Correction] = field(init=False)

    def __post_init__(self) -> None:
        self.forward = self.forward.scaled(self.estimate_scale)
        self.forward_fix = Correction(self.ema_alpha)
        self.stage_fix = {}

    # -- inference ---------------------------------------------------------------------------

    @property
    def forward_base_s(self) -> float:
        return self.forward.base_s * self.forward_fix.scale

    def inference_s(self, context: int, new: int, samples: bool) -> float:
        """Marginal seconds of feeding `new` tokens after `context` cached ones (one sequence)."""
        f = self.forward
        s = f.token_s * new + f.attend_s * attended_pairs(context, new) + (f.logit_s if samples else 0.0)
        return s * self.forward_fix.scale

    def inference_bytes(self, new: int, samples: bool) -> int:
        return self.activation_bytes_per_token * new + (self.logits_bytes_per_row if samples else 0)

    def unloaded_prefill_s(self, prompt_tokens: int) -> float:
        """A lone prompt's prefill forward (first token), as calibrated: the unit of the TTFT SLO."""
        return self.forward.seconds(prompt_tokens, attended_pairs(0, prompt_tokens), 1)

    def unloaded_decode_s(self, context: int = 256) -> float:
        return self.forward.seconds(1, context + 1, 1)

    def recalibrate(self, forward: ForwardCoefficients) -> None:
        """Coefficients measured while serving replace the nominal ones; the online correction
        starts over from them."""
        self.forward, self.source = forward.scaled(self.estimate_scale), "calibrated"
        self.forward_fix = Correction(self.ema_alpha)

    def observe_forward(self, planned_s: float, observed_s: float) -> None:
        """`planned_s`: what this model predicted for the forward (correction included)."""
        self.forward_fix.observe(planned_s / self.forward_fix.scale, observed_s)

    # -- fine-tune stages --------------------------------------------------------------------

    def stage_s(self, kind: str, estimate_s: float) -> float:
        fix = self.stage_fix.get(kind)
        return estimate_s * (fix.scale if fix is not None else 1.0)

    def observe_stage(self, kind: str, estimate_s: float, observed_s: float) -> None:
        fix = self.stage_fix.get(kind)
        if fix is None:
            fix = self.stage_fix[kind] = Correction(self.ema_alpha)
        fix.observe(estimate_s, observed_s)

    def describe(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "forward": asdict(self.forward),
            "forward_scale": round(self.forward_fix.scale, 4),
            "forward_error": round(self.forward_fix.error, 4),
            "stage_scale": {k: round(v.scale, 4) for k, v in self.stage_fix.items()},
            "stage_error": {k: round(v.error, 4) for k, v in self.stage_fix.items()},
        }


def activation_sizes(cfg: ModelConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes per token, bytes per logits row) a forward holds at its widest point: the MLP's
    gate/up/act tensors plus the residual stream and attention projections of one layer."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_token = elem * (4 * cfg.hidden_size + 3 * cfg.intermediate_size + cfg.q_size + 2 * cfg.kv_size)
    per_row = 4 * cfg.vocab_size + elem * cfg.vocab_size
    return per_token, per_row


# -- calibration ------------------------------------------------------------------------------

# The quick calibration before serving: one shape per coefficient (the fixed cost of a small
# decode, attended pairs and LM-head rows of a wider, deeper decode, new tokens of two
# prefills), timed once after a warm-up: a fit good to tens of percent in 8 small forwards
# (~1-2 CPU seconds for the default model on ONNX Runtime), so the SLO and the iteration budget
# start near this machine's, not a guess ten times off.
QUICK_SHAPES: tuple[tuple[tuple[int, int, int], ...], ...] = (
    ((1, 16, 1),), ((8, 128, 1),), ((1, 0, 32),), ((1, 0, 128),),
)


def quick_calibration(execute: Callable[[Batch], Any], pool: BlockPool, cfg: ModelConfig,
                      seed: int = 0, max_tokens: int | None = None) -> ForwardCoefficients | None:
    """Coefficients from `QUICK_SHAPES`, none over `max_tokens` new tokens (None if they do not
    fit the pool or the fit misses its own points by more than their size)."""
    started = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    shapes = bounded(QUICK_SHAPES, max_tokens)
    rows = [measure_shape(execute, pool, cfg.vocab_size, shape, 1, gen) for shape in shapes]
    rows = [row for row in rows if row is not None]
    if len(rows) < len(shapes):
        return None
    fitted = fit_forward(rows)
    miss = fit_error(fitted, rows)
    log.info("quick forward cost calibration in %.1f s (largest miss %.0f%%): %s",
             time.perf_counter() - started, 100 * miss, fitted)
    return fitted if miss < 1.0 else None


class BackgroundCalibration:
    """The forward's calibration one shape at a time, for an engine that serves meanwhile on
    nominal costs (corrected online): `step()` measures the next shape (a few forwards, well
    under a second on the default model) whenever the engine is idle, and once all are measured
    fits, caches and returns the coefficients."""

    def __init__(self, cfg: ModelConfig, execute: Callable[[Batch], Any], pool: BlockPool,
                 path: Path | None, repeats: int = 3, seed: int = 0, max_tokens: int | None = None) -> None:
        self.cfg, self.execute, self.pool, self.path, self.repeats = cfg, execute, pool, path, repeats
        self.gen = torch.Generator().manual_seed(seed)
        self.pending = list(bounded(SHAPES, max_tokens))
        self.rows: list[tuple[int, int, int, float]] = []
        self.busy = machine_busy()
        self.seconds = 0.0

    def step(self, interrupted: Callable[[], bool] = lambda: False) -> ForwardCoefficients | None:
        """Measure one more shape; the fitted coefficients once the last is measured (None
        before, and when the fit is not worth using: the nominal ones and the online correction
        stay). When `interrupted` says yes between two of the shape's forwards, the shape is
        left for a later step: a request arriving meanwhile waits for one forward, not a shape."""
        if not self.pending:
            return None
        started = time.perf_counter()
        try:
            row = measure_shape(self.execute, self.pool, self.cfg.vocab_size, self.pending[0], self.repeats,
                                self.gen, interrupted)
        except ShapeInterrupted:
            self.seconds += time.perf_counter() - started
            return None
        self.pending.pop(0)
        if row is not None:
            self.rows.append(row)
        self.seconds += time.perf_counter() - started
        if self.pending or len(self.rows) < 4:
            return None
        fitted = fit_forward(self.rows)
        miss = fit_error(fitted, self.rows)
        busy = self.busy or machine_busy()
        log.info("calibrated the forward cost model in the background, %.1f s of forwards (largest "
                 "miss %.0f%%%s): %s", self.seconds, 100 * miss, ", machine busy" if busy else "", fitted)
        if miss >= 1.0:
            return None
        store(self.path, asdict(fitted), busy)
        return fitted

    @property
    def done(self) -> bool:
        return not self.pending


def fit_error(coefficients: ForwardCoefficients, rows: list[tuple[int, int, int, float]]) -> float:
    """Largest relative miss of the fit on the measured shapes."""
    return max(abs(coefficients.seconds(t, a, r) / s - 1.0) for t, a, r, s in rows)


def machine_busy() -> bool:
    """More runnable work than CPUs: measurements now describe the other work as much as ours."""
    try:
        return os.getloadavg()[0] > 1.25 * (os.cpu_count() or 1)
    except OSError:
        return False


def fit_forward(rows: list[tuple[int, int, int, float]]) -> ForwardCoefficients:
    """Non-negative least squares on relative error (small decodes matter as much as long
    prefills): drop the most negative coefficient and refit until none is negative."""
    import numpy as np

    x = np.array([[1.0, t, a, r] for t, a, r, _ in rows])
    y = np.array([s for *_, s in rows])
    w = 1.0 / y
    active = [0, 1, 2, 3]
    coef = np.zeros(4)
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef = np.zeros(4)
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return ForwardCoefficients(*(float(c) for c in coef))


def fingerprint(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, backend: str, block_size: int,
                extra: str = "") -> str:
    """What the costs depend on: the model's shape (not its weights), the machine and the dtype."""
    if device.type == "cuda":
        machine = torch.cuda.get_device_name(device)
    else:
        machine = _cpu_name() + f"/threads={torch.get_num_threads()}"
    parts = [cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
             cfg.num_kv_heads, cfg.head_dim, str(dtype), device.type, machine, backend, block_size, extra]
    return hashlib.blake2b(repr(parts).encode(), digest_size=10).hexdigest()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cached(path: Path | None, build: Callable[[], tuple[dict[str, Any], bool, bool]]) -> tuple[dict[str, Any], bool]:
    """The JSON at `path` if it is there and current, else `build()` -> (values, worth keeping,
    provisional), written atomically when worth keeping. A provisional entry (measured on an
    oversubscribed machine) is used while the machine stays busy and measured again on the
    first quiet start. Returns (values, whether they came from the cache)."""
    values = read_cached(path)
    if values is not None:
        return values, True
    values, keep, provisional = build()
    if keep:
        store(path, values, provisional)
    return values, False


def read_cached(path: Path | None, provisional: bool = False) -> dict[str, Any] | None:
    """The values at `path` if they are there and current (see `cached`); with `provisional`,
    a provisional fit too."""
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("version") == CACHE_VERSION and (provisional or not (data.get("provisional") and not machine_busy())):
            return data["values"]
    except (OSError, ValueError, KeyError) as exc:
        log.warning("ignoring unreadable cost cache %s: %s", path, exc)
    return None


def read_stored(path: Path | None) -> dict[str, Any] | None:
    """The forward's values at `path` even when provisional (a starting point, not a calibration)."""
    values = read_cached(path, provisional=True)
    try:
        if values is not None:
            ForwardCoefficients(**values)  # a file of another shape is no starting point
        return values
    except TypeError as exc:
        log.warning("ignoring unreadable cost cache %s: %s", path, exc)
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("version") == CACHE_VERSION:
            ForwardCoefficients(**data["values"])  # a file of another shape is no starting point
            return data["values"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring unreadable cost cache %s: %s", path, exc)
    return None


def store(path: Path | None, values: dict[str, Any], provisional: bool) -> None:
    """Write a cost cache atomically (nothing when `path` is None)."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        durable.write_json(path, {"version": CACHE_VERSION, "provisional": provisional, "values": values}, indent=1)
    except OSError as exc:  # a read-only state dir costs a re-profile next start, nothing else
        log.warning("cannot write cost cache %s: %s", path, exc)


def cache_path(cache_dir: str | None, name: str) -> Path | None:
    """`cache_dir` None: <state dir>/costs; "": no cache (profile at every start)."""
    if cache_dir == "":
        return None
    if cache_dir is None:
        from edge_runtime.paths import state_dir

        return state_dir() / "costs" / name
    return Path(cache_dir) / name


def load_cost_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    backend_name: str,
    execute: Callable[[Batch], Any],
    pool: BlockPool,
    kv_block_bytes: int,
    *,
    mode: str = "auto",
    cache_dir: str | None = None,
    ema_alpha: float = 0.2,
    scale: float = 1.0,
    graph: str = "",
    max_tokens: int | None = None,
) -> tuple[CostModel, BackgroundCalibration | None]:
    """The forward's cost model: `mode` "auto" loads this machine's cached calibration or runs
    one (~11 synthetic batches through the real backend, before any request: seconds on a quiet
    machine, minutes on a busy one); "background" loads the cached one or starts from a quick
    one (4 batches, each timed once; nominal figures if that fails; an earlier start's stored
    quick or provisional fit instead when there is one) and returns the full calibration for the
    engine to run while idle; "off" starts from
    nominal figures and relies on the online correction alone. `scale` multiplies whichever
    figures it starts from and any that replace them (the cache keeps them unscaled). `graph`:
    which graph the backend runs, if any (`graph_version`), in the cache key beside the model's
    shape, machine, dtype and backend. `max_tokens`: the most new tokens an iteration holds
    (`max_batched_tokens`): no calibration forward is longer than a served one. Returns (model,
    calibration still to run or None)."""
    per_token, per_row = activation_sizes(cfg, dtype)
    coefficients, source = ForwardCoefficients.nominal(cfg), "nominal"
    if mode not in ("auto", "background", "off"):
        raise ValueError(f"unknown cost profile mode {mode!r}; use 'auto', 'background' or 'off'")
    key = fingerprint(cfg, device, dtype, backend_name, pool.block_size, extra=graph)
    path = cache_path(cache_dir, f"forward-{key}.json")
    if mode == "background":
        values = read_cached(path)
        if values is not None:
            return CostModel(ForwardCoefficients(**values), kv_block_bytes, pool.block_size, per_token, per_row,
                             ema_alpha, "cached", scale), None
        # No current full calibration (it runs while idle: a daemon stopped before it finished,
        # or one measured on a busy machine at a quiet start, leaves none): start from the fit
        # an earlier start stored under this same key, else measure the quick one and store it.
        # Either way the background calibration runs and, once it lands, replaces it.
        quick = path.with_name(f"quick-{path.name}") if path is not None else None
        stored = read_stored(path) or read_stored(quick)
        if stored is not None:
            coefficients, source = ForwardCoefficients(**stored), "stored"
            log.info("forward costs from an earlier start's calibration until this one's: %s", coefficients)
        else:
            fitted = quick_calibration(execute, pool, cfg, max_tokens=max_tokens)
            if fitted is not None:
                coefficients, source = fitted, "quick"
                store(quick, asdict(fitted), provisional=True)
        return (CostModel(coefficients, kv_block_bytes, pool.block_size, per_token, per_row, ema_alpha, source, scale),
                BackgroundCalibration(cfg, execute, pool, path, max_tokens=max_tokens))
    if mode == "auto":

        def calibrate() -> tuple[dict[str, Any], bool, bool]:
            started = time.perf_counter()
            busy = machine_busy()
            rows = measure_forward(execute, pool, cfg.vocab_size, max_tokens=max_tokens)
            if len(rows) < 4:
                return asdict(ForwardCoefficients.nominal(cfg)), False, False
            fitted = fit_forward(rows)
            miss = fit_error(fitted, rows)
            busy = busy or machine_busy()
            # A fit that misses its own measurements by more than their size is not kept; one
            # taken while the machine was oversubscribed is kept only until a quiet start.
            log.info("calibrated the forward cost model in %.1f s (largest miss %.0f%%%s): %s",
                     time.perf_counter() - started, 100 * miss, ", machine busy" if busy else "", fitted)
            return asdict(fitted), miss < 1.0, busy

        values, hit = cached(path, calibrate)
        coefficients, source = ForwardCoefficients(**values), "cached" if hit else "calibrated"
    return CostModel(coefficients, kv_block_bytes, pool.block_size, per_token, per_row, ema_alpha, source,
                     scale), None


def graph_version(backend: Any) -> str:
    """The kind and version of graph a backend runs (an ONNX export's name less its weights
    digest: `onnx_export.export_key`), "" for one that runs none: a new graph is timed again."""
    path = getattr(backend, "model_path", None)
    return "" if path is None else Path(path).parent.name.split("-", 1)[-1]


def load_stage_costs(model: Any, settings: Any, *, cache_dir: str | None = None, backend_name: str = "torch",
                     block_size: int = 16) -> Any:
    """The fine-tune stages' `StageCostModel` for these LoRA settings, profiled once per machine
    (`StageCostModel.profile`, seconds) and cached like the forward's calibration."""
    from edge_runtime.train.costs import StageCostModel

    # "affine": profiles from before the fixed per-call part was measured lack it; a new key
    # makes them re-profile rather than load as a purely per-row model.
    key = fingerprint(model.cfg, model.device, model.dtype, backend_name, block_size, extra=f"affine/{settings!r}")
    def profile() -> tuple[dict[str, Any], bool, bool]:
        busy = machine_busy()
        values = StageCostModel.profile(model, settings).as_dict()
        return values, True, busy or machine_busy()

    values, _ = cached(cache_path(cache_dir, f"stages-{key}.json"), profile)
    return StageCostModel(**values)
