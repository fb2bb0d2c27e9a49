"""Load generator: closed-loop clients through the SDK against a real `maced`, optionally the same
load through its OpenAI-compatible HTTP gateway with the official `openai` client, and the same
load on an in-process Engine, so the cost of each API (ZeroMQ + msgpack, or HTTP + JSON + SSE,
event loop, threads) is known.

  .venv/bin/python tools/loadgen.py                       # default model, spawns its own daemon
  .venv/bin/python tools/loadgen.py --model tiny          # tiny random model: overhead dominates
  .venv/bin/python tools/loadgen.py --http --tag http     # adds the HTTP gateway (openai client)
  .venv/bin/python tools/loadgen.py --endpoint ipc:///run/mace-edge/maced.sock --no-in-process \
      --http-url http://127.0.0.1:8000/v1

Writes tools/results/loadgen[-<tag>].json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from daemon.sdk import AsyncClient, Client, ClientError  # noqa: E402

PROMPT = "Write one sentence about the sea."


@dataclass
class Sample:
    latency_s: float
    ttft_s: float | None
    tokens: int


@dataclass
class LevelResult:
    mode: str  # "daemon" (ZeroMQ SDK), "http" (gateway, openai client) or "in-process"
    concurrency: int
    requests: int
    wall_s: float
    samples: list[Sample] = field(default_factory=list, repr=False)
    # CPU seconds spent (daemon + client processes, or the one in-process engine): unlike wall
    # time, barely moved by other load on a shared machine, so the API's cost shows through.
    cpu_s: float | None = None
    daemon_cpu_s: float | None = None  # the daemon process's share of cpu_s (API modes)

    def summary(self) -> dict[str, Any]:
        lat = sorted(s.latency_s for s in self.samples)
        ttft = sorted(s.ttft_s for s in self.samples if s.ttft_s is not None)
        tokens = sum(s.tokens for s in self.samples)
        return {
            "mode": self.mode, "concurrency": self.concurrency, "requests": self.requests,
            "wall_s": round(self.wall_s, 3),
            "requests_per_s": round(self.requests / self.wall_s, 3),
            "tokens_per_s": round(tokens / self.wall_s, 2),
            "latency_p50_ms": round(_pct(lat, 0.50) * 1000, 2),
            "latency_p99_ms": round(_pct(lat, 0.99) * 1000, 2),
            "latency_mean_ms": round(statistics.fmean(lat) * 1000, 2),
            "ttft_p50_ms": round(_pct(ttft, 0.50) * 1000, 2) if ttft else None,
            "ttft_p99_ms": round(_pct(ttft, 0.99) * 1000, 2) if ttft else None,
            "cpu_ms_per_token": round(self.cpu_s * 1000 / tokens, 3) if self.cpu_s and tokens else None,
            "daemon_cpu_ms_per_token": (round(self.daemon_cpu_s * 1000 / tokens, 3)
                                        if self.daemon_cpu_s is not None and tokens else None),
        }


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


# -- through the daemon ----------------------------------------------------------------------------


async def daemon_level(endpoint: str, concurrency: int, total: int, max_tokens: int, stream: bool,
                       daemon_pid: int | None) -> LevelResult:
    daemon = psutil.Process(daemon_pid) if daemon_pid else None
    daemon0 = sum(daemon.cpu_times()[:2]) if daemon else 0.0
    cpu0 = time.process_time() + daemon0
    remaining = total
    samples: list[Sample] = []

    async def worker() -> None:
        nonlocal remaining
        async with AsyncClient(endpoint, timeout_s=600) as client:
            while remaining > 0:
                remaining -= 1
                t0 = time.perf_counter()
                ttft = None
                if stream:
                    s = await client.stream(PROMPT, max_tokens=max_tokens, ignore_eos=True)
                    async for _ in s:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                    result = s.result
                else:
                    result = await client.generate(PROMPT, max_tokens=max_tokens, ignore_eos=True)
                assert result is not None
                samples.append(Sample(time.perf_counter() - t0, ttft, result.usage.get("completion_tokens", 0)))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    daemon_cpu = (sum(daemon.cpu_times()[:2]) if daemon else 0.0) - daemon0
    cpu = time.process_time() + daemon_cpu + daemon0 - cpu0
    return LevelResult("daemon", concurrency, total, wall, samples, cpu if daemon else None,
                       daemon_cpu if daemon else None)


async def http_level(base_url: str, concurrency: int, total: int, max_tokens: int, stream: bool,
                     daemon_pid: int | None) -> LevelResult:
    """The same closed loop through the HTTP gateway, with the official openai client (one
    AsyncOpenAI, i.e. its own connection pool, per concurrent client)."""
    from openai import AsyncOpenAI

    daemon = psutil.Process(daemon_pid) if daemon_pid else None
    daemon0 = sum(daemon.cpu_times()[:2]) if daemon else 0.0
    cpu0 = time.process_time() + daemon0
    remaining = total
    samples: list[Sample] = []
    kwargs = {"model": "default", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
              "extra_body": {"ignore_eos": True}}

    async def worker() -> None:
        nonlocal remaining
        async with AsyncOpenAI(base_url=base_url, api_key="loadgen", max_retries=0, timeout=600) as client:
            while remaining > 0:
                remaining -= 1
                t0 = time.perf_counter()
                ttft = None
                if stream:
                    tokens = 0
                    response = await client.completions.create(
                        **kwargs, stream=True, stream_options={"include_usage": True})
                    async for chunk in response:
                        if ttft is None and chunk.choices and chunk.choices[0].text:
                            ttft = time.perf_counter() - t0
                        if chunk.usage is not None:
                            tokens = chunk.usage.completion_tokens
                else:
                    tokens = (await client.completions.create(**kwargs)).usage.completion_tokens
                samples.append(Sample(time.perf_counter() - t0, ttft, tokens))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    daemon_cpu = (sum(daemon.cpu_times()[:2]) if daemon else 0.0) - daemon0
    cpu = time.process_time() + daemon_cpu + daemon0 - cpu0
    return LevelResult("http", concurrency, total, wall, samples, cpu if daemon else None,
                       daemon_cpu if daemon else None)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_daemon(model: str, workdir: Path, extra: list[str],
                 http_port: int | None = None) -> tuple[subprocess.Popen[bytes], str]:
    socket_path = Path(tempfile.mkdtemp(prefix="mace-lg-")) / "maced.sock"
    log = open(workdir / "maced.log", "wb")  # noqa: SIM115 - lives as long as the daemon
    env = {k: v for k, v in os.environ.items() if not k.startswith("MACE_")}
    env["PYTHONUNBUFFERED"] = "1"
    http = f"127.0.0.1:{http_port}" if http_port else ""
    args = [sys.executable, "-m", "daemon.main", "--model", model, "--ipc", str(socket_path),
            "--state-dir", str(workdir / "state"), "--set", "finetune.enabled=false", "--http", http, *extra]
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"ipc://{socket_path}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"maced exited with {proc.returncode}; see {workdir / 'maced.log'}")
        try:
            with Client(endpoint, timeout_s=1, connect_timeout_s=1, retries=0) as c:
                if c.health(timeout_s=1).get("ok"):
                    return proc, endpoint
        except ClientError:
            time.sleep(0.2)
    raise SystemExit("maced did not become ready")


# -- in process ------------------------------------------------------------------------------------


def in_process_level(engine: Any, concurrency: int, total: int, max_tokens: int) -> LevelResult:
    """The same closed loop on the Engine itself: `concurrency` requests always in flight."""
    from edge_runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    started: dict[str, float] = {}
    first: dict[str, float] = {}
    samples: list[Sample] = []
    issued = 0

    def on_token(event: Any) -> None:
        # The first token with text, as the API clients see it: the daemon streams no message for
        # a token that decodes to "" (a special token such as the <|im_end|> this raw prompt
        # gets first from the instruct model, or an incomplete multi-byte character), so timing
        # the first token event here would put a whole iteration into the API's "overhead".
        if event.text and event.request_id not in first:
            first[event.request_id] = time.perf_counter()

    def issue() -> None:
        nonlocal issued
        rid = f"lg-{issued}"
        issued += 1
        started[rid] = time.perf_counter()
        engine.add_request(PROMPT, params, request_id=rid, on_token=on_token)

    start = time.perf_counter()
    cpu0 = time.process_time()
    for _ in range(min(concurrency, total)):
        issue()
    while len(samples) < total:
        for out in engine.step():
            now = time.perf_counter()
            rid = out.request_id
            ttft = first.pop(rid, now) - started[rid]
            samples.append(Sample(now - started.pop(rid), ttft, len(out.candidates[0].token_ids)))
            if issued < total:
                issue()
    return LevelResult("in-process", concurrency, total, time.perf_counter() - start, samples,
                       time.process_time() - cpu0)


def load_in_process(model: str, overrides: dict[str, str], warmup: int, max_tokens: int) -> Any:
    from edge_runtime.config import EngineConfig
    from edge_runtime.engine import Engine
    from edge_runtime.sampling import SamplingParams

    config = EngineConfig()
    typed = {k: (v == "true") if isinstance(getattr(config, k), bool) else type(getattr(config, k))(v)
             for k, v in overrides.items()}
    engine = Engine.load(model, config.replace(**typed))
    for _ in range(warmup):
        engine.generate(PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return engine


# -- report ----------------------------------------------------------------------------------------


def render_markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"# Load benchmark: API end to end vs in-process engine ({meta['model_label']})", "",
             f"- machine: {meta['machine']}; python {meta['python']}; torch {meta['torch']}",
             f"- model: {meta['model']} ({meta['device']}, {meta['dtype']})",
             f"- workload: closed loop, prompt {PROMPT!r}, {meta['max_tokens']} tokens per request "
             f"(ignore_eos), greedy, {'streamed' if meta['stream'] else 'whole'} replies; "
             f"max({meta['requests']}, 2 x concurrency) requests per level after {meta['warmup']} warm-up requests",
             "- TTFT: until the first token with text, in every mode (a token that decodes to \"\", such as the "
             "special token the raw prompt gets first, is not streamed by the APIs)",
             f"- daemon: `maced` over {meta['transport']}, one SDK AsyncClient (own socket) per concurrent client",
             *([f"- http: the same daemon's OpenAI-compatible gateway, `POST /v1/completions`, one official "
                f"`openai` AsyncOpenAI client (own connection pool) per concurrent client (openai "
                f"{meta['openai']})"] if meta.get("http") else []),
             f"- measured {meta['date']}; load average (1/5/15 min) {meta['loadavg']}",
             f"- command: `{meta['command']}`", "",
             "| concurrency | mode | req/s | tok/s | p50 latency ms | p99 latency ms | p50 TTFT ms | p99 TTFT ms | CPU ms/token | of it daemon |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['mode']} | {r['requests_per_s']} | {r['tokens_per_s']} | "
                     f"{r['latency_p50_ms']} | {r['latency_p99_ms']} | {r['ttft_p50_ms']} | {r['ttft_p99_ms']} | "
                     f"{r['cpu_ms_per_token']} | {r.get('daemon_cpu_ms_per_token')} |")
    overhead = meta.get("overhead", [])
    if overhead:
        lines += ["", "API overhead (API mode minus in-process at the same concurrency):", "",
                  "| concurrency | mode | p50 latency +ms | p50 +ms per token | p99 latency +ms | p50 TTFT +ms | throughput ratio | CPU +ms per token |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|"]
        for o in overhead:
            lines.append(f"| {o['concurrency']} | {o['mode']} | {o['p50_ms']} | {o['p50_ms_per_token']} | {o['p99_ms']} | "
                         f"{o['ttft_p50_ms']} | {o['throughput_ratio']} | {o['cpu_ms_per_token']} |")
    return "\n".join(lines) + "\n"


def _openai_version() -> str:
    import openai

    return openai.__version__


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", help="use a running daemon instead of spawning one")
    p.add_argument("--model", default="default", help="'default', 'tiny' (random test model), or a path")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--requests", type=int, default=64,
                   help="per concurrency level (at least 2 rounds: 2 x concurrency)")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--no-in-process", action="store_true")
    p.add_argument("--http", action="store_true",
                   help="also run the load through the HTTP gateway with the openai client")
    p.add_argument("--http-url", help="the gateway of a running daemon (with --endpoint), e.g. "
                   "http://127.0.0.1:8000/v1; implies --http")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="engine setting for both modes, e.g. dtype=float32")
    p.add_argument("--out", default=str(REPO / "tools" / "results"))
    p.add_argument("--tag", default="", help="suffix of the result files")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    stream = not args.no_stream
    workdir = Path(tempfile.mkdtemp(prefix="loadgen-"))
    model = args.model
    if model == "tiny":
        from edge_runtime.model.testing import make_tiny_model_dir

        model = str(make_tiny_model_dir(workdir / "tiny"))
    elif model == "default":
        from edge_runtime.model.source import resolve_model

        # The cached folder itself: the spawned daemon has its own (empty) state directory.
        model = str(resolve_model(None).path)
    overrides = dict(kv.split("=", 1) for kv in args.engine_arg)
    loadavg_start = " ".join(f"{x:.1f}" for x in os.getloadavg())

    engine = None
    if not args.no_in_process:
        engine = load_in_process(model, overrides, args.warmup, args.max_tokens)
    proc = None
    endpoint = args.endpoint
    http_url = args.http_url
    use_http = args.http or http_url is not None
    if endpoint is None:
        extra = [x for kv in overrides.items() for x in ("--set", f"engine.{kv[0]}={kv[1]}")]
        port = _free_port() if use_http else None
        proc, endpoint = spawn_daemon(model, workdir, extra, port)
        if port:
            http_url = f"http://127.0.0.1:{port}/v1"
    elif use_http and http_url is None:
        raise SystemExit("--http with --endpoint needs --http-url")
    pid = proc.pid if proc is not None else None
    rows: list[dict[str, Any]] = []
    try:
        with Client(endpoint, timeout_s=600) as c:
            for _ in range(args.warmup):
                c.generate(PROMPT, max_tokens=args.max_tokens, ignore_eos=True)
            model_info = c.status()["model"]
        if http_url is not None:
            asyncio.run(http_level(http_url, 1, args.warmup, args.max_tokens, stream, None))
        # All modes back to back per level, so a change in machine load between levels hits
        # them alike (the idle ones cost nothing meanwhile).
        for level in levels:
            total = max(args.requests, 2 * level)
            result = asyncio.run(daemon_level(endpoint, level, total, args.max_tokens, stream, pid))
            rows.append(result.summary())
            print(json.dumps(rows[-1]), flush=True)
            if http_url is not None:
                rows.append(asyncio.run(http_level(http_url, level, total, args.max_tokens, stream,
                                                   pid)).summary())
                print(json.dumps(rows[-1]), flush=True)
            if engine is not None:
                rows.append(in_process_level(engine, level, total, args.max_tokens).summary())
                print(json.dumps(rows[-1]), flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)

    import torch

    overhead = []
    for level, mode in ((level, mode) for level in levels for mode in ("daemon", "http")):
        d = next((r for r in rows if r["mode"] == mode and r["concurrency"] == level), None)
        e = next((r for r in rows if r["mode"] == "in-process" and r["concurrency"] == level), None)
        if d and e:
            overhead.append({"concurrency": level, "mode": mode,
                             "ttft_p50_ms": (round(d["ttft_p50_ms"] - e["ttft_p50_ms"], 2)
                                             if d["ttft_p50_ms"] is not None and e["ttft_p50_ms"] is not None
                                             else None),
                             "p50_ms": round(d["latency_p50_ms"] - e["latency_p50_ms"], 2),
                             "p99_ms": round(d["latency_p99_ms"] - e["latency_p99_ms"], 2),
                             "p50_ms_per_token": round((d["latency_p50_ms"] - e["latency_p50_ms"]) / args.max_tokens, 3),
                             "throughput_ratio": round(d["requests_per_s"] / e["requests_per_s"], 3),
                             "cpu_ms_per_token": (round(d["cpu_ms_per_token"] - e["cpu_ms_per_token"], 3)
                                                  if d["cpu_ms_per_token"] and e["cpu_ms_per_token"] else None)})
    meta = {
        "model": model_info.get("model"), "model_label": "tiny random model" if args.model == "tiny" else model_info.get("model"),
        "device": model_info.get("device"), "dtype": model_info.get("dtype"),
        "max_tokens": args.max_tokens, "stream": stream, "requests": args.requests, "warmup": args.warmup,
        "transport": endpoint.split("://")[0], "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "loadavg": f"{loadavg_start} at the start, {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end",
        "http": http_url is not None, "openai": _openai_version() if http_url is not None else None,
        "overhead": overhead, "command": " ".join(["tools/loadgen.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "loadgen" + (f"-{args.tag}" if args.tag else "")
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    (out / f"{stem}.md").write_text(render_markdown(meta, rows))
    print(render_markdown(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
