"""Where one guarded publish's engine time goes: the publish guard's staged evaluation of one
candidate adapter on the default model, in process, timed stage by stage and grouped by what the
stage computes (the candidate's held-out log-probs "after", the served version's "before", the
candidate's and the reference's greedy answers, the KL forward), for several held-out set sizes,
in one or more checkouts alternated (before/after a change):

    .venv/bin/python tools/guard_cost.py --heldout 16,32 --trees before=/tmp/base,after=. --out ...

The held-out pairs are what `tools/alignment_edit.py`'s editing user makes of the model's own
greedy answers ("Indeed, " in front). Per size, as the daemon meets it: a candidate judged on n-1
pairs (not timed: it leaves what the fine-tuner keeps), then "set grew by one" (a new candidate, one
new held-out pair) and "same set" (the next candidate, the same pairs), each given what the
fine-tuner of that checkout keeps between evaluations.
"""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# `--tree=DIR` (set by `--trees` for its child runs): import the project from another checkout.
TREE = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--tree=")), None)
if TREE:
    sys.path.insert(0, TREE)

from daemon.settings import FineTuneSettings  # noqa: E402
from edge_runtime.chat import encode_prompt  # noqa: E402
from edge_runtime.lora.registry import AdapterRegistry  # noqa: E402
from edge_runtime.model.tokenizer import Tokenizer  # noqa: E402
from edge_runtime.model.weights import load_llama  # noqa: E402
from edge_runtime.train import AdapterTrainer, DPOSettings, PreferenceRecord  # noqa: E402
from edge_runtime.train.batch_decode import BatchDecode  # noqa: E402
from edge_runtime.train.guard import RegressionGuard, guard_evaluation  # noqa: E402
from edge_runtime.train.optim import OptimizerSettings  # noqa: E402
from tools.alignment_edit import EditingUser, questions  # noqa: E402
from tools.report import RESULTS, load_average, markdown_table, write_json  # noqa: E402


def group(name: str) -> str:
    """A stage's name without its index: 'guard after[pair 3]' -> 'guard after (pairs)'."""
    head = name.split("[")[0].strip()
    return head


def heldout_pairs(model: Any, tokenizer: Tokenizer, n: int, tokens: int) -> list[PreferenceRecord]:
    user = EditingUser("user1", "Indeed")
    _, pool = questions(7, n)
    prompts = [({"role": "user", "content": q},) for q in pool[:n]]
    ids = [encode_prompt(tokenizer, list(p))[1] for p in prompts]
    run = BatchDecode(model, ids, None, tokens, tokenizer.eos_ids)
    run.prefill()
    run.decode(tokens)
    out = []
    for i, (prompt, answer) in enumerate(zip(prompts, run.ids, strict=True)):
        text = tokenizer.decode([t for t in answer if t not in tokenizer.eos_ids])
        chosen = user.edit(text) or f"Indeed, {text}"
        out.append(PreferenceRecord(prompt, chosen, text, pair_id=i))
    return out


def measure(trainer: AdapterTrainer, registry: AdapterRegistry, heldout: list[PreferenceRecord],
            guard: RegressionGuard, known: Any) -> tuple[dict[str, Any], Any]:
    """One candidate's evaluation as the daemon queues it: `known` is what the fine-tuner kept
    from the previous evaluation (this tree's form: served rows per pair, or the old whole-set
    metrics, None when the held-out set changed)."""
    rows_api = "served_rows" in inspect.signature(guard_evaluation).parameters
    extra = ({"served_rows": known} if rows_api else {"served_metrics": known})
    evaluation = guard_evaluation(registry, trainer, "user1", heldout, guard, **extra)
    per: dict[str, dict[str, float]] = defaultdict(lambda: {"seconds": 0.0, "stages": 0})
    t0 = time.perf_counter()
    while not evaluation.done:
        stage = evaluation.run_next()
        g = per[group(stage.name)]
        g["seconds"] += stage.seconds or 0.0
        g["stages"] += 1
    wall = time.perf_counter() - t0
    decision = evaluation.decision()
    kept = (evaluation.pair_rows["before"] if rows_api else decision.before)
    return {"wall_s": round(wall, 3), "stages": len(evaluation.stages), "accepted": decision.accepted,
            "prompts": len(evaluation.prompts), "pairs_judged": getattr(evaluation, "judged_pairs", len(heldout)),
            "groups": {k: {"seconds": round(v["seconds"], 3), "stages": int(v["stages"])} for k, v in per.items()}}, kept


def child(args: argparse.Namespace) -> None:
    """One tree's measurements, one JSON line per case on stdout."""
    torch.set_num_threads(args.threads)
    from edge_runtime.model.source import resolve_model

    path = str(resolve_model(None).path)
    model = load_llama(path, dtype=torch.float32)
    tokenizer = Tokenizer(path)
    s = FineTuneSettings()
    guard_args = {"degeneration_prompts": s.guard_prompts, "degeneration_tokens": s.guard_tokens,
                  "kl_budget": s.guard_kl_budget, "distinct_2_drop": s.guard_distinct_2_drop}
    if hasattr(s, "guard_pairs"):
        guard_args["max_heldout_pairs"] = s.guard_pairs
    guard = RegressionGuard(**guard_args)
    sizes = [int(x) for x in args.heldout.split(",")]
    pool = heldout_pairs(model, tokenizer, max(sizes) + 8, args.answer_tokens)
    train_pairs, pool = pool[:8], pool[8:]
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = AdapterTrainer(model, tokenizer, dpo=DPOSettings(
                beta=s.beta, rpo_alpha=s.rpo_alpha, optimizer=OptimizerSettings(learning_rate=s.learning_rate)))
            registry = AdapterRegistry(Path(tmp), model.cfg)
            for p in train_pairs[:4]:
                trainer.task(p, score=False).run()
            trainer.flush()
            registry.publish("user1", trainer.snapshot())  # the served version
            for p in train_pairs[4:6]:
                trainer.task(p, score=False).run()
            trainer.flush()
            # The previous candidate, judged before the newest held-out pair arrived (not timed).
            _, kept = measure(trainer, registry, pool[:n - 1], guard, None)
            trainer.task(train_pairs[6], score=False).run()
            trainer.flush()
            rows_api = "served_rows" in inspect.signature(guard_evaluation).parameters
            grew, kept = measure(trainer, registry, pool[:n], guard, kept if rows_api else None)
            trainer.task(train_pairs[7], score=False).run()
            trainer.flush()
            same, _ = measure(trainer, registry, pool[:n], guard, kept)
            for label, m in (("set grew by one", grew), ("same set", same)):
                print(json.dumps({"heldout": n, "case": label, **m, "loadavg": load_average()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heldout", default="8,16,32")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--trees", default=f"after={ROOT}",
                    help="NAME=DIR,...: checkouts to measure, alternated round by round")
    ap.add_argument("--tree", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(RESULTS / "guard_cost"))
    args = ap.parse_args()
    if args.tree:
        child(args)
        return
    trees = dict(item.split("=", 1) for item in args.trees.split(","))
    load_start = load_average()
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for name, tree in trees.items():
            cmd = [sys.executable, __file__, f"--tree={tree}", "--heldout", args.heldout,
                   "--answer-tokens", str(args.answer_tokens), "--threads", str(args.threads)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            for line in out.splitlines():
                if line.startswith("{"):
                    rows.append({"round": r, "tree": name, **json.loads(line)})
                    print(rows[-1], flush=True)
    result = {"trees": trees, "threads": args.threads, "sizes": args.heldout, "rounds": args.rounds,
              "loadavg_start": load_start, "loadavg_end": load_average(), "rows": rows}
    write_json(f"{args.out}.json", result, indent=2, default=str)
    Path(f"{args.out}.md").write_text(markdown(result))


def markdown(result: dict[str, Any]) -> str:
    lines = ["# guard_cost: one candidate's guard evaluation, stage seconds by what they compute\n",
             f"Default model, {result['threads']} thread(s), in process; trees {result['trees']} alternated "
             f"over {result['rounds']} round(s). Load average {result['loadavg_start']} -> {result['loadavg_end']} "
             "(a shared 2-core machine: compare rows of one round). Each cell: seconds (stages).\n"]
    groups = sorted({g for row in result["rows"] for g in row["groups"]})
    head = ["round", "tree", "held-out", "case", "judged", "stages", "stage s"] + groups
    body = [[row["round"], row["tree"], row["heldout"], row["case"], row["pairs_judged"], row["stages"],
             f"{sum(g['seconds'] for g in row['groups'].values()):.1f}"]
            + [f"{row['groups'][g]['seconds']:.2f} ({row['groups'][g]['stages']})" if g in row["groups"] else "-"
               for g in groups] for row in result["rows"]]
    lines.extend(markdown_table(head, body))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
