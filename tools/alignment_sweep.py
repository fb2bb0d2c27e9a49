"""In-process sweep of the fine-tune defaults (learning rate, DPO beta, RPO's NLL weight) on `--feedback edit`'s task:
a user who wants answers that begin with "Indeed," edits every answer that does not, one AdamW step
per pair (the daemon's rule), on the default model's fp32 torch weights; no daemon, no scheduler.

Each configuration trains a fresh adapter per user on `--pairs` edit pairs (the user's own greedy
answers to everyday questions, corrected by `alignment_edit.EditingUser.edit`) and measures the
held-out greedy answers every `--eval-every` pairs: how many begin with the word, how many repeat it
three or more times, distinct-2 (word bigrams) against the base's on the same prompts, and what the
publish guard's degeneration check (train/degeneration.py) says of the adapter.

    .venv/bin/python tools/alignment_sweep.py --lr 1e-4 2e-4 3e-4 --beta 0.1 --pairs 40
    # results: tools/results/alignment_sweep.{json,md}
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_runtime.chat import encode_prompt  # noqa: E402
from edge_runtime.lora import LoraSettings  # noqa: E402
from edge_runtime.model.weights import load_llama  # noqa: E402
from edge_runtime.train import AdapterTrainer, DPOSettings, PreferenceRecord  # noqa: E402
from edge_runtime.train.batch_decode import BatchDecode  # noqa: E402
from edge_runtime.train.degeneration import degeneration_metrics, distinct_n, words  # noqa: E402
from edge_runtime.train.guard import RegressionGuard  # noqa: E402
from edge_runtime.train.optim import OptimizerSettings  # noqa: E402
from tools.alignment_edit import EditingUser, chat, questions  # noqa: E402
from tools.report import RESULTS, load_average, markdown_table  # noqa: E402


def _answers(trainer: AdapterTrainer, prompts: Sequence[Sequence[int]], trained: bool, tokens: int,
             batch: int = 10) -> list[str]:
    lora = trainer.policy(trainer.weights) if trained else None
    out = []
    for i in range(0, len(prompts), batch):
        run = BatchDecode(trainer.model, prompts[i:i + batch], lora, tokens, trainer.tokenizer.eos_ids)
        run.prefill()
        run.decode(tokens)
        out += [trainer.tokenizer.decode([t for t in a if t not in trainer.tokenizer.eos_ids]) for a in run.ids]
    return out


def judge(answers: Sequence[str], base: Sequence[str], user: EditingUser) -> dict[str, Any]:
    d2 = distinct_n([words(a) for a in answers], 2)
    b2 = distinct_n([words(a) for a in base], 2)
    return {"with_word": sum(a.lstrip().startswith(f"{user.word},") for a in answers),
            "repeats_3plus": sum(user.repeats(a) >= 3 for a in answers), "n": len(answers),
            "distinct_2_vs_base": round(d2 / b2 - 1, 4) if b2 else None}


def run_user(model: Any, tokenizer: Any, word: str, lr: float, beta: float, args: argparse.Namespace,
             seed: int, rpo_alpha: float = 0.0) -> dict[str, Any]:
    trainer = AdapterTrainer(model, tokenizer, LoraSettings(rank=args.rank, alpha=2.0 * args.rank), DPOSettings(
        beta=beta, rpo_alpha=rpo_alpha, optimizer=OptimizerSettings(learning_rate=lr)))
    user = EditingUser(f"u-{word.lower()}", word)
    pool, heldout = questions(seed, args.heldout)
    held_ids = [tuple(encode_prompt(tokenizer, chat(q))[1]) for q in heldout]
    guard = RegressionGuard(degeneration_prompts=args.guard_prompts, degeneration_tokens=args.guard_tokens)
    guard_ids = held_ids[: args.guard_prompts]
    base = _answers(trainer, held_ids, False, args.eval_tokens)
    history: list[dict[str, Any]] = []
    pairs, asks, t0, train_s = 0, 0, time.perf_counter(), 0.0
    # Questions are asked `--ask-batch` at a time under the adapter as it stands (as served
    # traffic is answered while earlier edits still train), then each edit trains in turn.
    questions_left = itertools.cycle(pool)

    def measure() -> None:
        held = _answers(trainer, held_ids, True, args.eval_tokens)
        row: dict[str, Any] = {"pairs": pairs, "asks": asks, **judge(held, base, user), "answers": held[:4]}
        d, _ = degeneration_metrics(model, tokenizer, guard_ids, trainer.policy(trainer.weights), None,
                                    args.guard_tokens, guard.kl_skip_tokens)
        row.update(guard_kl=round(d.kl_per_token, 3), guard_distinct_2_drop=round(d.distinct_2_drop, 3),
                   guard_accepts=not guard.degenerated(d))
        history.append(row)
        print(json.dumps({"word": word, "lr": lr, "beta": beta, "rpo_alpha": rpo_alpha, **row}), flush=True)
        if len(history) == 1:
            print(json.dumps({"base_answers": base[:4]}), flush=True)

    # Stops at `--pairs` edits, or after 4x that many questions: a user whose answers already
    # begin with the word once gives no edit (the adapter has learned it), so edits run out.
    while pairs < args.pairs and asks < 4 * args.pairs:
        qs = [next(questions_left) for _ in range(args.ask_batch)]
        asks += len(qs)
        answers = _answers(trainer, [encode_prompt(tokenizer, chat(q))[1] for q in qs], True, args.max_tokens)
        for q, answer in zip(qs, answers, strict=True):
            edited = None if user.satisfied(answer) else user.edit(answer)
            if edited is None or pairs >= args.pairs:
                continue
            t1 = time.perf_counter()
            trainer.task(PreferenceRecord(tuple(chat(q)), edited, answer), score=False).run()
            train_s += time.perf_counter() - t1
            pairs += 1
            print(f"{word} lr {lr:g} beta {beta:g} rpo {rpo_alpha:g}: pair {pairs} trained ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
            if pairs % args.eval_every == 0 or pairs == args.pairs:
                measure()
    if not history or history[-1]["pairs"] != pairs:
        measure()  # the edits ran out before the next measurement
    return {"word": word, "lr": lr, "beta": beta, "rpo_alpha": rpo_alpha, "rank": args.rank, "base_answers": base[:4],
            "pairs": pairs, "asks": asks, "history": history,
            "train_s_per_pair": round(train_s / max(1, pairs), 3), "wall_s": round(time.perf_counter() - t0, 1)}


def markdown(result: dict[str, Any]) -> str:
    rows = []
    for r in result["runs"]:
        for h in r["history"]:
            rows.append([f"{r['lr']:g}", f"{r['beta']:g}", f"{r.get('rpo_alpha', 0.0):g}", r.get("rank", 8), r["word"], h["pairs"], h["asks"],
                         f"{h['with_word']}/{h['n']}",
                         f"{h['repeats_3plus']}/{h['n']}", f"{100 * (h['distinct_2_vs_base'] or 0):+.1f}%",
                         f"{h['guard_kl']:.3f}", f"{100 * h['guard_distinct_2_drop']:.0f}%",
                         "yes" if h["guard_accepts"] else "no"])
    head = ["lr", "beta", "rpo alpha", "rank", "user", "pairs", "questions asked", "held-out with word", ">=3 repeats", "distinct-2 vs base",
            f"guard KL ({result['settings']['guard_prompts']} prompts)", "guard distinct-2 drop", "guard accepts"]
    return "\n".join([
        "# Fine-tune defaults sweep (edit feedback, preferred opening word)", "",
        f"`{result['command']}`", "",
        f"Default model, fp32 torch, one AdamW step per pair, LoRA on the attention projections (alpha = 2 x rank); held-out: {result['settings']['heldout']} "
        f"questions, greedy, {result['settings']['eval_tokens']} tokens. Load average at start/end: "
        f"{result['load_start']} / {result['load_end']}.", "",
        *markdown_table(head, rows), ""])


def from_logs(paths: Sequence[Path], args: argparse.Namespace) -> dict[str, Any]:
    """The measurements runs printed (one JSON line each), for runs cut before they wrote their
    results (a busy machine's runs can outlast the time there is)."""
    runs: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line) if line.startswith("{") else {}
            if "word" not in row:
                continue
            key = (str(path), row.pop("word"), row.pop("lr"), row.pop("beta"), row.pop("rpo_alpha", 0.0))
            runs.setdefault(key, []).append(row)
    return {"command": " ; ".join(args.note or []), "settings": vars(args) | {"out": str(args.out), "from_logs": [str(p) for p in paths]},
            "load_start": args.load or "not recorded", "load_end": load_average(),
            "runs": [{"word": w, "lr": lr, "beta": b, "rpo_alpha": a, "rank": args.rank, "log": p, "history": h}
                     for (p, w, lr, b, a), h in runs.items()]}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lr", type=float, nargs="+", default=[1e-4, 2e-4, 3e-4])
    p.add_argument("--beta", type=float, nargs="+", default=[0.1])
    p.add_argument("--rpo-alpha", type=float, nargs="+", default=[0.0],
                   help="weight of the chosen answer's per-token NLL (RPO; 0: DPO alone)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--words", nargs="+", default=["Indeed", "Honestly"])
    p.add_argument("--pairs", type=int, default=40)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--ask-batch", type=int, default=4)
    p.add_argument("--heldout", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--eval-tokens", type=int, default=40)
    p.add_argument("--guard-prompts", type=int, default=12)
    p.add_argument("--guard-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS / "alignment_sweep")
    p.add_argument("--from-logs", type=Path, nargs="+", help="write the results from these runs' printed lines")
    p.add_argument("--note", nargs="+", help="with --from-logs: the commands that made the logs")
    p.add_argument("--load", help="with --from-logs: the load average when they started")
    args = p.parse_args(argv)
    if args.from_logs:
        result = from_logs(args.from_logs, args)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
        args.out.with_suffix(".md").write_text(markdown(result))
        print(markdown(result))
        return
    torch.set_num_threads(args.threads)
    from edge_runtime.model.source import resolve_model
    from edge_runtime.model.tokenizer import Tokenizer

    path = str(resolve_model(None).path)
    model, tokenizer = load_llama(path, dtype=torch.float32), Tokenizer(path)
    result: dict[str, Any] = {"command": "python tools/alignment_sweep.py " + " ".join(sys.argv[1:]),
                              "settings": vars(args) | {"out": str(args.out)}, "load_start": load_average(),
                              "runs": []}
    for lr, beta, rpo_alpha in itertools.product(args.lr, args.beta, args.rpo_alpha):
        for seed, word in enumerate(args.words):
            result["runs"].append(run_user(model, tokenizer, word, lr, beta, args, seed, rpo_alpha))
            result["load_end"] = load_average()
            args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
            args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
