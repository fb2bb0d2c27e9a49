"""Where one guarded publish's engine time goes: the publish guard's staged evaluation of one
candidate adapter on the default model, in process, timed stage by stage and grouped by what the
stage computes (the candidate's held-out log-probs, the served version's, the reference's greedy
answers, the candidate's, the KL forward), with rows and tokens, for 8, 16, 32 held-out pairs.

    .venv/bin/python tools/guard_cost.py --heldout 8,16,32 --out tools/results/guard_cost

The held-out pairs are what `tools/alignment_edit.py`'s editing user makes of the model's own
greedy answers ("Indeed, " in front). The served version and the candidate are two adapters a few
DPO steps apart. Each size is measured twice in a row on the same trainer: "first" (the served
version's metrics and the reference's answers not known yet, as after the held-out set grew) and
"next" (a second candidate on the same held-out set). Runs of the sizes alternate (`--rounds`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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
            guard: RegressionGuard, served_metrics: Any) -> tuple[dict[str, Any], Any]:
    evaluation = guard_evaluation(registry, trainer, "user1", heldout, guard, served_metrics=served_metrics)
    per: dict[str, dict[str, float]] = defaultdict(lambda: {"seconds": 0.0, "stages": 0})
    t0 = time.perf_counter()
    while not evaluation.done:
        stage = evaluation.run_next()
        g = per[group(stage.name)]
        g["seconds"] += stage.seconds or 0.0
        g["stages"] += 1
    wall = time.perf_counter() - t0
    decision = evaluation.decision()
    return {"wall_s": round(wall, 3), "stages": len(evaluation.stages), "accepted": decision.accepted,
            "prompts": len(evaluation.prompts), "groups": {k: {"seconds": round(v["seconds"], 3),
                                                                 "stages": int(v["stages"])} for k, v in per.items()},
            "counts": getattr(evaluation, "work", None)}, decision


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heldout", default="8,16,32")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "guard_cost"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from edge_runtime.model.source import resolve_model

    path = str(resolve_model(None).path)
    model = load_llama(path, dtype=torch.float32)
    tokenizer = Tokenizer(path)
    s = FineTuneSettings()
    guard = RegressionGuard(degeneration_prompts=s.guard_prompts, degeneration_tokens=s.guard_tokens,
                            kl_budget=s.guard_kl_budget, distinct_2_drop=s.guard_distinct_2_drop)
    sizes = [int(x) for x in args.heldout.split(",")]
    load_start = load_average()
    pool = heldout_pairs(model, tokenizer, max(sizes) + 8, args.answer_tokens)
    train_pairs, pool = pool[:8], pool[8:]
    rows: list[dict[str, Any]] = []
    import tempfile

    for r in range(args.rounds):
        for n in sizes:
            with tempfile.TemporaryDirectory() as tmp:
                trainer = AdapterTrainer(model, tokenizer, dpo=DPOSettings(
                    beta=s.beta, rpo_alpha=s.rpo_alpha, optimizer=OptimizerSettings(learning_rate=s.learning_rate)))
                registry = AdapterRegistry(Path(tmp), model.cfg)
                for p in train_pairs[:4]:
                    trainer.task(p, score=False).run()
                trainer.flush()
                registry.publish("user1", trainer.snapshot())  # the served version
                for p in train_pairs[4:]:
                    trainer.task(p, score=False).run()
                trainer.flush()
                heldout = pool[:n]
                first, decision = measure(trainer, registry, heldout, guard, None)
                second, _ = measure(trainer, registry, heldout, guard, decision.before)
                for label, m in (("first", first), ("next", second)):
                    rows.append({"round": r, "heldout": n, "case": label, **m, "loadavg": load_average()})
                    print(rows[-1], flush=True)
    result = {"model": path, "threads": args.threads, "sizes": sizes, "guard": vars(guard) if hasattr(guard, "__dict__") else str(guard),
              "loadavg_start": load_start, "loadavg_end": load_average(), "rows": rows}
    write_json(f"{args.out}.json", result, indent=2, default=str)
    Path(f"{args.out}.md").write_text(markdown(result))


def markdown(result: dict[str, Any]) -> str:
    lines = ["# guard_cost: one candidate's guard evaluation, stage time by what it computes\n",
             f"Model `{result['model']}`, {result['threads']} thread(s); load {result['loadavg_start']} -> "
             f"{result['loadavg_end']}.\n"]
    groups = sorted({g for row in result["rows"] for g in row["groups"]})
    head = ["held-out", "case", "stages", "wall s"] + groups
    body = [[row["heldout"], row["case"], row["stages"], row["wall_s"]]
            + [f"{row['groups'][g]['seconds']:.2f} ({row['groups'][g]['stages']})" if g in row["groups"] else "-"
               for g in groups] for row in result["rows"]]
    lines.extend(markdown_table(head, body))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
