#!/usr/bin/env python3
"""Real sizes, two ways. Serving mode (`--gguf FILE`): the daemon as a user runs it on a GGUF file
(`maced --model FILE` in a child process) beside llama-cpp-python's server on the same file with
the same threads, in one run. Engine mode (`--shapes`): random bf16 safetensors at real shapes
loaded through the engine in-process, the memory ledger against measured resident memory.

    python tools/make_gguf.py --shapes llama-3.2-1b --mixes q4_k_m      # the file (random weights)
    python tools/bench_scale.py --gguf /tmp/mace-random-gguf/llama-3.2-1b-random-q4_k_m.gguf \
        [--threads 2] [--llama-python /work/llama-venv/bin/python] [--tokens 32] [--repeats 2]

Serving mode starts maced twice (empty state and model cache, then what the first start left;
`finetune.pairs_per_version=1` so one pair publishes a version, `feedback.heldout_fraction=0` so
that pair is not kept back for the guard's evaluation), then llama-cpp-python's server
once. Per server: time to ready (start to the first answered chat request), peak RSS of the whole
process tree starting, serving and (maced) while one DPO pair trains through the SDK (consent, a
two-candidate generate, the user's choice; status until the version is published), completion
tok/s at 1 and 8 greedy streams of the same prompt over the OpenAI API (best of --repeats), the
pair's stage seconds and wall time until published. RSS is the summed VmRSS of the process and
its descendants sampled every 0.1 s, with their VmHWM reset per phase through clear_refs; the
whole /proc/loadavg line is recorded at both ends. Writes
tools/results/bench_scale_gguf_<file stem>.{json,md}. llama-cpp-python[server] is a source build
(see tools/bench_e2e.py); without it the llama column says why it was skipped.

    python tools/bench_scale.py [--shapes llama-3.2-1b,qwen3-1.7b] [--backends torch,onnxruntime-int4]
                                [--tokens 32] [--repeats 2] [--layers N (scaled down, for development)]

Engine mode, per shape: load time, the memory ledger's bytes against measured resident memory
(weights, KV cache, adapters, one DPO pair's training state), decode tokens/s at 1 and 8 streams
(torch and ONNX Runtime int4) and one DPO pair's step time. Each backend of each shape is measured
in a fresh child process (`--measure`), so one run's memory never shows in another's. Resident
memory is read from /proc/self/status: VmHWM (the kernel's peak RSS, reset between phases by
writing 5 to /proc/self/clear_refs) and a sampler thread that keeps the peak of RssAnon every
2 ms (RSS counts the pages of a memory-mapped checkpoint while it is read; RssAnon is the
process's own memory, what the ledger models). The tokenizer is the tiny test model's byte-level
BPE padded with filler tokens to the shape's vocabulary (tools/make_gguf.py), so every id decodes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/make_gguf.py

RESULTS = Path(__file__).resolve().parent / "results"
MiB = 1 << 20
# How llama-cpp-python's server was installed for the comparison (a source build, ~30 min on 2
# busy cores; never part of the project's bootstrap or CI). GGML_NATIVE would turn on AMX where
# /proc/cpuinfo lists it, and a VM that lists AMX without enabling it traps on the first tile
# instruction: the CPU features are named instead, AMX left out. --no-cache-dir: pip's wheel cache
# is keyed by the sdist, not CMAKE_ARGS, and would hand back an earlier build with other flags.
LLAMA_INSTALL = ("python3 -m venv /work/llama-venv && CMAKE_ARGS='-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON "
                 "-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON "
                 "-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON' "
                 "/work/llama-venv/bin/pip install --no-cache-dir 'llama-cpp-python[server]==0.3.36'")

# -- the shapes (tools/make_gguf.py owns the table and the padded tokenizer) ---------------------

from make_gguf import SHAPES, Shape, padded_tokenizer  # noqa: E402

__all__ = ["SHAPES", "Shape", "padded_tokenizer"]


def hf_config(shape: Shape, special_ids: tuple[int, int, int]) -> Any:
    """The transformers config object of `shape` (its own config class, so every field a real
    checkpoint has is there)."""
    from transformers import AutoConfig

    _, bos, eos = special_ids
    return AutoConfig.for_model(
        shape.model_type,
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings, rms_norm_eps=shape.rms_norm_eps,
        rope_parameters=dict(shape.rope_parameters), tie_word_embeddings=shape.tie_word_embeddings,
        hidden_act="silu", bos_token_id=bos, eos_token_id=eos, pad_token_id=eos, dtype="bfloat16",
        **shape.extra,
    )


def build_model_dir(shape: Shape, path: Path, *, seed: int = 0, shard_bytes: int = 1 << 30) -> Path:
    """Write `shape` as a Hugging Face folder: config.json, tokenizer, random bf16 weights in
    safetensors shards (the tensor names and shapes of transformers' own model class, built on
    the meta device; N(0, 0.02) matrices, unit norms). Reuses a complete folder of the same shape."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    path = Path(path)
    stamp = path / "bench_scale.json"
    wanted = {"shape": shape.__dict__, "seed": seed}
    if stamp.exists() and json.loads(stamp.read_text()) == json.loads(json.dumps(wanted)):
        return path
    path.mkdir(parents=True, exist_ok=True)
    for old in path.glob("*.safetensors"):
        old.unlink()
    tokenizer = padded_tokenizer(shape.vocab_size)
    specials = tuple(tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    config = hf_config(shape, specials)  # type: ignore[arg-type]
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = {n: tuple(t.shape) for n, t in skeleton.state_dict().items()}
    if shape.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    gen = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    weight_map: dict[str, str] = {}
    for name, dims in names.items():
        if len(dims) == 1:  # RMSNorm weights
            tensor = torch.ones(dims, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(dims, generator=gen, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    total = len(shards)
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        shard.clear()
    index = {"metadata": {"total_size": sum((path / f).stat().st_size for f in set(weight_map.values()))},
             "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    stamp.write_text(json.dumps(wanted))
    return path


def check_supported(path: Path) -> str | None:
    """None if the engine's config reader accepts the folder, else its error (the forward's
    family support decides; this tool does not work around it)."""
    from edge_runtime.errors import ModelNotAvailable
    from edge_runtime.model.config import ModelConfig

    try:
        ModelConfig.from_dir(path)
    except ModelNotAvailable as exc:
        return str(exc)
    return None


# -- resident memory ----------------------------------------------------------------------------


def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


class PeakSampler:
    """Keeps the peak of RssAnon (sampled every `period_s`) and resets the kernel's VmHWM, so
    each phase has its own peaks."""

    def __init__(self, period_s: float = 0.002) -> None:
        self.period_s = period_s
        self.peak_anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            anon = proc_status()["RssAnon"]
            if anon > self.peak_anon:
                self.peak_anon = anon

    def reset(self) -> dict[str, int]:
        """Start a phase: both peaks restart from now; returns the status at the start."""
        Path("/proc/self/clear_refs").write_text("5")
        now = proc_status()
        self.peak_anon = now["RssAnon"]
        return now

    def peaks(self) -> dict[str, int]:
        now = proc_status()
        return {"hwm": now["VmHWM"], "peak_anon": max(self.peak_anon, now["RssAnon"]), **now}

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


# -- one measured run (a child process) ---------------------------------------------------------


def text_of_tokens(tokenizer: Any, n: int, offset: int = 0) -> str:
    words = ("the user asks and the assistant answers on the device while the model learns what each "
             "user prefers from feedback ").split()
    text, i = "", offset
    while len(tokenizer.hf.encode(text)) < n:
        text += words[i % len(words)] + " "
        i += 1
    return tokenizer.hf.decode(tokenizer.hf.encode(text)[:n])


def decode_rate(engine: Any, streams: int, tokens: int, prompt_tokens: int, repeats: int) -> float:
    """Aggregate decode tokens/s of `streams` greedy streams started together, counted from the
    moment every stream has its first token (prefill excluded); best of `repeats`."""
    from edge_runtime import SamplingParams

    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    best = 0.0
    for r in range(repeats):
        first: dict[str, float] = {}
        for s in range(streams):
            prompt = text_of_tokens(engine.tokenizer, prompt_tokens, offset=7 * s + 31 * r)
            engine.add_request(prompt, params, on_token=lambda e, first=first: first.setdefault(e.request_id, time.perf_counter()))
        while engine.has_unfinished():
            engine.step()
        end = time.perf_counter()
        best = max(best, streams * (tokens - 1) / (end - max(first.values())))
    return best


def ledger_view(engine: Any) -> dict[str, int]:
    from edge_runtime.memory import MemoryKind

    snap = engine.ledger.snapshot()
    snap["weights_model_bytes"] = engine.ledger.entries(MemoryKind.WEIGHTS).get("model", 0)
    snap["weights_backend_bytes"] = engine.ledger.entries(MemoryKind.WEIGHTS).get("backend", 0)
    return snap


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Load one model on one backend and measure every phase; runs in a fresh process."""
    import torch

    from edge_runtime import Engine
    from edge_runtime.config import EngineConfig
    from edge_runtime.device import pick_device, pick_dtype
    from edge_runtime.lora.config import LoraSettings
    from edge_runtime.lora.weights import LoraWeights
    from edge_runtime.memory import MemoryKind
    from edge_runtime.model.tokenizer import Tokenizer
    from edge_runtime.model.weights import load_llama
    from edge_runtime.train.pairs import PreferenceRecord
    from edge_runtime.train.trainer import AdapterTrainer

    if spec.get("export_only"):
        return export_graphs(spec)
    if spec.get("dpo_copies"):
        return dpo_copies(spec)
    path = Path(spec["model_dir"])
    config = EngineConfig(
        model=str(path), dtype=spec["dtype"], backend=spec["backend"], onnx_quantization=spec["quantization"],
        onnx_cache_dir=spec["onnx_cache_dir"], num_threads=spec["threads"], kv_cache_bytes=spec["kv_cache_bytes"],
        cost_cache_dir=spec["cost_cache_dir"], max_num_seqs=max(8, max(spec["streams"])),
        finetune_memory_bytes=spec["finetune_bytes"],
    )
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    sampler = PeakSampler()
    out: dict[str, Any] = {"phases": {}}
    phases = out["phases"]

    def phase(name: str, start: dict[str, int], **extra: Any) -> dict[str, Any]:
        peaks = sampler.peaks()
        phases[name] = {"rss_start": start["VmRSS"], "anon_start": start["RssAnon"], "hwm": peaks["hwm"],
                        "peak_anon": peaks["peak_anon"], "rss_end": peaks["VmRSS"], "anon_end": peaks["RssAnon"],
                        "file_end": peaks["RssFile"], **extra}
        log(f"{name}: done, peak RssAnon {peaks['peak_anon'] / MiB:.0f} MiB, VmHWM {peaks['hwm'] / MiB:.0f} MiB")
        return phases[name]

    # Engine.load's two steps, timed and measured apart: the weights, then the engine around them
    # (KV slab, adapter registry, backend with its graph, the forward's cost model).
    baseline = sampler.reset()
    out["baseline"] = baseline
    t0 = time.perf_counter()
    device = pick_device(config.device)
    model = load_llama(path, dtype=pick_dtype(config.dtype, device), device=device)
    t_weights = time.perf_counter() - t0
    phase("load_weights", baseline, seconds=round(t_weights, 3))
    start = sampler.reset()
    t0 = time.perf_counter()
    engine = Engine(model, Tokenizer(path), config, name=path.name)
    t_engine = time.perf_counter() - t0
    phase("build_engine", start, seconds=round(t_engine, 3), cost_model=engine.costs.source,
          kv_cache_bytes=engine.cache.nbytes, ledger=ledger_view(engine))
    out["load_s"] = round(t_weights + t_engine, 3)
    out["backend_name"] = engine.backend.name
    out["max_context"] = engine.max_context

    # Decode: base model, then one stream with an adapter (the adapters entry).
    start = sampler.reset()
    engine.ledger.peak_used = engine.ledger.used
    rates = {}
    for n in spec["streams"]:
        rates[str(n)] = round(decode_rate(engine, n, spec["tokens"], spec["prompt_tokens"], spec["repeats"]), 3)
    phase("decode", start, ledger=ledger_view(engine), ledger_peak_used=engine.ledger.peak_used)
    out["decode_tok_s"] = rates

    start = sampler.reset()
    engine.ledger.peak_used = engine.ledger.used
    lora = LoraWeights.init(model.cfg, LoraSettings(), seed=1)
    for b in lora.b.values():
        b.normal_(0.0, 0.01)
    engine.publish_adapter("scale-user", lora)
    from edge_runtime import SamplingParams

    engine.add_request(text_of_tokens(engine.tokenizer, spec["prompt_tokens"]), SamplingParams(
        max_tokens=spec["tokens"], ignore_eos=True), adapter="scale-user")
    while engine.has_unfinished():
        engine.step()
    engine.ledger.set(MemoryKind.ADAPTERS, "cache", engine.adapters.cache.nbytes)
    phase("adapter", start, ledger=ledger_view(engine), ledger_peak_used=engine.ledger.peak_used,
          adapter_bytes=engine.adapters.cache.nbytes)

    # One DPO pair through the scheduler (the ledger's optimizer and activation entries), as the
    # daemon runs it: profiled stage costs, staged task, default DPO settings.
    if spec["dpo"]:
        t0 = time.perf_counter()
        costs = engine.stage_costs()
        out["stage_costs_s"] = round(time.perf_counter() - t0, 3)
        start = sampler.reset()
        engine.ledger.peak_used = engine.ledger.used
        trainer = AdapterTrainer(engine.model, engine.tokenizer, costs=costs)
        n = spec["dpo_tokens"]
        pair = PreferenceRecord(text_of_tokens(engine.tokenizer, n), text_of_tokens(engine.tokenizer, n, offset=3),
                                text_of_tokens(engine.tokenizer, n, offset=11), pair_id="scale")
        task = trainer.task(pair, score=False)
        peak_held: dict[str, int] = {}
        t0 = time.perf_counter()
        engine.add_finetune(task, user="scale-user")
        log(f"dpo pair: {task.tokens.num_rows} rows, {len(task.stages)} stages")
        queue, idle = engine.scheduler.finetune, 0
        while engine.has_unfinished():
            ran = queue.stages_run
            engine.step()
            for kind in (MemoryKind.ACTIVATIONS, MemoryKind.OPTIMIZER):
                peak_held[kind.value] = max(peak_held.get(kind.value, 0), engine.ledger.held(kind))
            idle = 0 if queue.stages_run > ran else idle + 1
            if idle >= 1000:  # the scheduler finds no room for the next stage: it would wait forever
                stage = task.next_stage()
                raise RuntimeError(f"the DPO pair's stage {stage.name if stage else '?'} was never scheduled: "
                                   f"{engine.ledger.free / MiB:.0f} MiB free in the ledger; raise --finetune-mib")
        wall = time.perf_counter() - t0
        job = queue.finished[-1]
        phase("dpo_pair", start, ledger=ledger_view(engine), ledger_peak_used=engine.ledger.peak_used,
              ledger_peak_held=peak_held, wall_s=round(wall, 3), stage_s=round(job.seconds, 3),
              stage_s_by_kind={k: round(v, 3) for k, v in task.seconds_by_kind().items()},
              rows=task.tokens.num_rows, error=job.error, trainer_persistent_bytes=trainer.persistent_bytes)
    sampler.close()
    return out


def export_graphs(spec: dict[str, Any]) -> dict[str, Any]:
    """Export (and cache) both ONNX step graphs, with and without LoRA inputs, so the measured
    run opens cached graphs: an export's transient memory is a one-time cost, reported apart."""
    from dataclasses import replace

    import torch

    from edge_runtime import Engine
    from edge_runtime.backends.onnx_export import export_step

    sampler = PeakSampler()
    start = sampler.reset()
    t0 = time.perf_counter()
    engine = Engine.load(spec["model_dir"], dtype=spec["dtype"], backend="onnxruntime",
                         onnx_quantization=spec["quantization"], onnx_cache_dir=spec["onnx_cache_dir"],
                         kv_cache_bytes=spec["kv_cache_bytes"], cost_profile="off",
                         num_threads=spec["threads"] or torch.get_num_threads())
    export_step(engine.model, replace(engine.backend.spec, lora=True), spec["onnx_cache_dir"])
    peaks = sampler.peaks()
    sampler.close()
    return {"export_s": round(time.perf_counter() - t0, 1), "peak_anon_mib": round(peaks["peak_anon"] / MiB, 1),
            "anon_start_mib": round(start["RssAnon"] / MiB, 1), "hwm_mib": round(peaks["hwm"] / MiB, 1)}


# -- the parent: build, measure in children, report ---------------------------------------------


BACKENDS = {"torch": ("torch", "none"), "onnxruntime-int4": ("onnxruntime", "int4")}


def run_child(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("r", suffix=".json") as result:
        spec = {**spec, "result_file": result.name}
        proc = subprocess.run([sys.executable, __file__, "--measure", json.dumps(spec)], timeout=timeout_s,
                              stdout=subprocess.PIPE, text=True)  # its progress log goes to our stderr
        if proc.returncode != 0:
            return {"error": f"the measuring process exited with status {proc.returncode} (its log is above)"}
        return json.loads(Path(result.name).read_text())


def summarise(run: dict[str, Any]) -> dict[str, Any]:
    """Ledger bytes against measured resident bytes, per entry and for the whole engine."""
    p = run["phases"]
    base_anon = run["baseline"]["RssAnon"]
    built = p["build_engine"]["ledger"]
    rows = {}
    # Weights: the model's tensors, read from the checkpoint (RssAnon grows by them).
    rows["weights"] = (built["weights_model_bytes"], p["load_weights"]["anon_end"] - p["load_weights"]["anon_start"])
    # The engine around them: KV slab, backend graphs, registry, cost-model calibration leftovers.
    rows["engine build (KV slab, backend)"] = (
        built["weights_backend_bytes"] + built["kv_bytes"] + built["prefix_cache_bytes"] + built["adapters_bytes"],
        p["build_engine"]["anon_end"] - p["build_engine"]["anon_start"])
    rows["decode peak (KV in use + forward)"] = (
        p["decode"]["ledger_peak_used"] - built["held_bytes"], p["decode"]["peak_anon"] - p["decode"]["anon_start"])
    # (with ONNX Runtime the first adapter row opens the LoRA graph: the backend's weight entry)
    after = p["adapter"]["ledger"]
    rows["adapters (+ LoRA graph)"] = (
        after["adapters_bytes"] + after["weights_backend_bytes"] - built["adapters_bytes"] - built["weights_backend_bytes"],
        p["adapter"]["anon_end"] - p["adapter"]["anon_start"])
    if "dpo_pair" in p:
        d = p["dpo_pair"]
        rows["one DPO pair (optimizer + activations, peak)"] = (
            d["ledger_peak_used"] - p["adapter"]["ledger"]["held_bytes"], d["peak_anon"] - d["anon_start"])
    # The bar: from the engine's construction on (the ledger exists), its peak against the
    # process's peak anonymous memory above the baseline before the model was read.
    live = [ph for name, ph in p.items() if name != "load_weights"]
    ledger_peak = max([built["held_bytes"]] + [ph.get("ledger_peak_used", 0) for ph in live])
    engine_peak = max(ph["peak_anon"] for ph in live) - base_anon
    load = p["load_weights"]
    return {
        "entries": {k: {"ledger_mib": round(a / MiB, 1), "measured_mib": round(b / MiB, 1),
                        "ratio": round(a / b, 3) if b > 0 else None} for k, (a, b) in rows.items()},
        "ledger_peak_mib": round(ledger_peak / MiB, 1),
        "measured_engine_peak_anon_mib": round(engine_peak / MiB, 1),
        "ratio": round(ledger_peak / engine_peak, 3) if engine_peak > 0 else None,
        "process_baseline_anon_mib": round(base_anon / MiB, 1),
        "process_peak_rss_mib": round(max(ph["hwm"] for ph in p.values()) / MiB, 1),
        # While the weights are read (before the engine and its ledger exist): the loader's
        # per-tensor copies above the loaded weights, and VmHWM with the mapped checkpoint pages.
        "load_transient_anon_mib": round((load["peak_anon"] - load["anon_end"]) / MiB, 1),
        "load_peak_rss_mib": round(load["hwm"] / MiB, 1),
    }


def machine() -> dict[str, Any]:
    import platform

    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "")
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}


def write_table(result: dict[str, Any], path: Path) -> None:
    m = result["machine"]
    lines = [
        f"Random-weight models at real shapes, {result['dtype']}, {m['cores']} cores ({m['cpu']}), shared "
        f"(load average {result['load_average_at_start']:.1f} at start). {result['tokens']} tokens per stream, best "
        f"of {result['repeats']}; one DPO pair of {result['dpo_tokens']}-token prompt and completions. Command: "
        f"`{result['command']}`",
        "",
        "| shape | backend | load (s) | decode tok/s, 1 stream | decode tok/s, 8 streams | DPO pair step (s) "
        "| ledger peak (MiB) | measured engine peak (MiB) | ledger/measured | load transient (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape in result["shapes"]:
        if "unsupported" in shape:
            lines.append(f"| {shape['shape']} | all | unsupported: {shape['unsupported']} | | | | | | | |")
            continue
        for run in shape["runs"]:
            if "error" in run:
                lines.append(f"| {shape['shape']} | {run['backend']} | failed: {run['error'][:300]} | | | | | | | |")
                continue
            s, rates = run["summary"], run["decode_tok_s"]
            dpo = run["phases"].get("dpo_pair", {}).get("stage_s", "n/a")
            lines.append(f"| {shape['shape']} | {run['backend']} | {run['load_s']} | {rates.get('1')} | {rates.get('8')} | "
                         f"{dpo} | {s['ledger_peak_mib']} | {s['measured_engine_peak_anon_mib']} | {s['ratio']} | "
                         f"{s['load_transient_anon_mib']} |")
    for shape in result["shapes"]:
        for backend, exp in shape.get("exports", {}).items():
            if "error" in exp:
                lines += ["", f"{shape['shape']} / {backend} export failed: {exp['error']}"]
            else:
                lines += ["", f"{shape['shape']} / {backend}: exporting both step graphs took {exp['export_s']} s, peak "
                          f"RssAnon {exp['peak_anon_mib']} MiB (from {exp['anon_start_mib']} MiB), once per model "
                          "(cached; the measured run opens the cached graphs)."]
    lines += ["", "Ledger peak: the most it held (plus reservations) from the engine's construction on; measured "
              "engine peak: the process's peak RssAnon over the same phases above its RssAnon before the model "
              "was read. Load transient: RssAnon above the loaded weights while they were read (no ledger yet).",
              "", "Per ledger entry (MiB; measured = growth of the process's anonymous resident memory over "
              "the phase, peak where it says so; freed memory the allocator reuses hides growth here):", "",
              "| shape | backend | entry | ledger | measured | ledger/measured |", "|---|---|---|---|---|---|"]
    for shape in result["shapes"]:
        for run in shape.get("runs", []):
            for entry, row in run.get("summary", {}).get("entries", {}).items():
                lines.append(f"| {shape['shape']} | {run['backend']} | {entry} | {row['ledger_mib']} | "
                             f"{row['measured_mib']} | {row['ratio']} |")
    path.write_text("\n".join(lines) + "\n")


# -- the daemon as a user runs it, beside llama.cpp's server (--gguf) ---------------------------


def tree_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM and RssAnon summed over a process and all its descendants, in bytes (pages
    two of them share count twice: an upper bound, as a user's `ps` would add them)."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    total = {"VmRSS": 0, "VmHWM": 0, "RssAnon": 0}
    for proc in procs:
        try:
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in total:
                    total[key] += int(value.split()[0]) * 1024
        except OSError:
            pass  # ended between the listing and the read
    return total


def reset_tree_peaks(pid: int) -> None:
    """Restart the kernel's peak RSS (VmHWM) of the process tree from now (5 to clear_refs)."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            Path(f"/proc/{proc.pid}/clear_refs").write_text("5")
        except OSError:
            pass


class TreeSampler:
    """Samples the summed RSS of a server's process tree every `period_s` and keeps the peak per
    phase; a phase also reads the summed VmHWM (reset at its start), which sees spikes between
    samples."""

    def __init__(self, period_s: float = 0.1) -> None:
        self.period_s, self.pid, self.peak = period_s, 0, 0
        self._lock = threading.Lock()  # a sample of the last phase must not land in the next one
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with self._lock:
                if self.pid:
                    self.peak = max(self.peak, tree_status(self.pid).get("VmRSS", 0))

    def start_phase(self, pid: int) -> None:
        with self._lock:
            self.pid = pid
            reset_tree_peaks(pid)
            self.peak = tree_status(pid).get("VmRSS", 0)

    def end_phase(self) -> dict[str, float]:
        now = tree_status(self.pid) if self.pid else {}
        peak = max(self.peak, now.get("VmRSS", 0))
        return {"peak_rss_mib": round(peak / MiB, 1), "peak_hwm_mib": round(now.get("VmHWM", 0) / MiB, 1),
                "rss_end_mib": round(now.get("VmRSS", 0) / MiB, 1),
                "anon_end_mib": round(now.get("RssAnon", 0) / MiB, 1)}

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


async def _stream_one(server: Any, prompt: str, max_tokens: int) -> dict[str, Any]:
    from openai import AsyncOpenAI

    extra = {"ignore_eos": True} if server.name == "maced" else {}
    async with AsyncOpenAI(base_url=server.base_url, api_key="bench", max_retries=0, timeout=1800) as client:
        t0 = time.perf_counter()
        first, tokens, chunks = None, None, 0
        stream = await client.chat.completions.create(
            model=server.model_id, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True}, extra_body=extra)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                chunks += 1
                first = first if first is not None else time.perf_counter() - t0
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return {"ttft_s": first, "tokens": tokens if tokens is not None else chunks}


def decode_streams(server: Any, streams: int, prompt: str, max_tokens: int, repeats: int) -> dict[str, Any]:
    """`streams` greedy streams of the same prompt started together over the OpenAI API: completion
    tokens over the wall time of all of them (what a user sees; a short prompt's prefill
    included), best of `repeats`."""
    import asyncio

    async def together() -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(_stream_one(server, prompt, max_tokens) for _ in range(streams))))

    best: dict[str, Any] = {}
    for _ in range(repeats):
        t0 = time.perf_counter()
        got = asyncio.run(together())
        wall = time.perf_counter() - t0
        tokens = sum(g["tokens"] for g in got)
        row = {"tok_s": round(tokens / wall, 2), "tokens": tokens, "wall_s": round(wall, 2),
               "ttft_max_s": round(max(g["ttft_s"] or 0.0 for g in got), 2)}
        if not best or row["tok_s"] > best["tok_s"]:
            best = row
    return best


def train_one_pair(socket: Path, prompt: str, tokens: int, sampler: TreeSampler, pid: int,
                   timeout_s: float) -> dict[str, Any]:
    """One user's DPO pair through the SDK as an app sends it (consent, a two-candidate generate,
    the user's choice; an edit where the two came out the same), then the daemon's status until
    the pair is trained and its adapter version published (or refused by the guard)."""
    from daemon.sdk import Client

    with Client(f"ipc://{socket}", timeout_s=timeout_s) as c:
        c.consent("bench")
        reply = c.generate(prompt, max_tokens=tokens, n=2, temperature=1.0, seed=1, user="bench",
                           ignore_eos=True)
        before = c.status()["finetune"]
        sampler.start_phase(pid)
        t0 = time.monotonic()
        if reply.candidates[0].text != reply.candidates[1].text:
            c.choose("bench", reply.interaction_id, 1)
            feedback = "choice"
        else:
            c.edit("bench", reply.interaction_id, reply.candidates[0].text + " Thanks, that helps.")
            feedback = "edit"
        while True:
            ft = c.status()["finetune"]
            decided = (ft["versions_published"] + ft["versions_rejected"]
                       > before["versions_published"] + before["versions_rejected"])
            if ft["errors"] > before["errors"]:
                outcome = "error"
                break
            if ft["pairs_trained"] > before["pairs_trained"] and decided and ft["state"] == "idle":
                outcome = "published" if ft["versions_published"] > before["versions_published"] else "rejected"
                break
            if time.monotonic() - t0 > timeout_s:
                outcome = "timeout"
                break
            time.sleep(0.5)
        wall = time.monotonic() - t0
    return {"feedback": feedback, "outcome": outcome, "wall_s": round(wall, 1),
            "stage_s": round(ft["finetune_seconds"] - before["finetune_seconds"], 2),
            "stages_run": ft["stages_run"] - before["stages_run"], "last_loss": ft["last_loss"],
            "finetune_state": ft.get("state"),
            **sampler.end_phase()}


def daemon_log_phases(text: str) -> dict[str, float | None]:
    """Seconds of the start-up phases the daemon's log names (ready, export, calibration)."""
    import re

    from bench_ready import PHASES

    out: dict[str, float | None] = {}
    for name, pattern in PHASES.items():
        found = re.findall(pattern, text)
        out[name] = round(sum(float(x) for x in found), 2) if found else None
    return out


def start_measured(name: str, server: Any, sampler: TreeSampler, args: argparse.Namespace,
                   starts: int) -> dict[str, Any]:
    """Start `server` `starts` times (the first on empty state and cache, the rest on what the
    first left), each start's peak RSS measured; the last start is left running."""
    out: dict[str, Any] = {"starts": []}
    for i in range(starts):
        log(f"{name}: start {i + 1} of {starts} ...")
        load = os.getloadavg()
        server.proc = None
        failure: list[BaseException] = []

        def start(failure: list[BaseException] = failure) -> None:
            try:
                server.start(args.timeout_s)
            except BaseException as exc:  # noqa: BLE001 - SystemExit from a server that died; reported
                failure.append(exc)

        thread = threading.Thread(target=start, daemon=True)
        thread.start()
        while server.proc is None and thread.is_alive():
            time.sleep(0.01)
        if server.proc is not None:
            sampler.start_phase(server.proc.pid)
        thread.join()
        if failure:
            server.stop()
            out["error"] = f"start {i + 1} failed: {failure[0]}"[-3000:]
            log(f"{name}: {out['error']}")
            return out
        row = {"ready_s": server.ready_s, "loadavg": load, **sampler.end_phase()}
        if name == "maced":
            row["background_calibration_wait_s"] = wait_background_calibration(server, args.calibration_wait_s)
            row["log_phases"] = daemon_log_phases(server.log.read_text(errors="replace"))
        out["starts"].append(row)
        log(f"{name}: ready in {server.ready_s} s, peak RSS {row['peak_rss_mib']} MiB")
        if i + 1 < starts:
            server.stop()
    return out


def wait_background_calibration(server: Any, timeout_s: float) -> float | None:
    """Seconds from ready until maced's background cost calibration finished (None when this
    start ran none: its log shows no quick calibration, so a cached one was loaded). It runs
    whenever the engine is idle, so without this wait it would compete with the other server's
    start and runs; and a daemon stopped before it finishes runs the quick one again at its next
    start (it caches only the full one)."""
    done = ("calibrated the forward cost model in the background", "background cost calibration failed")
    if "quick forward cost calibration" not in server.log.read_text(errors="replace"):
        return None
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s and server.proc.poll() is None:
        if any(d in server.log.read_text(errors="replace") for d in done):
            break
        time.sleep(1.0)
    return round(time.monotonic() - t0, 1)


def serve_interleaved(running: dict[str, tuple[Any, TreeSampler, dict[str, Any]]],
                      args: argparse.Namespace) -> None:
    """Decode on every running server, round-robin: for each repeat and stream count, one timed
    run per server in turn, so a busy machine's load falls on all of them alike. Keeps each
    server's best per stream count and every run (`decode_runs`); each server's serving peak
    covers the whole interleaved phase (an idle server's RSS does not move)."""
    for server, sampler, out in running.values():
        sampler.start_phase(server.proc.pid)
        decode_streams(server, 1, args.prompt, 8, 1)  # a first request, not timed
        out["decode"], out["decode_runs"] = {}, []
    for r in range(args.repeats):
        for streams in args.streams:
            for name, (server, _, out) in list(running.items()):
                if name == "llama" and args.llama_streams is not None and streams not in args.llama_streams:
                    continue
                try:
                    row = decode_streams(server, streams, args.prompt, args.tokens, 1)
                except Exception as exc:  # noqa: BLE001 - one server's failure is a result, the others go on
                    out["error"] = f"{type(exc).__name__}: {exc}"
                    log(f"{name}: {out['error']}")
                    running.pop(name)
                    continue
                out["decode_runs"].append({"repeat": r, "streams": streams, **row})
                best = out["decode"].get(str(streams))
                if best is None or row["tok_s"] > best["tok_s"]:
                    out["decode"][str(streams)] = row
                log(f"{name}: {streams} stream(s), repeat {r + 1}: {row}")
    for _, (_, sampler, out) in running.items():
        out["serving"] = sampler.end_phase()


def run_gguf(args: argparse.Namespace) -> dict[str, Any]:
    """maced and llama-cpp-python's server on one GGUF file, same threads: maced's starts, then
    llama's start beside it, then both decoding interleaved, then maced's DPO pair, then (with
    --dpo-copies) one pair timed on the blocks and on a float copy, interleaved."""
    from bench_e2e import check_llama, llama_system_info
    from gguf import GGUFReader

    gguf_path = Path(args.gguf).resolve()
    reader = GGUFReader(str(gguf_path))
    tensor_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    file_type = int(reader.fields["general.file_type"].contents()) if "general.file_type" in reader.fields else None
    del reader
    threads = args.threads or os.cpu_count() or 1
    work = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MACE_")}
    # Empty for the first start; --warm-cache: a cache an earlier first start built (one start).
    cache = Path(args.warm_cache).resolve() if args.warm_cache else work / "cache"
    env.update(PYTHONUNBUFFERED="1", MACE_CACHE_DIR=str(cache))
    if args.warm_costs:  # the cost calibration an earlier run's daemon finished (its state's costs/)
        shutil.copytree(args.warm_costs, work / "state" / "costs")
    result: dict[str, Any] = {
        "command": " ".join(["python tools/bench_scale.py", *args.argv]), "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gguf": gguf_path.name, "gguf_mib": round(gguf_path.stat().st_size / MiB, 1),
        "tensor_mib": round(tensor_bytes / MiB, 1), "file_type": file_type, "threads": threads,
        "tokens": args.tokens, "repeats": args.repeats, "dpo_tokens": args.dpo_tokens, "prompt": args.prompt,
        "maced_settings": args.set, "loadavg_start": Path("/proc/loadavg").read_text().strip(),
        "warm_cache": bool(args.warm_cache), "warm_costs": bool(args.warm_costs), "interleaved": True,
        "memory_method": "summed VmRSS of the server and its descendants sampled every 0.1 s (peak per "
                         "phase), and their summed VmHWM reset at each phase's start via clear_refs",
    }
    servers: dict[str, tuple[Any, TreeSampler, dict[str, Any]]] = {}
    socket = work / "maced.sock"
    try:
        if "maced" in args.servers:
            maced, socket = maced_server(args, gguf_path, threads, work, env)
            sampler = TreeSampler()
            result["maced"] = start_measured("maced", maced, sampler, args, 1 if args.warm_cache else 2)
            servers["maced"] = (maced, sampler, result["maced"])
        if "llama" not in args.servers:
            result["llama"] = {"skipped": "not asked for (--servers)"}
        elif (version := check_llama(args.llama_python) if args.llama_python else None) is None:
            result["llama"] = {"skipped": f"llama_cpp.server is not importable by {args.llama_python!r}: "
                                          f"install it with `{LLAMA_INSTALL}` and pass --llama-python"}
        else:
            llama = llama_server(args, gguf_path, threads, work, env)
            sampler = TreeSampler()
            result["llama"] = start_measured("llama", llama, sampler, args, 1)
            result["llama"].update(version=version, system_info=llama_system_info(args.llama_python))
            servers["llama"] = (llama, sampler, result["llama"])
        running = {k: v for k, v in servers.items() if "error" not in v[2]}
        serve_interleaved(running, args)
        if "llama" in servers:
            servers["llama"][0].stop()  # the pair is maced's alone: llama's memory and threads leave
        if "maced" in running:
            maced_train(servers["maced"], args, socket)
        if args.dpo_copies and "maced" in servers:
            log("one DPO pair on the blocks against a float copy, interleaved (in-process) ...")
            servers["maced"][0].stop()
            spec = {"dpo_copies": True, "gguf": str(gguf_path), "threads": threads, "dpo_tokens": args.dpo_tokens,
                    "prompt": args.prompt, "rounds": args.dpo_copies, "cache_dir": str(cache),
                    "budget_s": args.dpo_copies_budget_s, "settings": args.set}
            result["dpo_copies"] = run_child(spec, args.timeout_s)
            log(f"dpo copies: {result['dpo_copies']}")
    finally:
        for name, (server, sampler, out) in servers.items():
            server.stop()
            sampler.close()
            text = server.log.read_text(errors="replace") if server.log.exists() else ""
            if "error" in out or name == "maced":
                out["log_tail"] = text[-4000:]
            if name == "maced":  # what it said about its backend and its fine-tuning, from the whole log
                out["log_said"] = [line.split(" ", 3)[-1][:600] for line in text.splitlines()
                                   if any(k in line for k in SAID)]
        shutil.rmtree(work, ignore_errors=True)
    result["loadavg_end"] = Path("/proc/loadavg").read_text().strip()
    result["bar"] = bar_ratios(result)
    return result


def maced_server(args: argparse.Namespace, gguf_path: Path, threads: int, work: Path,
                 env: dict[str, str]) -> tuple[Any, Path]:
    """`maced --model FILE` as a user starts it: defaults, but the threads and one pair per
    adapter version."""
    from bench_e2e import Server, free_port

    port = free_port()
    socket = work / "maced.sock"
    cmd = [sys.executable, "-m", "daemon.main", "--model", str(gguf_path), "--state-dir", str(work / "state"),
           "--ipc", str(socket), "--http", f"127.0.0.1:{port}", "--log-format", "text",
           "--set", f"engine.num_threads={threads}", "--set", "finetune.pairs_per_version=1",
           "--set", "feedback.heldout_fraction=0.0"]
    for item in args.set:
        cmd += ["--set", item]
    return Server("maced", cmd, port, work / "maced.log", env), socket


def llama_server(args: argparse.Namespace, gguf_path: Path, threads: int, work: Path, env: dict[str, str]) -> Any:
    from bench_e2e import Server, free_port

    port = free_port()
    return Server("llama", [args.llama_python, "-m", "llama_cpp.server", "--model", str(gguf_path),
                            "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(threads),
                            "--n_threads_batch", str(threads), "--n_ctx", str(args.n_ctx),
                            "--interrupt_requests", "False"], port, work / "llama.log", env)


def maced_train(entry: tuple[Any, TreeSampler, dict[str, Any]], args: argparse.Namespace, socket: Path) -> None:
    """maced's DPO pair through the SDK (peak RSS while it trains), then its whole-life VmHWM."""
    server, sampler, out = entry
    try:
        pid = server.proc.pid
        if args.dpo:
            log("maced: one DPO pair ...")
            out["dpo_pair"] = train_one_pair(socket, args.prompt, args.dpo_tokens, sampler, pid, args.dpo_timeout_s)
            log(f"maced: {out['dpo_pair']}")
        out["whole_life_hwm_mib"] = round(tree_status(pid).get("VmHWM", 0) / MiB, 1)
    except Exception as exc:  # noqa: BLE001 - a failed pair is a result
        out["error"] = f"{type(exc).__name__}: {exc}"
        log(f"maced: {out['error']}")


def mem_available() -> int:
    """MemAvailable of /proc/meminfo, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def time_pair(model: Any, tokenizer: Any, prompt: str, n: int, r: int) -> dict[str, Any]:
    """Round `r`'s DPO pair (a prompt, two `n`-token answers) trained once by a fresh trainer on
    `model`, as a first pair is (its reference log-probs computed): wall and CPU seconds of every
    thread (on a shared machine the wall time follows the other tenants, the CPU time much
    less), its loss and its seconds by stage kind."""
    from edge_runtime.train.pairs import PreferenceRecord
    from edge_runtime.train.trainer import AdapterTrainer

    pair = PreferenceRecord(({"role": "user", "content": prompt},), text_of_tokens(tokenizer, n, offset=3 + r),
                            text_of_tokens(tokenizer, n, offset=11 + r), pair_id=f"copies-{r}")
    trainer = AdapterTrainer(model, tokenizer)
    t0, c0 = time.perf_counter(), time.process_time()
    task = trainer.task(pair, score=False)
    result = task.run()
    return {"s": round(time.perf_counter() - t0, 3), "cpu_s": round(time.process_time() - c0, 2),
            "loss": round(float(result.loss), 4),
            "stages_s": {k: round(v, 2) for k, v in task.seconds_by_kind().items()}}


def dpo_copies(spec: dict[str, Any]) -> dict[str, Any]:
    """One DPO pair's staged update timed on the file's quantised blocks (one copy: what serves
    is what trains, de-quantised a layer at a time) and on a float copy de-quantised from them
    (the two-copy design), alternating `rounds` times in this one process; a fresh trainer per
    run, so each computes its reference log-probs as a first pair does. The model is the one
    the daemon built (its block cache, found through the same model cache)."""
    import torch

    from edge_runtime.config import EngineConfig
    from edge_runtime.loading import reads_in_place, resolve
    from edge_runtime.model.gguf_load import dequantized_copy
    from edge_runtime.model.qweights import QuantWeight
    from edge_runtime.model.tokenizer import Tokenizer
    from edge_runtime.model.weights import load_llama

    os.environ["MACE_CACHE_DIR"] = spec["cache_dir"]
    torch.set_num_threads(spec["threads"])
    # The copy the daemon trains on: the file's own blocks where it reads them in place (the model
    # cache then holds no blocks of its own), else the block cache it built.
    chosen = dict(item.split("=", 1) for item in spec.get("settings") or [])
    config = EngineConfig(model=spec["gguf"], device="cpu", backend=chosen.get("engine.backend", "auto"),
                          torch_weights=chosen.get("engine.torch_weights", "auto"))
    path, _ = resolve(spec["gguf"], in_place=reads_in_place(config))
    sampler = PeakSampler()
    sampler.reset()
    blocks = load_llama(path, dtype=torch.float32)
    tokenizer = Tokenizer(path)
    # The machine is shared: a float copy that would not fit what is available now is waited
    # for (up to `wait_s`), then skipped with the figures, never left to the OOM killer.
    need = 4 * sum(m.shape.numel() for m in blocks.modules() if isinstance(m, QuantWeight)) + (1 << 30)
    t0 = time.monotonic()
    while (available := mem_available()) < need:
        if time.monotonic() - t0 > spec.get("wait_s", 300):
            return {"error": f"skipped: a float32 copy needs {need / MiB:.0f} MiB with 1 GiB to spare and the "
                             f"machine has {available / MiB:.0f} MiB available (shared; waited "
                             f"{time.monotonic() - t0:.0f} s)", "loadavg": Path("/proc/loadavg").read_text().strip()}
        time.sleep(5)
    floats = dequantized_copy(blocks)
    both_peak = sampler.peaks()["hwm"]
    n = spec["dpo_tokens"]

    runs: dict[str, list[dict[str, float]]] = {"blocks": [], "float": []}
    started = time.monotonic()
    for r in range(spec["rounds"]):
        # A round that would end past the budget is not begun (a pair takes minutes on a busy
        # machine); the first always runs.
        if r and (time.monotonic() - started) * (r + 1) / r > spec.get("budget_s", 600):
            log(f"dpo copies: round {r + 1} would pass the {spec.get('budget_s', 600)} s budget: stopping")
            break
        for name, model in (("blocks", blocks), ("float", floats)):
            runs[name].append(time_pair(model, tokenizer, spec["prompt"], n, r))
            log(f"dpo copies: {name} round {r + 1}: {runs[name][-1]}")
    best = {k: min(x["s"] for x in v) for k, v in runs.items()}
    return {"runs": runs, "rounds_run": len(runs["float"]), "best_s": best, "blocks_over_float": round(best["blocks"] / best["float"], 3),
            "dtype": "float32", "both_copies_peak_rss_mib": round(both_peak / MiB, 1),
            "loadavg": Path("/proc/loadavg").read_text().strip()}


# The lines of maced's log the table quotes: its backend choice and fine-tuning failures.
SAID = ("auto backend: ", "failed: ", "cannot run: ")


def bar_ratios(result: dict[str, Any]) -> dict[str, Any]:
    """The bar's ratios (#28, 1B and 3B): maced's peak RSS training one pair over llama-server's
    peak serving; maced's tok/s over llama-server's at 1 and 8 streams; the pair on the blocks
    over the two-copy time."""
    def get(*keys: str) -> float | None:
        value: Any = result
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value if isinstance(value, (int, float)) else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    out = {
        "train_peak_over_llama_serving": ratio(get("maced", "dpo_pair", "peak_rss_mib"),
                                               get("llama", "serving", "peak_rss_mib")),
        "tok_s_1_over_llama": ratio(get("maced", "decode", "1", "tok_s"), get("llama", "decode", "1", "tok_s")),
        "tok_s_8_over_llama": ratio(get("maced", "decode", "8", "tok_s"), get("llama", "decode", "8", "tok_s")),
        "dpo_blocks_over_two_copy": get("dpo_copies", "blocks_over_float"),
    }
    if out["tok_s_8_over_llama"] is None and get("llama", "decode", "1", "tok_s"):
        # --llama-streams 1: llama-server answers one request at a time, so its 8 streams would
        # run one after another at about its 1-stream rate; the ratio says which it divides by.
        out["tok_s_8_over_llama_1_stream"] = ratio(get("maced", "decode", "8", "tok_s"),
                                                   get("llama", "decode", "1", "tok_s"))
    return out


def _cell(run: dict[str, Any], *keys: str) -> str:
    value: Any = run
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return "-" if value is None else str(value)


def write_gguf_table(result: dict[str, Any], path: Path) -> None:
    m = result["machine"]
    lines = [
        f"# {result['gguf']}: maced against llama-cpp-python's server", "",
        f"{result['tensor_mib']} MiB of tensors (file {result['gguf_mib']} MiB, file_type {result['file_type']}); "
        f"{result['threads']} threads for both; {m['cores']} cores ({m['cpu']}), shared: /proc/loadavg "
        f"`{result['loadavg_start']}` at start, `{result['loadavg_end']}` at the end. {result['tokens']} tokens "
        f"per stream, greedy, best of {result['repeats']}; one DPO pair of {result['dpo_tokens']}-token "
        f"completions. {result['date']}. Command: `{result['command']}`", "",
        "| server | ready, first start (s) | ready, cached (s) | peak RSS starting (MiB) | peak RSS serving (MiB) "
        "| peak RSS training one pair (MiB) | tok/s, 1 stream | tok/s, 8 streams | DPO pair: stages (s) / until published (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("maced", "llama"):
        run = result.get(name, {})
        if "skipped" in run:
            lines.append(f"| {name} | skipped: {run['skipped']} | | | | | | | |")
            continue
        starts = run.get("starts", [])
        first, cached = (starts[0] if starts else {}), (starts[-1] if len(starts) > 1 else {})
        if name == "maced" and result.get("warm_cache"):
            first, cached = {}, starts[0] if starts else {}  # the first start was an earlier run's
        if name == "llama":
            first, cached = {}, starts[0] if starts else {}  # nothing to convert: every start is the same
        start_peak = max([s.get("peak_rss_mib", 0) for s in starts] + [0]) or "-"
        dpo = run.get("dpo_pair", {})
        dpo_cell = f"{dpo['stage_s']} / {dpo['wall_s']} ({dpo['outcome']})" if dpo else "-"
        lines.append(
            f"| {name} | {first.get('ready_s', '-')} | {cached.get('ready_s', '-')} | {start_peak} | "
            f"{_cell(run, 'serving', 'peak_rss_mib')} | {_cell(run, 'dpo_pair', 'peak_rss_mib')} | "
            f"{_cell(run, 'decode', '1', 'tok_s')} | {_cell(run, 'decode', '8', 'tok_s')} | {dpo_cell} |")
        if "error" in run:
            lines += ["", f"{name} failed: `{run['error'][-1500:]}`", ""]
    phases = [{**(s.get("log_phases") or {}), "waited after ready for the background calibration":
               s.get("background_calibration_wait_s")} for s in result.get("maced", {}).get("starts", [])]
    if any(phases):
        lines += ["", "maced's start-up phases from its log (s): " + "; ".join(
            f"start {i + 1}: " + ", ".join(f"{k} {v}" for k, v in (p or {}).items() if v is not None)
            for i, p in enumerate(phases))]
    said = result.get("maced", {}).get("log_said") or [
        line.split(" ", 3)[-1] for line in result.get("maced", {}).get("log_tail", "").splitlines()
        if any(k in line for k in SAID)]
    said = list(dict.fromkeys(said))  # each start and reload says the same
    if said:
        lines += ["", "maced's log on its backend and its fine-tuning:", ""] + [f"- `{line[:600]}`" for line in said]
    runs = {name: result.get(name, {}).get("decode_runs", []) for name in ("maced", "llama")}
    if any(runs.values()):
        lines += ["", "Every decode run, tok/s (streams x repeat; each repeat ran every stream count on maced, then "
                  "on llama, in turn): " + "; ".join(
                      f"{name} " + ", ".join(f"{r['streams']}x r{r['repeat'] + 1} {r['tok_s']}" for r in rows)
                      for name, rows in runs.items() if rows)]
    copies = result.get("dpo_copies")
    if copies and "error" not in copies:
        lines += ["", f"One DPO pair's staged update in one process, {copies['dtype']}, alternated: on the blocks "
                  f"{[r['s'] for r in copies['runs']['blocks']]} s, on a float copy "
                  f"{[r['s'] for r in copies['runs']['float']]} s; best {copies['best_s']['blocks']} / "
                  f"{copies['best_s']['float']} s = **{copies['blocks_over_float']}x** (peak RSS holding both "
                  f"{copies['both_copies_peak_rss_mib']} MiB; /proc/loadavg `{copies['loadavg']}`)."]
    elif copies:
        lines += ["", f"The two-copy DPO comparison failed: {copies['error']}"]
    bar = result.get("bar") or {}
    if any(v is not None for v in bar.values()):
        lines += ["", "The bar's ratios (#28): peak RSS training one pair / llama-server's peak serving "
                  f"**{bar.get('train_peak_over_llama_serving')}** (bar <= 1.5); tok/s at 1 stream / llama-server "
                  f"**{bar.get('tok_s_1_over_llama')}** (>= 1.0); at 8 streams **{bar.get('tok_s_8_over_llama')}** "
                  f"(>= 2); DPO pair on the blocks / two-copy **{bar.get('dpo_blocks_over_two_copy')}** (<= 1.5)."]
        if bar.get("tok_s_8_over_llama_1_stream") is not None:
            lines[-1] += (" llama-server's 8 streams were not run (it answers one request at a time): maced's 8 "
                          f"streams / llama-server's 1 stream **{bar['tok_s_8_over_llama_1_stream']}**.")
    lines += ["", "Peak RSS: the server process and its children, summed (sampled every 0.1 s, and the kernel's "
              "VmHWM reset per phase; the larger). llama-cpp-python's server answers one request at a time. "
              "Both servers are up together while decoding, and their runs alternate, so both see the "
              "same load.", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="llama-3.2-1b,qwen3-1.7b", help=f"any of {', '.join(SHAPES)}")
    ap.add_argument("--backends", default="torch,onnxruntime-int4", help=f"any of {', '.join(BACKENDS)}")
    ap.add_argument("--tokens", type=int, default=32, help="generated tokens per stream")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="decode runs per stream count (best kept)")
    ap.add_argument("--dpo-tokens", type=int, default=64, help="tokens of the pair's prompt and of each completion")
    ap.add_argument("--no-dpo", dest="dpo", action="store_false")
    ap.add_argument("--dtype", default="auto", help="engine dtype (auto: bfloat16 where the CPU has fast bf16, else float32)")
    ap.add_argument("--threads", type=int, default=0, help="torch / ONNX Runtime threads; 0 = all cores")
    ap.add_argument("--kv-cache-mib", type=int, default=256)
    # The default 256 MiB cannot hold one forward window of a default DPO pair at 1B (~155 KiB
    # saved per row and layer in float32, x 128 rows x 16 layers, plus the 128k-vocabulary
    # logits): the job would wait for room forever.
    ap.add_argument("--finetune-mib", type=int, default=2048, help="the derived budget's room for fine-tuning")
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the real shape (development only)")
    ap.add_argument("--cache-dir", default="", help="built models, graphs, cost profiles (default: <state dir>/bench/scale)")
    ap.add_argument("--timeout-s", type=float, default=1800, help="per measured child")
    ap.add_argument("--out", default=str(RESULTS / "bench_scale.json"))
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    serve = ap.add_argument_group("serving mode: maced --model FILE against llama-cpp-python's server")
    serve.add_argument("--gguf", default="", help="a GGUF file (tools/make_gguf.py writes them): run this mode")
    serve.add_argument("--llama-python", default="/work/llama-venv/bin/python",
                       help="interpreter with llama-cpp-python[server]; '' to leave llama out")
    serve.add_argument("--n-ctx", type=int, default=2048, help="llama-server's context")
    serve.add_argument("--prompt", default="Give me a tip for cooking rice, and explain why it works.")
    serve.add_argument("--dpo-copies-budget-s", type=float, default=600,
                       help="no further round of --dpo-copies once it would end past this")
    serve.add_argument("--warm-costs", default="", help="a state dir's costs/ folder (an earlier run's finished "
                       "cost calibration), copied into maced's fresh state")
    serve.add_argument("--calibration-wait-s", type=float, default=900,
                       help="longest wait after a maced start for its background cost calibration")
    serve.add_argument("--dpo-timeout-s", type=float, default=900, help="longest wait for the pair to publish")
    serve.add_argument("--warm-cache", default="", help="a model cache (MACE_CACHE_DIR) an earlier first start "
                       "built: maced starts once, on it")
    serve.add_argument("--streams", default="1,8", type=lambda v: [int(x) for x in v.split(",") if x],
                       help="stream counts to time ('' for none)")
    serve.add_argument("--llama-streams", default=None, type=lambda v: [int(x) for x in v.split(",") if x],
                       help="llama-server's stream counts, if fewer (it answers one request at a time: its 8 "
                            "streams run one after another)")
    serve.add_argument("--servers", default="maced,llama", help="which of maced, llama to run")
    serve.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="more maced settings")
    serve.add_argument("--dpo-copies", type=int, default=0, metavar="ROUNDS",
                       help="after the servers: one DPO pair on the blocks and on a float32 copy, alternated "
                            "ROUNDS times in one process (the two-copy comparison; holds both copies)")
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.gguf:
        gguf_result = run_gguf(args)
        out = Path(args.out) if args.out != str(RESULTS / "bench_scale.json") else \
            RESULTS / f"bench_scale_gguf_{Path(args.gguf).stem}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(gguf_result, indent=1) + "\n")
        write_gguf_table(gguf_result, out.with_suffix(".md"))
        print(out.with_suffix(".md").read_text())
        return
    if args.measure:
        spec = json.loads(args.measure)
        Path(spec["result_file"]).write_text(json.dumps(measure(spec)))
        return

    from edge_runtime.paths import state_dir

    cache = Path(args.cache_dir) if args.cache_dir else state_dir() / "bench" / "scale"
    result: dict[str, Any] = {
        "command": " ".join(["python tools/bench_scale.py", *sys.argv[1:]]), "machine": machine(),
        "dtype": args.dtype, "tokens": args.tokens, "repeats": args.repeats, "dpo_tokens": args.dpo_tokens,
        "kv_cache_mib": args.kv_cache_mib, "finetune_mib": args.finetune_mib, "load_average_at_start": os.getloadavg()[0], "shapes": [],
        "memory_method": "VmHWM (reset per phase via /proc/self/clear_refs) and a 2 ms sampler of RssAnon, "
                         "in a fresh child process per shape and backend",
    }
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        if args.layers:
            shape = shape.scaled(num_layers=args.layers)
        folder = cache / (name + (f"-{args.layers}l" if args.layers else ""))
        entry: dict[str, Any] = {"shape": name, "num_layers": shape.num_layers, "runs": []}
        result["shapes"].append(entry)
        # The config alone decides most refusals: no gigabytes written for a family the forward lacks.
        folder.mkdir(parents=True, exist_ok=True)
        specials = tuple(padded_tokenizer(shape.vocab_size).convert_tokens_to_ids(
            ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
        hf_config(shape, specials).save_pretrained(folder)  # type: ignore[arg-type]
        why = check_supported(folder)
        if why is not None:
            entry["unsupported"] = why
            print(f"{name}: unsupported: {why}", flush=True)
            continue
        t0 = time.perf_counter()
        build_model_dir(shape, folder)
        entry["build_s"] = round(time.perf_counter() - t0, 1)
        entry["checkpoint_mib"] = round(sum(f.stat().st_size for f in folder.glob("*.safetensors")) / MiB, 1)
        for backend in args.backends.split(","):
            engine_backend, quantization = BACKENDS[backend]
            spec = {"model_dir": str(folder), "dtype": args.dtype, "backend": engine_backend,
                    "quantization": quantization, "onnx_cache_dir": str(cache / "onnx"), "threads": args.threads,
                    "kv_cache_bytes": args.kv_cache_mib * MiB, "finetune_bytes": args.finetune_mib * MiB,
                    "cost_cache_dir": str(cache / "costs"),
                    "streams": [1, 8], "tokens": args.tokens, "prompt_tokens": args.prompt_tokens,
                    "repeats": args.repeats, "dpo": args.dpo, "dpo_tokens": args.dpo_tokens}
            if engine_backend == "onnxruntime":
                print(f"{name} / {backend}: exporting the graphs (cached for the measured run) ...", flush=True)
                entry.setdefault("exports", {})[backend] = run_child({**spec, "export_only": True}, args.timeout_s)
                print(json.dumps(entry["exports"][backend]), flush=True)
            print(f"{name} / {backend} ...", flush=True)
            t0 = time.perf_counter()
            run = run_child(spec, args.timeout_s)
            run["backend"] = backend
            run["child_wall_s"] = round(time.perf_counter() - t0, 1)
            if "error" not in run:
                run["summary"] = summarise(run)
            entry["runs"].append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "phases"}, indent=1), flush=True)
    result["load_average_at_end"] = os.getloadavg()[0]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    write_table(result, out.with_suffix(".md"))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
