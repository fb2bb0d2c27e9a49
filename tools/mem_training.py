"""Where a block model's resident bytes go while it serves and trains one DPO pair (issue #28), in
one process: the engine as `maced` builds it (defaults), a short generate, the stage-cost
profile, then one pair's stages through the scheduler, with the resident set sampled every few
milliseconds and tagged with what was running, and the file-backed pages split by file.

    python tools/mem_training.py --gguf llama-3.2-1b-random-q4_k_m.gguf --out tools/results/mem_1b_training
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/bench_scale.py

from bench_scale import text_of_tokens  # noqa: E402  (its pair text, so the figures compare)

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def statm() -> tuple[int, int]:
    """(anonymous, file-backed) resident bytes now: /proc/self/statm's resident less shared, and shared."""
    fields = Path("/proc/self/statm").read_text().split()
    resident, shared = int(fields[1]) * PAGE, int(fields[2]) * PAGE
    return resident - shared, shared


def file_rss_by_file() -> Counter:
    """Resident bytes of each mapped file (its basename), from /proc/self/smaps."""
    out: Counter = Counter()
    current = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(None, 5)
        if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:
            current = head[5].strip() if len(head) == 6 and head[5].startswith("/") else None
        elif current and line.startswith("Rss:"):
            out[current] += int(line.split()[1]) * 1024
    return out


def file_groups(files: Counter, names: dict[str, str]) -> dict[str, float]:
    """Resident file pages in MiB, grouped: each of `names` (label -> path suffix), shared
    libraries, and the rest."""
    groups: Counter = Counter()
    for path, size in files.items():
        label = next((k for k, suffix in names.items() if path.endswith(suffix)), None)
        if label is None:
            label = "shared libraries" if ".so" in Path(path).name else "other files"
        groups[label] += size
    return {k: round(v / MIB, 1) for k, v in sorted(groups.items())}


class Sampler:
    """Samples (anonymous, file) resident bytes every `period` seconds on a thread and keeps the
    peak of each tag (what the caller says is running) and overall."""

    def __init__(self, period: float = 0.002) -> None:
        self.tag = "start"
        self.peaks: dict[str, dict[str, int]] = {}
        self._stop = threading.Event()
        self._period = period
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> None:
        anon, file = statm()
        peak = self.peaks.setdefault(self.tag, {"anon": 0, "file": 0, "total": 0})
        peak["anon"] = max(peak["anon"], anon)
        peak["file"] = max(peak["file"], file)
        peak["total"] = max(peak["total"], anon + file)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self.sample()

    def set(self, tag: str) -> str:
        self.sample()
        previous, self.tag = self.tag, tag
        self.sample()
        return previous

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def whole_logits_logps(model: Any, hidden: Any, targets: Any) -> Any:
    """token_logps before #28's cut: the [n, vocab] logits at once (what the pieces replace)."""
    import torch

    logits = model.logits(hidden).float()
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def mib(x: float) -> float:
    return round(x / MIB, 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from daemon.config import load_config
    from edge_runtime import Engine, SamplingParams
    from edge_runtime.memory import MemoryKind
    from edge_runtime.train import logprobs, staged
    from edge_runtime.train.pairs import PreferenceRecord
    from edge_runtime.train.trainer import AdapterTrainer

    sampler = Sampler()
    libc = ctypes.CDLL("libc.so.6")
    points: dict[str, dict[str, Any]] = {}
    names = {"ONNX data file": ".onnx.data", "block cache file": "model.blocks.safetensors",
             "GGUF file (read in place)": Path(args.gguf).name}

    engine = None

    def point(name: str) -> dict[str, Any]:
        anon, file = statm()
        points[name] = {"anon_mib": mib(anon), "file_mib": mib(file), "files": file_groups(file_rss_by_file(), names),
                        "loadavg": Path("/proc/loadavg").read_text().strip()}
        dense = getattr(getattr(engine, "backend", None), "dense", None)
        if dense is not None:  # the ONNX Runtime backend's per-sequence K/V rows (dense_kv.py)
            points[name]["dense_kv_mib"] = mib(0 if dense.buffer is None else dense.buffer.nbytes)
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {points[name]}", file=sys.stderr, flush=True)
        return points[name]

    if args.ort_arena is not None:
        from edge_runtime.backends import ort_session

        ort_session.CPU_ARENA = args.ort_arena == "on"
    point("imports")
    sampler.set("load")
    t0 = time.perf_counter()
    # maced's engine settings with no file, environment or flags: its defaults (auto backend, MACE)
    config = load_config(environ={}).engine.replace(model=str(args.gguf), num_threads=args.threads,
                                                    **({"backend": args.backend} if args.backend else {}),
                                                    torch_weights=args.weights,
                                                    **({"cost_profile": args.cost_profile} if args.cost_profile else {}),
                                                    **({"onnx_cache_dir": args.onnx_cache_dir} if args.onnx_cache_dir else {}))
    engine = Engine.load(config=config)
    load_s = time.perf_counter() - t0
    point("loaded")
    sampler.set("serve")
    engine.add_request("Tell me about the sea." * 4, SamplingParams(max_tokens=args.tokens, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    point("served")
    if args.long_prompt:  # a prefill at the engine's chunk size: the shapes the arena keeps
        engine.add_request(text_of_tokens(engine.tokenizer, args.long_prompt), SamplingParams(max_tokens=2))
        while engine.has_unfinished():
            engine.step()
        point("long prefill")
    decode = []
    for _ in range(args.decode_rounds):  # tok/s at 1 stream: the prefill's step apart
        engine.add_request("Tell me about the sea.", SamplingParams(max_tokens=args.decode_tokens + 1, ignore_eos=True))
        engine.step()
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        decode.append(round(args.decode_tokens / (time.perf_counter() - t0), 2))
    point("decoded")

    sampler.set("stage cost profile")
    costs = None if args.nominal_stage_costs else engine.stage_costs()  # None: the trainer's nominal costs
    point("stage costs")

    # Tags: the stage running, and inside it the LM head's log-probs (the 128k-wide logits).
    original_run = staged.Stage.run

    def tagged_run(self: staged.Stage) -> float:
        previous = sampler.set(f"{sampler.tag.split(': ')[0]}: {self.kind.value}")
        try:
            return original_run(self)
        finally:
            sampler.set(previous)

    staged.Stage.run = tagged_run  # type: ignore[method-assign]
    heads = {"pieces": logprobs.token_logps, "whole": whole_logits_logps}
    vocab = engine.tokenizer
    model_bytes = {"block tensors (file-mapped)": 0, "float tensors": 0, "rotary tables": 0}
    for name, t in [*engine.model.named_parameters(), *engine.model.named_buffers()]:
        key = "block tensors (file-mapped)" if "_" in name.rsplit(".", 1)[-1] and t.dtype in (
            torch.uint8, torch.int8, torch.float16) else "float tensors"
        model_bytes[key] += t.numel() * t.element_size()
    for rope in engine.model.ropes:
        model_bytes["rotary tables"] += sum(t.numel() * t.element_size() for t in vars(rope).values()
                                            if isinstance(t, torch.Tensor))
    pairs = {}
    estimates: dict[str, list[dict[str, Any]]] = {}
    original_estimate = staged.Stage.estimate

    def recorded_estimate(self: staged.Stage) -> Any:
        est = original_estimate(self)
        mine = estimates.setdefault(sampler.tag.split(": ")[0], [])
        entry = {"stage": self.name, "peak_mib": mib(est.peak_bytes), "held_mib": mib(est.held_bytes)}
        if not mine or mine[-1] != entry:
            mine.append(entry)
        return est

    staged.Stage.estimate = recorded_estimate  # type: ignore[method-assign]
    runs = [(h, b) for _ in range(args.rounds) for h in args.head.split(",") for b in args.backward.split(",")]
    for round_no, (head_name, backward) in enumerate(runs if args.backward else []):
        head = heads[head_name]
        variant = head_name if args.backward == "recompute" and args.rounds == 1 else f"{head_name} {backward} #{round_no}"
        staged.FineTuneTask.recompute = backward == "recompute"

        def tagged_logps(*a: Any, head: Any = head, **k: Any) -> Any:
            previous = sampler.set(f"{sampler.tag} / head log-probs")
            try:
                return head(*a, **k)
            finally:
                sampler.set(previous)

        staged.token_logps = logprobs.token_logps = tagged_logps  # type: ignore[assignment]
        if args.trim_between:
            libc.malloc_trim(0)
        start_anon = statm()[0]
        sampler.set(f"{variant}: dpo pair (scheduler)")
        trainer = AdapterTrainer(engine.model, engine.tokenizer, costs=costs)
        pair = PreferenceRecord(({"role": "user", "content": text_of_tokens(vocab, args.dpo_tokens)},),
                                text_of_tokens(vocab, args.dpo_tokens, 3), text_of_tokens(vocab, args.dpo_tokens, 11),
                                pair_id="mem")
        task = trainer.task(pair, score=False)
        engine.add_finetune(task, user=f"mem-{round_no}")
        held: Counter = Counter()
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            for kind in (MemoryKind.ACTIVATIONS, MemoryKind.OPTIMIZER):
                held[kind.value] = max(held[kind.value], engine.ledger.held(kind))
        job = engine.scheduler.finetune.finished[-1]
        sampler.set("between")
        mine = {t: p for t, p in sampler.peaks.items() if t.startswith(f"{variant}:")}
        pairs[variant] = {
            "seconds": round(time.perf_counter() - t0, 1), "rows": task.tokens.num_rows,
            "stages": len(task.stages), "loss": None if task.result is None else round(float(task.result.loss), 4),
            "error": job.error, "start_anon_mib": mib(start_anon),
            "peak_anon_over_start_mib": {t.split(": ", 1)[1]: mib(p["anon"] - start_anon) for t, p in mine.items()},
            "ledger_peak_held_mib": {k: mib(v) for k, v in held.items()},
            "stage_seconds": task.seconds_by_kind(), "estimates": estimates.get(variant, []),
            "loadavg": Path("/proc/loadavg").read_text().strip(),
        }
        print(f"[{time.strftime('%H:%M:%S')}] pair {variant}: {pairs[variant]}", file=sys.stderr, flush=True)
        pairs[variant]["after"] = point(f"after {variant}")
    point("trained")
    if args.publish:
        # What the daemon does next: the trained adapter serves, so the LoRA graph is exported
        # (the first time) and opened, and the base graph closed (edge_runtime/backends).
        sampler.set("publish: LoRA graph export, open and one generate")
        engine.publish_adapter("mem-user", trainer.snapshot())
        engine.add_request("Tell me about the sea." * 4, SamplingParams(max_tokens=args.tokens, ignore_eos=True),
                           adapter="mem-user")
        while engine.has_unfinished():
            engine.step()
        sampler.set("between")
        point("published")
    before_trim = statm()[0]
    libc.malloc_trim(0)
    point("trimmed")
    sampler.close()
    ledger = {kind.value: {k: mib(v) for k, v in engine.ledger.entries(kind).items()} for kind in MemoryKind}
    return {
        "gguf": str(args.gguf), "threads": args.threads, "backend": engine.backend.name, "load_s": round(load_s, 1),
        "torch_weights": args.weights,
        "model_tensors_mib": {k: mib(v) for k, v in model_bytes.items()}, "pairs": pairs, "kv_cache_mib": mib(engine.cache.nbytes), "ledger_mib": ledger,
        "allocator_slack_mib": mib(before_trim - statm()[0]),
        "points": points, "decode_tok_s": decode, "ort_arena": args.ort_arena,
        "peaks_mib": {tag: {k: mib(v) for k, v in p.items()} for tag, p in sampler.peaks.items()},
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8, help="tokens of the generate before training")
    ap.add_argument("--dpo-tokens", type=int, default=64, help="tokens of the pair's prompt and each completion")
    ap.add_argument("--head", default="whole,pieces",
                    help="the LM head log-probs each pair uses, in order: whole (the [n, vocab] logits) and/or pieces")
    ap.add_argument("--backward", default="recompute",
                    help="staged backward paths, in order: hold (the forward's graphs kept) and/or recompute")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the head x backward pairs this many times (interleaved)")
    ap.add_argument("--no-trim-between", dest="trim_between", action="store_false",
                    help="do not malloc_trim before each pair (what a pair leaves stays for the next)")
    ap.add_argument("--ort-arena", choices=("on", "off"), help="ONNX Runtime's CPU arena (default: the code's)")
    ap.add_argument("--decode-tokens", type=int, default=32, help="tokens of each timed 1-stream decode")
    ap.add_argument("--decode-rounds", type=int, default=0, help="timed 1-stream decodes after the first generate")
    ap.add_argument("--long-prompt", type=int, default=0, help="tokens of a prompt served before the rest (0: none)")
    ap.add_argument("--no-publish", dest="publish", action="store_false",
                    help="skip serving the trained adapter (the LoRA graph's export and open)")
    ap.add_argument("--backend", help="engine.backend instead of the daemon's default (auto)")
    ap.add_argument("--weights", default="cache", choices=("cache", "gguf"),
                    help="engine.torch_weights: the model cache's blocks, or the GGUF's own bytes read in place")
    ap.add_argument("--cost-profile", help="engine.cost_profile (off: no calibration forwards at start)")
    ap.add_argument("--nominal-stage-costs", action="store_true",
                    help="skip profiling the stage costs (minutes at 8B on a loaded machine): nominal ones")
    ap.add_argument("--onnx-cache-dir", help="engine.onnx_cache_dir (a fresh one: the graphs exported as on a first start)")
    ap.add_argument("--out", type=Path, help="write <out>.json")
    args = ap.parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.with_suffix(".json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
