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
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_runtime.chat import encode_prompt  # noqa: E402
from edge_runtime.lora import LoraSettings  # noqa: E402
from edge_runtime.model.llama import ATTN_TARGETS, MLP_TARGETS  # noqa: E402
from edge_runtime.model.weights import load_llama  # noqa: E402
from edge_runtime.train import AdapterTrainer, DPOSettings, PreferenceRecord  # noqa: E402
from edge_runtime.train.batch_decode import BatchDecode  # noqa: E402
from edge_runtime.train.degeneration import degeneration_metrics, distinct_n, words  # noqa: E402
from edge_runtime.train.guard import RegressionGuard  # noqa: E402
from edge_runtime.train.optim import OptimizerSettings  # noqa: E402
from edge_runtime.train.pairs import PairTokens, tokenize_pair  # noqa: E402
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


def strip_word(text: str, word: str) -> str:
    """The answer without the user's opening word (what is left of the content)."""
    body = re.sub(rf"^\s*{re.escape(word)}\b[,.!;:]?\s*", "", text)
    return body[:1].upper() + body[1:]


def judge(answers: Sequence[str], base: Sequence[str], user: EditingUser) -> dict[str, Any]:
    """Beside the bar's figures: distinct-2 of the answers with the word stripped, and of the base
    answers with the word prepended (what the metric charges for the preference itself), the
    answers' length and their most common opening (a template shows as one opening many times)."""
    def d2(texts: Sequence[str]) -> float:
        return distinct_n([words(a) for a in texts], 2)

    def vs(x: float, y: float) -> float | None:
        return round(x / y - 1, 4) if y else None

    b2 = d2(base)
    openings = Counter(" ".join(words(strip_word(a, user.word))[:3]) for a in answers)
    top, top_n = openings.most_common(1)[0] if openings else ("", 0)
    return {"with_word": sum(a.lstrip().startswith(f"{user.word},") for a in answers),
            "repeats_3plus": sum(user.repeats(a) >= 3 for a in answers), "n": len(answers),
            "distinct_2_vs_base": vs(d2(answers), b2),
            "distinct_2_stripped_vs_base": vs(d2([strip_word(a, user.word) for a in answers]), b2),
            "base_with_word_vs_base": vs(d2([user.edit(a) or a for a in base]), b2),
            "words_per_answer": round(sum(len(words(a)) for a in answers) / max(1, len(answers)), 1),
            "base_words_per_answer": round(sum(len(words(a)) for a in base) / max(1, len(base)), 1),
            "top_opening": top, "top_opening_n": top_n}


def probe(trainer: AdapterTrainer, pairs: Sequence[PairTokens]) -> dict[str, float]:
    """Log-prob change per token, adapter against reference, of the held-out base answers with the
    word prepended (chosen) and as they were (rejected): whole answers, never trimmed. A falling
    chosen with a rising margin is likelihood displacement (the shared content pushed down)."""
    dc = dr = 0.0
    nc = nr = 0
    for t in pairs:
        pc, pr = trainer.policy_logps(t, trainer.weights)
        rc, rr = trainer.reference_logps(t)
        dc, dr, nc, nr = dc + pc - rc, dr + pr - rr, nc + len(t.chosen), nr + len(t.rejected)
    return {"heldout_chosen_dlogp_per_token": round(dc / max(1, nc), 4),
            "heldout_rejected_dlogp_per_token": round(dr / max(1, nr), 4)}


# What one configuration may set (`--config key=value,...`), with the defaults of the old flags.
CONFIG_KEYS = {"lr": float, "beta": float, "rpo": float, "rank": int, "trim": int, "mlp": int, "wd": float,
               "replay": int, "seed": int}


def parse_config(text: str, args: argparse.Namespace) -> dict[str, Any]:
    cfg: dict[str, Any] = {"lr": args.lr[0], "beta": args.beta[0], "rpo": args.rpo_alpha[0], "rank": args.rank,
                           "trim": 0, "mlp": 0, "wd": 0.0, "replay": 0, "seed": 0}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in CONFIG_KEYS:
            raise SystemExit(f"unknown config key {key!r}; known: {', '.join(CONFIG_KEYS)}")
        cfg[key] = CONFIG_KEYS[key](value)
    return cfg


def label(cfg: dict[str, Any]) -> str:
    return ",".join(f"{k}={cfg[k]:g}" if isinstance(cfg[k], float) else f"{k}={cfg[k]}" for k in CONFIG_KEYS)


def run_user(model: Any, tokenizer: Any, word: str, cfg: dict[str, Any], args: argparse.Namespace,
             seed: int) -> dict[str, Any]:
    """`cfg`: lr, beta, rpo (RPO's alpha), rank, trim (train on where the pair differs only),
    mlp (LoRA on the MLP projections too), wd (AdamW weight decay), replay (after each new pair,
    that many more steps on pairs drawn from the last 8), seed (added to the user's seed)."""
    targets = ATTN_TARGETS + (MLP_TARGETS if cfg["mlp"] else ())
    seed += cfg["seed"]
    trainer = AdapterTrainer(model, tokenizer, LoraSettings(rank=cfg["rank"], alpha=2.0 * cfg["rank"], target_modules=targets),
                             DPOSettings(beta=cfg["beta"], rpo_alpha=cfg["rpo"], trim_shared_suffix=bool(cfg["trim"]), seed=seed,
                                         optimizer=OptimizerSettings(learning_rate=cfg["lr"], weight_decay=cfg["wd"])))
    user = EditingUser(f"u-{word.lower()}", word)
    pool, heldout = questions(seed, args.heldout)
    held_ids = [tuple(encode_prompt(tokenizer, chat(q))[1]) for q in heldout]
    guard = RegressionGuard(degeneration_prompts=args.guard_prompts, degeneration_tokens=args.guard_tokens)
    guard_ids = held_ids[: args.guard_prompts]
    base = _answers(trainer, held_ids, False, args.eval_tokens)
    probes = [tokenize_pair(tokenizer, PreferenceRecord(tuple(chat(q)), user.edit(a) or a, a))
              for q, a in zip(heldout, base, strict=True)]
    history: list[dict[str, Any]] = []
    trained: list[dict[str, float]] = []
    recent: list[PreferenceRecord] = []
    rng = random.Random(seed)
    pairs, asks, t0, train_s = 0, 0, time.perf_counter(), 0.0
    # Questions are asked `--ask-batch` at a time under the adapter as it stands (as served
    # traffic is answered while earlier edits still train), then each edit trains in turn.
    questions_left = itertools.cycle(pool)

    def measure() -> None:
        held = _answers(trainer, held_ids, True, args.eval_tokens)
        row: dict[str, Any] = {"pairs": pairs, "asks": asks, **judge(held, base, user), **probe(trainer, probes),
                               "answers": held if args.show_answers else held[:4]}
        d, _ = degeneration_metrics(model, tokenizer, guard_ids, trainer.policy(trainer.weights), None,
                                    args.guard_tokens, guard.kl_skip_tokens)
        row.update(guard_kl=round(d.kl_per_token, 3), guard_distinct_2_drop=round(d.distinct_2_drop, 3),
                   guard_accepts=not guard.degenerated(d))
        history.append(row)
        print(json.dumps({"word": word, "config": label(cfg), **row}), flush=True)
        if args.show_answers:
            for b, a in zip(base, held, strict=True):
                print(f"  base: {b!r}\n   now: {a!r}", file=sys.stderr, flush=True)

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
            record = PreferenceRecord(tuple(chat(q)), edited, answer)
            r = trainer.task(record, score=False).run()
            recent = (recent + [record])[-8:]
            for _ in range(cfg["replay"]):
                trainer.task(rng.choice(recent), score=False).run()
            train_s += time.perf_counter() - t1
            pairs += 1
            trained.append({"chosen_logratio": round(r.chosen_logratio, 3), "rejected_logratio": round(r.rejected_logratio, 3),
                            "chosen_tokens": r.chosen_tokens})
            print(f"{word} {label(cfg)}: pair {pairs} trained ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
            if pairs % args.eval_every == 0 or pairs == args.pairs:
                measure()
    if not history or history[-1]["pairs"] != pairs:
        measure()  # the edits ran out before the next measurement
    return {"word": word, "config": label(cfg), **cfg, "rpo_alpha": cfg["rpo"], "base_answers": base if args.show_answers else base[:4],
            "pairs": pairs, "asks": asks, "history": history, "trained_pairs": trained,
            "train_s_per_pair": round(train_s / max(1, pairs), 3), "wall_s": round(time.perf_counter() - t0, 1)}


def markdown(result: dict[str, Any]) -> str:
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:+.1f}%"

    rows = []
    for r in result["runs"]:
        cfg = r.get("config") or f"lr={r['lr']:g},beta={r['beta']:g},rpo={r.get('rpo_alpha', 0.0):g},rank={r.get('rank', 8)}"
        for h in r["history"]:
            rows.append([cfg, r["word"], h["pairs"], h["asks"], f"{h['with_word']}/{h['n']}", f"{h['repeats_3plus']}/{h['n']}",
                         pct(h["distinct_2_vs_base"]), pct(h.get("distinct_2_stripped_vs_base")), pct(h.get("base_with_word_vs_base")),
                         f"{h.get('words_per_answer', '-')} ({h.get('base_words_per_answer', '-')})",
                         f"{h.get('top_opening_n', '-')}: {h.get('top_opening', '')}",
                         f"{h.get('heldout_chosen_dlogp_per_token', '-')} / {h.get('heldout_rejected_dlogp_per_token', '-')}",
                         f"{h['guard_kl']:.3f}", f"{100 * h['guard_distinct_2_drop']:.0f}%", "yes" if h["guard_accepts"] else "no"])
    head = ["config", "user", "pairs", "questions asked", "held-out with word", ">=3 repeats", "distinct-2 vs base",
            "distinct-2, word stripped, vs base", "base + word vs base", "words/answer (base)", "most common opening",
            "held-out dlogp/token chosen / rejected", f"guard KL ({result['settings']['guard_prompts']} prompts)",
            "guard distinct-2 drop", "guard accepts"]
    return "\n".join([
        "# Fine-tune defaults sweep (edit feedback, preferred opening word)", "",
        f"`{result['command']}`", "",
        f"Default model, fp32 torch, one AdamW step per pair (plus `replay`), LoRA alpha = 2 x rank; held-out: {result['settings']['heldout']} "
        f"questions, greedy, {result['settings']['eval_tokens']} tokens. Load average at start/end: "
        f"{result['load_start']} / {result.get('load_end')}.", "",
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
            config = row.pop("config", None) or label(parse_config(
                f"lr={row.pop('lr')},beta={row.pop('beta')},rpo={row.pop('rpo_alpha', 0.0)}", args))
            runs.setdefault((str(path), row.pop("word"), config), []).append(row)
    return {"command": " ; ".join(args.note or []), "settings": vars(args) | {"out": str(args.out), "from_logs": [str(p) for p in paths]},
            "load_start": args.load or "not recorded", "load_end": load_average(),
            "runs": [{"word": w, "config": c, "log": p, "history": h} for (p, w, c), h in runs.items()]}


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
    p.add_argument("--config", action="append",
                   help="one configuration as key=value,... (keys: " + ", ".join(CONFIG_KEYS) + "); repeatable; "
                        "instead of the product of --lr, --beta, --rpo-alpha")
    p.add_argument("--show-answers", action="store_true",
                   help="print every held-out answer beside the base's at each measurement, and keep them all")
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
    configs = [parse_config(c, args) for c in args.config] if args.config else [
        parse_config(f"lr={lr},beta={beta},rpo={a}", args) for lr, beta, a in itertools.product(args.lr, args.beta, args.rpo_alpha)]
    for cfg in configs:
        for seed, word in enumerate(args.words):
            result["runs"].append(run_user(model, tokenizer, word, cfg, args, seed))
            result["load_end"] = load_average()
            args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
            args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
