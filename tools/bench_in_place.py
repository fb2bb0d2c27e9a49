"""Speed of a GGUF served and trained from its own mapped bytes (the torch backend in place, issue
#28), in one process: decode tok/s at 1 and 8 rows, a prefill chunk, one DPO pair's stages, each
with the time per op kind (GGUF products by shape and path, the head, the embedding, the rest);
and llama-cpp-python's tok/s at 1 stream on the same file and threads, interleaved round by round.

    flock /tmp/mace-big.lock python tools/bench_in_place.py --gguf llama-3.1-8b-random-q4_k_m.gguf --out tools/results/x
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# Appended, so a PYTHONPATH (another checkout's code: a before/after run) comes first.
sys.path.append(str(Path(__file__).resolve().parent.parent))
sys.path.append(str(Path(__file__).resolve().parent))  # tools/bench_scale.py

from bench_scale import text_of_tokens  # noqa: E402

import edge_runtime  # noqa: E402,F401  (before torch: it sets OMP_WAIT_POLICY, read when libgomp loads)

LLAMA_PYTHON = "/work/llama-venv/bin/python"
# llama-cpp-python's decode rate at 1 stream: one greedy generate after a warm one, prefill apart.
LLAMA_SCRIPT = r"""
import sys, time
from llama_cpp import Llama
path, threads, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
prompt = llm.tokenize(b"Tell me about the sea.")
llm.eval(prompt)
t0 = time.perf_counter()
for _ in range(tokens):
    tok = llm.sample(temp=0.0)
    llm.eval([tok])
print(tokens / (time.perf_counter() - t0))
"""


class OpTimer:
    """Wall seconds per op kind, from wrappers around the GGUF kernel's entry points and the
    model's head and embedding (nested calls are charged to the outermost op only)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._depth = 0

    @contextmanager
    def op(self, key: str):
        if self._depth:
            yield
            return
        self._depth += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._depth -= 1
            self.seconds[key] += time.perf_counter() - t0
            self.calls[key] += 1

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def report(self, total: float) -> dict[str, Any]:
        ops = {k: {"s": round(v, 3), "calls": self.calls[k]} for k, v in sorted(self.seconds.items(), key=lambda kv: -kv[1])}
        return {"total_s": round(total, 3), "rest_s": round(total - sum(self.seconds.values()), 3), "ops": ops}


def install(timer: OpTimer) -> None:
    """Wrap what is timed: gguf_kernel's products (keyed by type, shape, rows and path), the
    embedding and the model's LM head."""
    from edge_runtime.model import gguf_kernel, gguf_weight, llama

    def bucket(m: int) -> str:
        return str(m) if m <= 16 else "17-64" if m <= 64 else ">64"

    for name in ("matmul", "matmul_back"):
        original = getattr(gguf_kernel, name)

        def wrapped(x: Any, raw: Any, qtype: Any, k: int, *a: Any, _o: Any = original, _n: str = name, **kw: Any) -> Any:
            path = "fused" if _n == "matmul" and x.shape[0] <= gguf_kernel.FUSED_MAX_ROWS else "tiles"
            path = getattr(gguf_kernel, "path_of", lambda *_: path)(_n, x.shape[0], qtype)
            with timer.op(f"{_n} {qtype.name} {raw.shape[0]}x{k} M={bucket(x.shape[0])} {path}"):
                return _o(x, raw, qtype, k, *a, **kw)

        setattr(gguf_kernel, name, wrapped)
    original_group = gguf_kernel.group_matmul
    preps = {gguf_kernel.PREP_NONE: "", gguf_kernel.PREP_NORM: "norm+", gguf_kernel.PREP_SILU_MUL: "silu*up+"}

    def group_matmul(x: Any, plan: Any, prep: int = 0, *a: Any, **kw: Any) -> Any:
        # the fused serving layer's call (gguf_layer): its C norm or silu * up counts as product time
        with timer.op(f"group_matmul {preps[prep]}{plan.n}x{plan.k} M={bucket(x.shape[0])} fused layer"):
            return original_group(x, plan, prep, *a, **kw)

    gguf_kernel.group_matmul = group_matmul
    original_embed = gguf_weight.GgufWeight.embedding

    def embedding(self: Any, ids: Any, dtype: Any = None, **kw: Any) -> Any:
        with timer.op("embedding"):
            return original_embed(self, ids, **({} if dtype is None else {"dtype": dtype}), **kw)

    gguf_weight.GgufWeight.embedding = embedding  # type: ignore[method-assign]
    original_logits = llama.LlamaModel.logits

    def logits(self: Any, hidden: Any, ctx: Any = None) -> Any:
        with timer.op(f"head (logits) rows={bucket(hidden.shape[0])}"):
            return original_logits(self, hidden, ctx)

    llama.LlamaModel.logits = logits  # type: ignore[method-assign]
    from edge_runtime.train import logprobs

    original_logps = logprobs.token_logps

    def token_logps(*a: Any, **kw: Any) -> Any:
        with timer.op("head (training log-probs, forward)"):
            return original_logps(*a, **kw)

    logprobs.token_logps = token_logps
    try:
        from edge_runtime.train import staged

        staged.token_logps = token_logps
    except (ImportError, AttributeError):
        pass


def run_all(engine: Any) -> None:
    while engine.has_unfinished():
        engine.step()


def decode(engine: Any, timer: OpTimer, streams: int, tokens: int, unbounded: bool = True,
           prompt_tokens: int = 0, ab_env: str | None = None, adapter: str | None = None) -> dict[str, Any]:
    """tok/s of `streams` greedy streams counted once every stream has its first token; with
    `prompt_tokens`, each stream's prompt is that long (the decode attention's cost follows the
    context: a served chat's template alone is ~40 tokens), else a short sentence. With `ab_env`,
    the decode steps alternate that switch (e.g. MACE_ATTN_KERNEL) off and on, and the result adds
    each setting's median step. `adapter`: every stream is that user's (their LoRA on every row)."""
    from edge_runtime import SamplingParams

    if unbounded:  # every row in every step, whatever the policy's latency budget admits
        engine.scheduler.latency_budget_s = engine.scheduler.max_latency_budget_s = math.inf
    for i in range(streams):
        prompt = text_of_tokens(engine.tokenizer, prompt_tokens, offset=7 * i) if prompt_tokens else \
            f"Tell me about the sea, number {i}."
        engine.add_request(prompt, SamplingParams(max_tokens=tokens + 1, ignore_eos=True), adapter=adapter)
    while engine.has_unfinished():  # prefill steps until every row decodes
        engine.step()
        sched = engine.scheduler  # every stream admitted and past its first token
        if not sched.waiting and sched.running and all(len(s.output_ids) >= 1 for s in sched.running):
            break
    timer.reset()
    t0 = time.perf_counter()
    steps = 0
    ab_steps: dict[str, list[float]] = {"on": [], "off": []}
    while engine.has_unfinished():
        if ab_env:  # steps alternate the switch: both settings see the same load and contexts
            setting = ("off", "on")[steps % 2]
            os.environ[ab_env] = setting
            t = time.perf_counter()
            engine.step()
            ab_steps[setting].append(time.perf_counter() - t)
        else:
            engine.step()
        steps += 1
    dt = time.perf_counter() - t0
    out = {"streams": streams, "steps": steps, "rows_per_step": round(streams * tokens / max(1, steps), 2),
           "tok_s": round(streams * tokens / dt, 3), "s_per_step": round(dt / max(1, steps), 3),
           "profile": timer.report(dt)}
    if ab_env:
        os.environ.pop(ab_env)
        out["ab"] = {"env": ab_env, **{k: {"median_step_s": round(statistics.median(v), 4), "steps": len(v)}
                                       for k, v in ab_steps.items() if v}}
    return out


def publish_random_adapter(engine: Any, rank: int, targets: str) -> str:
    """A user "bench" with a random adapter (A as PEFT initialises it, B small random) published."""
    import torch

    from edge_runtime.lora import LoraSettings
    from edge_runtime.lora.config import ATTN_TARGETS, MLP_TARGETS
    from edge_runtime.lora.weights import LoraWeights

    settings = LoraSettings(rank=rank, alpha=2.0 * rank, **({"target_modules": ATTN_TARGETS + MLP_TARGETS} if targets == "all" else {}))
    weights = LoraWeights.init(engine.model.cfg, settings, seed=1)
    gen = torch.Generator().manual_seed(2)
    for b in weights.b.values():
        b.copy_(torch.randn(b.shape, generator=gen) * 0.01)
    engine.publish_adapter("bench", weights)
    return "bench"


def prefill(engine: Any, timer: OpTimer, tokens: int) -> dict[str, Any]:
    from edge_runtime import SamplingParams

    engine.add_request(text_of_tokens(engine.tokenizer, tokens), SamplingParams(max_tokens=1, ignore_eos=True))
    timer.reset()
    t0 = time.perf_counter()
    run_all(engine)
    dt = time.perf_counter() - t0
    return {"tokens": tokens, "s": round(dt, 3), "profile": timer.report(dt)}


def dpo_pair(engine: Any, timer: OpTimer, tokens: int, tag: str) -> dict[str, Any]:
    from edge_runtime.train.pairs import PreferenceRecord
    from edge_runtime.train.trainer import AdapterTrainer

    vocab = engine.tokenizer
    trainer = AdapterTrainer(engine.model, engine.tokenizer, costs=None)
    pair = PreferenceRecord(({"role": "user", "content": text_of_tokens(vocab, tokens)},),
                            text_of_tokens(vocab, tokens, 3), text_of_tokens(vocab, tokens, 11), pair_id=tag)
    task = trainer.task(pair, score=False)
    timer.reset()
    engine.add_finetune(task, user=f"bench-{tag}")
    t0 = time.perf_counter()
    run_all(engine)
    dt = time.perf_counter() - t0
    return {"tokens": tokens, "s": round(dt, 2), "stages": len(task.stages),
            "loss": None if task.result is None else round(float(task.result.loss), 4),
            "stage_seconds": {k: round(v, 2) for k, v in task.seconds_by_kind().items()}, "profile": timer.report(dt)}


def llama_tok_s(gguf: str, threads: int, tokens: int) -> float | None:
    try:
        out = subprocess.run([LLAMA_PYTHON, "-c", LLAMA_SCRIPT, gguf, str(threads), str(tokens)],
                             capture_output=True, text=True, timeout=900, check=True)
        return round(float(out.stdout.strip().splitlines()[-1]), 3)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        print(f"llama-cpp-python failed: {e}", file=sys.stderr)
        return None


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _top_ops(profile: dict[str, Any], n: int = 6) -> str:
    ops = list(profile["ops"].items())[:n]
    return "; ".join(f"{k} {v['s']} s" for k, v in ops) + f"; rest {profile['rest_s']} s"


def report(runs: dict[str, dict[str, Any]]) -> str:
    """A markdown table of labelled runs (label -> this tool's JSON), first round of each."""
    lines = ["| figure | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    rows = [r["rounds"][0] for r in runs.values()]

    def line(name: str, get: Any) -> None:
        cells = []
        for row in rows:
            try:
                cells.append(str(get(row)))
            except (KeyError, TypeError):
                cells.append("-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    line("load average (start of round)", lambda r: r["loadavg"].split()[0])
    line("llama-cpp-python, 1 stream, tok/s", lambda r: r["llama_cpp_tok_s_1"])
    for s in (1, 8):
        line(f"decode, {s} stream(s), tok/s (rows a step)",
             lambda r, s=s: f"{r[f'decode_{s}']['tok_s']} ({r[f'decode_{s}'].get('rows_per_step', '-')})")
        line(f"decode, {s} stream(s): s a step (rest: not in a timed op)",
             lambda r, s=s: f"{r[f'decode_{s}']['s_per_step']} (rest {round(r[f'decode_{s}']['profile']['rest_s'] / r[f'decode_{s}']['steps'], 3)})")
    line("prefill chunk, s", lambda r: f"{r['prefill']['s']} ({r['prefill']['tokens']} tokens)")
    line("DPO pair, s (stages)", lambda r: f"{r['dpo_pair']['s']} ({r['dpo_pair']['stages']})")
    line("DPO pair by stage kind, s", lambda r: ", ".join(f"{k} {v}" for k, v in r["dpo_pair"]["stage_seconds"].items()))
    out = ["\n".join(lines), ""]
    for label, row in zip(runs, rows, strict=True):
        for key in ("decode_1", "decode_8", "prefill", "dpo_pair"):
            if key in row:
                out.append(f"- {label}, {key}: {_top_ops(row[key]['profile'])}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8, help="decode tokens per stream per round")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="each decode stream's prompt length (0: a short sentence)")
    ap.add_argument("--ab-env", metavar="VAR", help="alternate decode steps with VAR=off and VAR=on "
                    "(a switch the engine reads per step, e.g. MACE_ATTN_KERNEL) and report each one's median step")
    ap.add_argument("--prefill", type=int, default=256, help="prompt tokens of the prefill chunk (0: none)")
    ap.add_argument("--dpo-tokens", type=int, default=0, help="tokens of a DPO pair's prompt and each answer (0: none)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--adapter-rank", type=int, default=0,
                    help="decode streams with a user's random LoRA adapter of this rank (0: the base model)")
    ap.add_argument("--adapter-targets", choices=("attention", "all"), default="attention",
                    help="the adapter's projections: q/k/v/o (the default LoraSettings) or every linear")
    ap.add_argument("--llama", action="store_true", help="llama-cpp-python's 1-stream tok/s each round")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--report", nargs="+", metavar="LABEL=JSON",
                    help="only write <out>.md: a table of earlier runs (labelled JSON files)")
    args = ap.parse_args(argv)
    if args.report:
        runs = {label: json.loads(Path(path).read_text()) for label, path in (a.split("=", 1) for a in args.report)}
        text = report(runs)
        if args.out:
            args.out.with_suffix(".md").write_text(text)
        print(text)
        return 0

    import torch

    from daemon.config import load_config
    from edge_runtime import Engine

    timer = OpTimer()
    install(timer)
    result: dict[str, Any] = {"gguf": args.gguf, "threads": args.threads, "prompt_tokens": args.prompt_tokens, "rounds": [],
                              "loadavg_start": Path("/proc/loadavg").read_text().strip()}
    t0 = time.perf_counter()
    config = load_config(environ={}).engine.replace(model=str(args.gguf), num_threads=args.threads, backend="torch",
                                                    torch_weights="gguf", cost_profile="off")
    engine = Engine.load(config=config)
    result["load_s"] = round(time.perf_counter() - t0, 1)
    result["torch_threads"] = torch.get_num_threads()
    log(f"loaded in {result['load_s']} s")
    adapter = publish_random_adapter(engine, args.adapter_rank, args.adapter_targets) if args.adapter_rank else None
    result["adapter"] = {"rank": args.adapter_rank, "targets": args.adapter_targets} if adapter else None
    decode(engine, timer, 1, 2)  # warm: first touches of the mapped pages

    def save() -> None:  # after every figure: a run cut short by a timeout keeps what it measured
        if args.out:
            args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")

    for r in range(args.rounds):
        row: dict[str, Any] = {"loadavg": Path("/proc/loadavg").read_text().strip()}
        result["rounds"].append(row)
        if args.llama:
            row["llama_cpp_tok_s_1"] = llama_tok_s(args.gguf, args.threads, args.tokens * 2)
            log(f"llama.cpp: {row['llama_cpp_tok_s_1']} tok/s")
            save()
        for s in (int(x) for x in args.streams.split(",") if x):
            row[f"decode_{s}"] = decode(engine, timer, s, args.tokens, prompt_tokens=args.prompt_tokens,
                                        ab_env=args.ab_env, adapter=adapter)
            log(f"decode {s}: {json.dumps(row[f'decode_{s}'])}")
            save()
        if args.prefill:
            row["prefill"] = prefill(engine, timer, args.prefill)
            log(f"prefill: {json.dumps(row['prefill'])}")
            save()
        if args.dpo_tokens:
            row["dpo_pair"] = dpo_pair(engine, timer, args.dpo_tokens, f"r{r}")
            log(f"dpo pair: {json.dumps(row['dpo_pair'])}")
            save()
        row["loadavg_end"] = Path("/proc/loadavg").read_text().strip()
        save()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
