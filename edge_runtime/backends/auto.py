"""`backend = "auto"`: the fastest backend this device and the installed packages support that
agrees with the torch reference on a few greedy tokens (the start-up self-check); torch when
nothing else is installed, builds, or agrees, with the reason. Owns the choice and the check,
not the backends themselves.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from edge_runtime.backends.base import Backend
from edge_runtime.sched.batch import Batch, ScheduledSeq
from edge_runtime.sched.probe import ProbeSeq

if TYPE_CHECKING:
    from edge_runtime.config import EngineConfig
    from edge_runtime.kv.block_pool import BlockPool

log = logging.getLogger(__name__)

# Perplexity of each ONNX weight format relative to float, measured on the default model and
# tools/data/perplexity.txt (docs/onnx.md: float 31.93, q4_1 31.95, int8 32.36, int4 37.83,
# int4-compact 40.04). Other models are assumed to lose alike; tools/bench_engine.py measures
# one's own. q4_1 is exact for a Q4_1 GGUF (the default model); on a float checkpoint it costs
# what llama.cpp's Q4_1 does (a few per cent on its published runs).
PERPLEXITY_INCREASE = {"none": 0.0, "q4_1": 0.0007, "int8": 0.013, "int4": 0.185, "int4-compact": 0.254}
# Fastest first at one stream (docs/onnx.md, "Results on this machine").
FORMATS_BY_SPEED = ("int4-compact", "int4", "q4_1", "int8", "none")

# The self-check: greedy tokens of each prompt must match the torch reference's, and each
# step's logits may differ by at most this share of the reference logits' range. Weight-only
# int8 stays within ~2 % on the default model; a wrong graph (a convention the kernels count
# differently, a broken export) is off by the whole range. A token may differ only at a near
# tie: where the reference ranks it within SELF_CHECK_NEAR_TIE of the range below its best
# (random-weight models at real sizes have near-flat logits over 128k tokens: issue #28).
SELF_CHECK_PROMPTS = ("The capital of France is", "def fibonacci(n):")
SELF_CHECK_TOKENS = 4
SELF_CHECK_TOLERANCE = {"none": 0.01, "q4_1": 0.08, "int8": 0.08, "int4": 0.3, "int4-compact": 0.3}
SELF_CHECK_NEAR_TIE = 0.01


@dataclass(frozen=True)
class BackendChoice:
    """Which backend runs and why (`macectl status`, `/metrics`)."""

    requested: str  # the setting: "auto" or an explicit backend
    name: str  # the backend that runs
    quantization: str  # its weight format ("none" for torch)
    reason: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class SelfCheck:
    ok: bool
    tokens: list[list[int]]
    reference_tokens: list[list[int]]
    relative_error: float  # max |logits - reference| / range of the reference logits, any step
    tolerance: float
    near_ties: int = 0  # positions where the tokens differ within the measured error

    def describe(self) -> str:
        agree = "greedy tokens equal" if self.tokens == self.reference_tokens else (
            f"greedy tokens differ ({self.tokens} vs torch {self.reference_tokens})")
        if self.near_ties and self.ok:
            agree = (f"greedy tokens equal but for {self.near_ties} near tie(s) within "
                     f"{SELF_CHECK_NEAR_TIE:.0%} of the range ({self.tokens} vs torch {self.reference_tokens})")
        return f"{agree}, logits within {self.relative_error:.3f} of torch's range (tolerance {self.tolerance})"


def pick_quantization(margin: float) -> str:
    """The fastest ONNX weight format whose perplexity stays within `margin` (a fraction) of
    the float model's."""
    for name in FORMATS_BY_SPEED:
        if PERPLEXITY_INCREASE[name] <= margin:
            return name
    return "none"


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def candidates(device: torch.device) -> list[str]:
    """Backends worth trying on this device, fastest first, before the torch fallback."""
    names = []
    if device.type == "cuda" and installed("tensorrt"):
        names.append("tensorrt")
    if installed("onnxruntime") and installed("onnx"):
        if device.type != "cuda":
            names.append("onnxruntime")
        else:
            from edge_runtime.backends.ort_session import onnxruntime_has_gpu

            if onnxruntime_has_gpu():  # the CUDA / TensorRT execution providers
                names.append("onnxruntime")
    return names


def first_candidate(device: torch.device) -> str:
    """What auto will most likely run (so the engine can load weights in that backend's dtype)."""
    names = candidates(device)
    return names[0] if names else "torch"


def reads_gguf_in_place(model: Any) -> bool:
    """Whether the model's matrices are views of a GGUF's memory map (`gguf_weight`)."""
    from edge_runtime.model.gguf_weight import GgufWeight

    return any(isinstance(m, GgufWeight) for m in model.modules())


def choose_backend(config: EngineConfig, model: Any, cache: Any, adapters: Any, pool: BlockPool,
                   prompts: list[list[int]]) -> tuple[Backend, BackendChoice]:
    """Build the configured backend; for "auto", the first candidate that builds and passes the
    self-check on `prompts` (token ids), else torch. Returns (backend, why)."""
    from edge_runtime.backends import make_backend
    from edge_runtime.backends.torch_backend import TorchBackend

    quantization = config.onnx_quantization
    if quantization == "auto":
        quantization = pick_quantization(config.onnx_perplexity_margin)
        why_format = (f"{quantization}: the fastest weight format within "
                      f"{config.onnx_perplexity_margin:.0%} of float perplexity")
    else:
        why_format = f"{quantization} as configured"
    if config.backend != "auto":
        backend = make_backend(config.replace(onnx_quantization=quantization), model, cache, adapters)
        used = quantization if backend.runs_onnx_weights else "none"
        return backend, BackendChoice(config.backend, backend.name, used, "set explicitly")
    reference = TorchBackend(model, cache, adapters)
    if reads_gguf_in_place(model):
        reason = (f"the matrices are the GGUF's own bytes, read in place (engine.torch_weights = {config.torch_weights}): "
                  "a graph backend would hold a re-encoded copy beside them")
        log.info("auto backend: torch (%s)", reason)
        return reference, BackendChoice("auto", "torch", "none", reason)
    tried = []
    for name in candidates(model.device):
        try:
            backend = make_backend(config.replace(backend=name, onnx_quantization=quantization),
                                   model, cache, adapters)
            check, when = checked(config, backend, reference, model, pool, prompts, quantization)
        except Exception as exc:  # noqa: BLE001 - any failure to build or run means: not this one
            log.warning("auto backend: %s could not start (%s: %s); trying the next", name,
                        type(exc).__name__, exc)
            tried.append(f"{name} failed to start ({type(exc).__name__}: {exc})")
            continue
        if check.ok:
            reason = f"fastest passing backend on {model.device.type}; {why_format}; self-check: {check.describe()}{when}"
            log.info("auto backend: %s (%s)", name, reason)
            return backend, BackendChoice("auto", name, quantization, reason)
        log.warning("auto backend: %s failed the self-check against torch (%s%s); trying the next",
                    name, check.describe(), when)
        tried.append(f"{name} failed the self-check ({check.describe()}{when})")
    reason = "; ".join(tried) if tried else "no faster backend installed for this device (onnxruntime, tensorrt)"
    log.info("auto backend: torch (%s)", reason)
    return reference, BackendChoice("auto", "torch", "none", reason)


def checked(config: EngineConfig, backend: Backend, reference: Backend, model: Any, pool: BlockPool,
            prompts: list[list[int]], quantization: str) -> tuple[SelfCheck, str]:
    """The self-check of `backend`: remembered when this graph, these weights, this check and this
    software on this machine were checked before (check_memo), else run now and remembered.
    Returns (check, "" or "; remembered from <when>")."""
    from edge_runtime.backends.check_memo import check_memo
    from edge_runtime.backends.onnx_export import default_cache_dir
    from edge_runtime.kv.prefix_tier import weights_digest

    settings = {"tokens": SELF_CHECK_TOKENS, "tolerance": SELF_CHECK_TOLERANCE[quantization],
                "near_tie": SELF_CHECK_NEAR_TIE}
    root = Path(config.onnx_cache_dir) if config.onnx_cache_dir else default_cache_dir()
    memo = check_memo(root, backend, model, weights_digest(backend, model), quantization, settings, prompts)
    remembered = memo.recall()
    if remembered is not None:
        try:
            fields, when = remembered
            check = SelfCheck(**fields)
            log.info("auto backend: %s's self-check remembered from %s (%s)", backend.name, when, memo.path)
            return check, f"; remembered from {when}"
        except TypeError as exc:  # another release's fields: check again
            log.warning("ignoring the self-check memo %s: %s", memo.path, exc)
    check = self_check(backend, reference, pool, prompts, quantization)
    memo.remember(asdict(check))
    return check, ""


def self_check(backend: Backend, reference: Backend, pool: BlockPool, prompts: list[list[int]],
               quantization: str, tokens: int = SELF_CHECK_TOKENS) -> SelfCheck:
    """Greedy-decode `tokens` tokens of each prompt through `backend` (a prefill, then decode
    steps: the paths serving takes) and compare with the reference's greedy choice after each
    prefix of that output, and the first step's logits (scratch KV blocks, returned afterwards).
    The reference runs every prefix as one batch of prefills (teacher forcing): one forward,
    and the same verdict as decoding it, since equal choices after every prefix are equal
    greedy outputs."""
    tolerance = SELF_CHECK_TOLERANCE[quantization]
    ours, steps = [], []
    for prompt in prompts:
        got, rows = greedy(backend, pool, prompt, tokens)
        ours.append(got)
        steps.extend(rows)
    prefixes = [prompt + got[:j] for prompt, got in zip(prompts, ours, strict=True) for j in range(tokens)]
    with one_torch_thread():
        logits = prefill_rows(reference, pool, prefixes)
    theirs = [[int(row.argmax()) for row in logits[i * tokens:(i + 1) * tokens]] for i in range(len(prompts))]
    error, agree, near_ties = 0.0, True, 0
    mine = [token for got in ours for token in got]
    for row, (got, want) in enumerate(zip(steps, logits, strict=True)):
        spread = float(want.max() - want.min()) or 1.0
        error = max(error, float((got - want).abs().max()) / spread)
        if int(want.argmax()) != mine[row]:
            tie = float(want.max() - want[mine[row]]) <= SELF_CHECK_NEAR_TIE * spread
            near_ties += tie
            agree = agree and tie
    return SelfCheck(agree and error <= tolerance, ours, theirs, round(error, 5), tolerance, near_ties)


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """One small forward needs no second thread, and on a busy machine OpenMP workers that spin
    while preempted cost it several times its CPU time (measured: 9.8 against 1.1 CPU seconds
    for the self-check's forwards at load average 9 on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def prefill_rows(backend: Backend, pool: BlockPool, prompts: list[list[int]]) -> torch.Tensor:
    """Last-position logits of each prompt, all prefilled in one batch."""
    size = pool.block_size
    needed = sum(-(-len(p) // size) for p in prompts)
    if needed > pool.num_free:
        raise RuntimeError(f"the KV cache has {pool.num_free} free blocks; the self-check needs {needed}")
    tables = [[pool.allocate() for _ in range(-(-len(p) // size))] for p in prompts]
    try:
        items = [ScheduledSeq(ProbeSeq(list(p), 0, t), len(p)) for p, t in zip(prompts, tables, strict=True)]  # type: ignore[arg-type]
        return backend.execute(Batch(items, [])).float().cpu()
    finally:
        for block in (b for t in tables for b in t):
            pool.release(block)


def greedy(backend: Backend, pool: BlockPool, prompt: list[int], tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """`tokens` greedy tokens after `prompt` (prefill, then one decode step each) and each
    step's logits, through `backend.execute` on probe sequences."""
    size = pool.block_size
    blocks = -(-(len(prompt) + tokens) // size)
    if blocks > pool.num_free:
        raise RuntimeError(f"the KV cache has {pool.num_free} free blocks; the self-check needs {blocks}")
    table = [pool.allocate() for _ in range(blocks)]
    seq = ProbeSeq(list(prompt), 0, table)
    out: list[int] = []
    rows: list[torch.Tensor] = []
    try:
        while len(out) < tokens:
            new = seq.num_tokens - seq.num_computed
            logits = backend.execute(Batch([ScheduledSeq(seq, new)], []))[-1].float().cpu()  # type: ignore[arg-type]
            rows.append(logits)
            token = int(logits.argmax())
            out.append(token)
            seq.num_computed = seq.num_tokens
            seq.token_ids.append(token)
    finally:
        for block in table:
            pool.release(block)
    return out, rows
