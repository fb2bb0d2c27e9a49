"""The prepared GPU check's report (tools/gpu_check.py): the merged step results as markdown, and
the short table printed last, with issue #33's bar judged from the figures that are there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BASELINE_1_STREAM = 31.0  # tok/s, tools/results/bench_engine_cuda_h100.md (the default model's shape)


def _rate(row: dict[str, Any], streams: str) -> float | None:
    value = row.get(streams)
    return value.get("decode_tok_s") if isinstance(value, dict) else None


def bar_lines(result: dict[str, Any]) -> list[str]:
    """Issue #33's bar, each line 'PASS' / 'FAIL' / 'n/a' with the figures it was judged on."""
    lines = []
    parity = (result.get("parity") or {}).get("rows", [])
    judged = [r for r in parity if "8 streams" in r]
    if judged:
        same = all(r["8 streams"]["identical"] and r["1 stream"]["identical"] for r in judged)
        graphs = (result.get("parity") or {}).get("cuda_graphs_setting")
        # Equal tokens prove nothing where no step was replayed (a CPU, graphs that broke).
        replayed = [r for r in judged if isinstance(r.get("graphs_on_stats_plain"), dict)
                    and r["graphs_on_stats_plain"].get("replayed", 0) > 0]
        verdict = ("PASS" if same else "FAIL") if graphs and len(replayed) == len(judged) else "n/a "
        why = ("" if verdict != "n/a " else " (this build has no cuda_graphs setting: both engines ran eager)"
               if not graphs else f" (steps replayed on {len(replayed)} of them only; tokens equal: {same})")
        lines.append(f"{verdict} greedy tokens graph-replayed == eager on {len(judged)} models{why}")
    else:
        lines.append("n/a  greedy parity: no parity rows")
    counts = (result.get("tests") or {}).get("counts") or {}
    if counts and not counts.get("passed") and not counts.get("failures") and not counts.get("errors"):
        lines.append(f"n/a  CUDA tests: none ran here (all skipped: no GPU?): {counts}")
    elif counts:
        ok = counts.get("failures", 0) + counts.get("errors", 0) == 0 and counts.get("passed", 0) > 0
        lines.append(f"{'PASS' if ok else 'FAIL'} CUDA tests: {counts}")
    else:
        lines.append(f"n/a  CUDA tests: {(result.get('tests') or {}).get('summary', 'did not run')}")
    rows = (result.get("bench") or {}).get("rows", [])
    by = {(r.get("model"), r.get("runtime")): r for r in rows}
    smol = by.get(("smollm2-135m bf16", "ours"))
    if smol and _rate(smol, "1"):
        rate = _rate(smol, "1")
        lines.append(f"{'PASS' if rate >= 10 * BASELINE_1_STREAM else 'FAIL'} default shape, 1 stream: {rate} tok/s "
                     f"vs 10 x {BASELINE_1_STREAM}")
    hf = next((r for r in rows if r.get("model") == "llama-3.2-1b bf16" and "transformers" in str(r.get("runtime"))), None)
    ours_1b = [r for r in rows if r.get("runtime") == "ours" and str(r.get("model", "")).startswith("llama-3.2-1b")
               and _rate(r, "1")]
    if hf and _rate(hf, "1") and ours_1b:
        best = max(ours_1b, key=lambda r: _rate(r, "1"))
        lines.append(f"{'PASS' if _rate(best, '1') >= _rate(hf, '1') else 'FAIL'} 1B, 1 stream: ours {_rate(best, '1')} "
                     f"({best['model']}) vs transformers compiled {_rate(hf, '1')} tok/s")
    q4 = by.get(("llama-3.2-1b q4_k_m", "ours"))
    if q4 and q4.get("roofline_pct_1") is not None:
        lines.append(f"{'PASS' if q4['roofline_pct_1'] >= 50 else 'FAIL'} 1B 4-bit, 1 stream: {_rate(q4, '1')} tok/s = "
                     f"{q4['roofline_pct_1']}% of the roofline {q4['roofline_tok_s']}")
    for r in (result.get("train") or {}).get("rows", []):
        ratio = r.get("measured_over_predicted")
        if ratio is not None:
            lines.append(f"{'PASS' if abs(ratio - 1) <= 0.10 else 'FAIL'} DPO pair {r['model']}: {r['seconds']} s, "
                         f"peak {r['measured_pair_peak_mib']} MiB vs ledger {r['predicted_pair_peak_mib']} MiB "
                         f"(x{ratio})")
    return lines


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The short table printed last (the device reply shows only the end of the output)."""
    env = result.get("env") or {}
    measure = result.get("measure") or {}
    lines = ["", "== GPU check summary ==",
             f"device: {env.get('gpu') or 'cpu'}; torch {env.get('packages', {}).get('torch')}, "
             f"triton {env.get('packages', {}).get('triton')}, transformers {env.get('packages', {}).get('transformers')}; "
             f"missing: {env.get('missing') or 'none'}; project imports: {env.get('project_imports')}",
             f"copy bandwidth {measure.get('copy_bandwidth_gb_s')} GB/s (read+write); tiny launch "
             f"{measure.get('launch_us')} us"]
    for step, info in ((result.get("status") or {}).get("steps") or {}).items():
        lines.append(f"  step {step:8s} {info.get('status')} ({info.get('seconds', 0)} s)")
    tests = result.get("tests") or {}
    lines.append(f"tests: {tests.get('counts')} {tests.get('summary', '')}")
    lines += [f"  {line}"[:240] for line in str(tests.get("tail", "")).splitlines()
              if line.startswith(("FAILED", "ERROR"))][:12]
    streams = str((result.get("bench") or {}).get("streams", 16))
    lines.append(f"{'model':22s} {'runtime':12s} {'1 stream':>9s} {streams + ' streams':>10s} {'roofline':>9s} {'%':>6s}")
    for r in (result.get("bench") or {}).get("rows", []):
        runtime = "transformers" if "transformers" in str(r.get("runtime")) else str(r.get("runtime"))
        if "error" in r or "skipped" in r:
            lines.append(f"{r.get('model', ''):22s} {runtime:12s} {r.get('error') or r.get('skipped')}"[:200])
            continue
        lines.append(f"{r['model']:22s} {runtime:12s} {_rate(r, '1') or '':>9} {_rate(r, streams) or '':>10} "
                     f"{r.get('roofline_tok_s', ''):>9} {r.get('roofline_pct_1', ''):>6}"
                     + (f"  compile {r['compile_s']} s" if "compile_s" in r else ""))
    for r in (result.get("parity") or {}).get("rows", []):
        if "8 streams" in r:
            lp = r.get("8 streams, logprobs") or {}
            lines.append(f"parity {r['model']}: {r['8 streams']['streams']} streams {r['8 streams']['identical_streams']} "
                         f"identical, 1 stream {r['1 stream']['identical']}; with logprobs "
                         f"{lp.get('identical_streams')} identical, max |dlogprob| {lp.get('max_abs_logprob_diff')}, "
                         f"margins at splits {lp.get('eager_top2_margin_at_divergence')}")
        else:
            lines.append(f"parity {r.get('model')}: {r.get('error') or r.get('skipped')}"[:200])
    for r in (result.get("train") or {}).get("rows", []):
        lines.append(f"train {r.get('model')}: " + (str(r.get("error") or r.get("skipped")) if "stages" not in r else
                     f"{r['seconds']} s, {len(r['stages'])} stages, peak {r['measured_pair_peak_mib']} MiB vs ledger "
                     f"{r['predicted_pair_peak_mib']} MiB, error {r['error']}")[:300])
    kernels = result.get("kernels") or {}
    for k in kernels.get("results", []):
        lines.append(f"kernel {k['name']:14s} {k['format']:5s} M={k['rows']:2d}: {k['kernel_us']} us, "
                     f"{k['kernel_GBps']} GB/s ({k.get('of_copy')} of copy), torch {k['torch_us']} us")
    if not kernels.get("results"):
        lines.append(f"kernels: {kernels.get('error') or kernels.get('skipped') or 'did not run'}")
    lines += ["-- bar --", *bar_lines(result)]
    return lines


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


def write_markdown(result: dict[str, Any], path: Path) -> None:
    env = result.get("env") or {}
    measure = result.get("measure") or {}
    status = result.get("status") or {}
    bench = result.get("bench") or {}
    streams = str(bench.get("streams", 16))
    lines = [f"# GPU check: {env.get('gpu') or 'CPU (smoke)'}", "",
             "Command: `tools/gpu_check.sh` (python tools/gpu_check.py --device cuda); random weights built on the "
             "machine (tools/random_weights_copy.py, tools/bench_scale.py's build_model_dir, tools/make_gguf.py).", "",
             f"- started {status.get('started')}, total {status.get('total_s')} s, smoke: {status.get('smoke')}",
             f"- python {env.get('python')}, packages {env.get('packages')}, missing {env.get('missing') or 'none'}",
             f"- nvidia-smi: {env.get('nvidia_smi')}; {env.get('cpus')} CPUs; load {env.get('loadavg')}",
             f"- copy bandwidth {measure.get('copy_bandwidth_gb_s')} GB/s (bytes read + written, median of "
             f"{measure.get('copy_samples')} copies of {measure.get('copy_bytes')} bytes); tiny kernel launch "
             f"{measure.get('launch_us')} us", "", "## Steps", "", "| step | status | seconds |", "|---|---|---|"]
    lines += [f"| {k} | {v.get('status')} | {v.get('seconds', '')} |" for k, v in (status.get("steps") or {}).items()]
    tests = result.get("tests") or {}
    lines += ["", f"CUDA tests (`pytest -m gpu` over {tests.get('files')}): {tests.get('counts')} {tests.get('summary', '')}"]
    lines += ["", "## Models built here", "", "| model | bytes | build s | error |", "|---|---|---|---|"]
    for m in (result.get("models") or {}).get("models", []):
        lines.append(f"| {m['name']} | {_cell(m.get('bytes'))} | {m.get('build_s')} | {_cell(m.get('error'))} |")
    for c in result.get("conversions") or []:
        lines.append(f"- {c['model']} read into the model cache (in the background, beside the CUDA tests) in "
                     f"{c['seconds']:.1f} s: {c['cache']}")
    lines += ["", f"## Decode ({bench.get('tokens')} tokens per stream, greedy)", "",
              "Roofline: bytes of weights one decode step reads (every matrix once, the LM head whole) / the copy "
              "bandwidth above.", "",
              f"| model | runtime | 1 stream tok/s | {streams} streams tok/s | weight bytes/token | roofline tok/s | "
              "% of roofline (1 stream) | compile s | graphs | error |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in bench.get("rows", []):
        lines.append(f"| {r.get('model')} | {r.get('runtime')} | {_cell(_rate(r, '1'))} | {_cell(_rate(r, streams))} | "
                     f"{_cell(r.get('weight_bytes_per_token'))} | {_cell(r.get('roofline_tok_s'))} | "
                     f"{_cell(r.get('roofline_pct_1'))} | {_cell(r.get('compile_s'))} | {_cell(r.get('cuda_graphs'))} | "
                     f"{_cell(r.get('error') or r.get('skipped'))} |")
    lines += ["", "## Graph-replayed vs eager decode (greedy, 8 prompts together and 1 alone)", "",
              "| model | 8 streams identical | 1 stream identical | max abs log-prob diff (with logprobs) | "
              "first divergence | eager top-2 margin at the splits (with logprobs) | error |", "|---|---|---|---|---|---|---|"]
    for r in (result.get("parity") or {}).get("rows", []):
        eight, one, lp = r.get("8 streams") or {}, r.get("1 stream") or {}, r.get("8 streams, logprobs") or {}
        lines.append(f"| {r.get('model')} | {_cell(eight.get('identical_streams'))}/{_cell(eight.get('streams'))} | "
                     f"{_cell(one.get('identical'))} | {_cell(lp.get('max_abs_logprob_diff'))} | "
                     f"{_cell(eight.get('first_divergence'))} | {_cell(lp.get('eager_top2_margin_at_divergence'))} | "
                     f"{_cell(r.get('error') or r.get('skipped'))} |")
    lines += ["", "Graph statistics (engine.stats()['cuda_graphs']) after the plain runs / after all: "
              + "; ".join(f"{r.get('model')}: {r.get('graphs_on_stats_plain')} / {r.get('graphs_on_stats')}"
                          for r in (result.get("parity") or {}).get("rows", []) if "graphs_on_stats" in r)]
    lines += ["", "## DPO pair, staged, on the device", "",
              "| model | seconds | stages | measured pair peak MiB | ledger's predicted MiB | ratio | loss | error |",
              "|---|---|---|---|---|---|---|---|"]
    for r in (result.get("train") or {}).get("rows", []):
        lines.append(f"| {r.get('model')} | {_cell(r.get('seconds'))} | {len(r.get('stages', []))} | "
                     f"{_cell(r.get('measured_pair_peak_mib'))} | {_cell(r.get('predicted_pair_peak_mib'))} | "
                     f"{_cell(r.get('measured_over_predicted'))} | {_cell(r.get('loss'))} | "
                     f"{_cell(r.get('error') or r.get('skipped'))} |")
    kernels = result.get("kernels") or {}
    lines += ["", "## Quantised-weight kernels (tools/bench_qweights_cuda.py)", ""]
    if kernels.get("results"):
        lines += [f"{kernels.get('device')}, {kernels.get('timing')}; copy {kernels.get('copy_GBps_read_plus_write')} GB/s", "",
                  "| matrix | format | rows | kernel us | GB/s | of copy | torch bf16 us | gemv us | max rel err |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {k['name']} | {k['format']} | {k['rows']} | {k['kernel_us']} | {k['kernel_GBps']} | "
                  f"{_cell(k.get('of_copy'))} | {k['torch_us']} | {_cell(k.get('gemv_us'))} | "
                  f"{k['max_rel_err_vs_torch']:.1e} |" for k in kernels["results"]]
    else:
        lines.append(str(kernels.get("error") or kernels.get("skipped") or "did not run"))
    lines += ["", "## Bar (issue #33)", "", *[f"- {b}" for b in bar_lines(result)], ""]
    path.write_text("\n".join(lines))


def write_png(result: dict[str, Any], path: Path) -> bool:
    """Decode tok/s per model and runtime at 1 and N streams, the roofline marked on the 1-stream
    bars; False where matplotlib is missing or there is nothing to draw."""
    rows = [r for r in (result.get("bench") or {}).get("rows", []) if _rate(r, "1")]
    if not rows:
        return False
    try:
        from tools.report import pyplot, save_figure

        plt = pyplot()
    except ImportError:
        return False
    streams = str((result.get("bench") or {}).get("streams", 16))
    labels = [f"{r['model']}\n{'transformers' if 'transformers' in str(r['runtime']) else 'ours'}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.5 * len(rows) + 2))
    for ax, key in ((axes[0], "1"), (axes[1], streams)):
        values = [_rate(r, key) or 0 for r in rows]
        bars = ax.barh(labels, values, color=["#999999" if "transformers" in str(r["runtime"]) else "#4c72b0"
                                             for r in rows])
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        if key == "1":
            for i, r in enumerate(rows):
                if r.get("roofline_tok_s"):
                    ax.plot([r["roofline_tok_s"]], [i], marker="|", color="red", markersize=14)
        ax.invert_yaxis()
        ax.set_xlabel("decode tokens/s")
        ax.set_title(f"{key} stream{'s' if key != '1' else ''}" + (" (red: weight-bandwidth roofline)" if key == "1" else ""))
    env = result.get("env") or {}
    fig.suptitle(f"Decode on {env.get('gpu') or 'CPU (smoke)'}")
    save_figure(fig, path)
    return True
