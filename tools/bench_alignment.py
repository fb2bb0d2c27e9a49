"""Personalisation benchmark: online DPO of one user's LoRA adapter from simulated feedback on the
model's own answers, with an untouched user served from the same engine batches.

Each simulated user's preference is a known function of the text. The default, a sign-off (the
user wants answers that end with their phrase), is one that length does not decide: the preferred
answer is the longer one, so summed log-probs start against it. Each round the engine samples two
candidates per prompt under the trained user's newest adapter version; the user picks the one that
ends with the sign-off, or edits an answer to add it (the feedback store's "choice" and "edit"
rules). Every pair runs through the staged DPO task; at checkpoints the adapter is published
through the regression guard and both users are measured: held-out win rate and CLPD (MACE sec.
3.1) and the share of greedy generations that satisfy the preference (plotted like MACE Fig. 2).

    .venv/bin/python tools/bench_alignment.py                    # default model, 100 pairs
    .venv/bin/python tools/bench_alignment.py --replay hh.jsonl  # replay local HH-RLHF/SHP pairs
    .venv/bin/python tools/bench_alignment.py --feedback thumbs  # lone thumbs only (KTO), 200

With `--feedback thumbs` the trained user gives only lone thumbs: one answer per prompt (sampled
under their newest adapter), thumbs up when it satisfies their hidden preference (the answer first:
it does not open with "The", as the base model's restatements do), down otherwise; no prompt is
asked twice. Every thumb is also recorded in a real feedback store, which shows what the pair rules
make of it; the adapter trains by staged KTO, guarded by the held-out desirable-vs-undesirable
margin (results: tools/results/bench_alignment_thumbs.*).

`--backend` builds the serving engine as the daemon does (`Engine.load`; default "auto", the
daemon's default: on a CPU, ONNX Runtime with int8 weights after a self-check against torch).
Everything the served model does (held-out candidates, each round's candidates, greedy answers,
the untouched user's check) runs on that backend; training reads the engine's fp32 torch weights,
as the daemon's trainer does, and publishes into the registry the backend serves from. Win rate
and CLPD are log-probs of the torch weights (what the daemon's regression guard computes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_runtime.backends.auto import BackendChoice  # noqa: E402
from edge_runtime.config import EngineConfig  # noqa: E402
from edge_runtime.engine import Engine  # noqa: E402
from edge_runtime.lora import LoraSettings  # noqa: E402
from edge_runtime.model.weights import load_llama  # noqa: E402
from edge_runtime.outputs import CandidateOutput, RequestOutput  # noqa: E402
from edge_runtime.sampling import SamplingParams  # noqa: E402
from edge_runtime.train import AdapterTrainer, DPOSettings, PreferenceRecord  # noqa: E402
from edge_runtime.train.costs import StageCostModel  # noqa: E402
from edge_runtime.train.dpo import AlignmentMetrics  # noqa: E402
from edge_runtime.train.guard import RegressionGuard, publish_guarded  # noqa: E402
from edge_runtime.train.kto import UnpairedMetrics  # noqa: E402
from edge_runtime.train.optim import OptimizerSettings  # noqa: E402
from edge_runtime.train.unpaired import UnpairedRecord  # noqa: E402
from tools.report import (  # noqa: E402
    RESULTS,
    load_average,
    markdown_table,
    peak_rss_mb,
    pyplot,
    save_figure,
    write_json,
)

# Short-answer questions (with BRIEF appended, ~90% of sampled answers end within 32 tokens), so
# a sign-off is visible. Items are split between training, held-out pairs and greedy evaluation.
BRIEF = " Answer in one short sentence."
FAMILIES: dict[str, tuple[str, list[str]]] = {
    "capital": ("What is the capital of {}?", [
        "France", "Japan", "Italy", "Spain", "Canada", "Egypt", "Kenya", "Peru", "Norway", "Germany", "Brazil",
        "India", "China", "Mexico", "Greece", "Turkey", "Sweden", "Poland", "Chile", "Cuba", "Ireland",
        "Portugal", "Austria", "Russia", "Thailand", "Vietnam", "Argentina", "Australia", "Finland",
        "Denmark", "Morocco", "Nigeria", "Ghana", "Iceland", "Hungary", "Belgium", "Colombia", "Iran",
        "Iraq", "Israel", "Jordan", "Nepal", "Pakistan", "Qatar", "Romania", "Scotland", "Senegal",
        "Switzerland", "Ukraine", "Venezuela", "Wales", "Zambia", "Bolivia", "Croatia", "Estonia",
        "Ethiopia", "Jamaica", "Kuwait", "Latvia", "Lebanon", "Malaysia", "Mongolia", "Netherlands",
        "Panama", "Paraguay", "Philippines", "Serbia", "Singapore", "Slovakia", "Sudan", "Syria", "Tunisia",
        "Uganda", "Uruguay", "Yemen", "Zimbabwe", "Algeria", "Angola", "Armenia", "Bulgaria"]),
    "legs": ("How many legs does a {} have?", [
        "dog", "cat", "bird", "ant", "horse", "cow", "duck", "spider", "beetle", "chicken", "goat", "sheep",
        "frog", "lion", "tiger", "bee", "fly", "crab", "pig", "rabbit", "mouse", "deer", "bear", "camel"]),
    "opposite": ("What is the opposite of the word '{}'?", [
        "hot", "fast", "happy", "up", "light", "early", "open", "strong", "tall", "rich", "full", "loud",
        "young", "wet", "hard", "clean", "inside", "left", "begin", "win", "buy", "push", "day", "north"]),
    "french": ("How do you say '{}' in French?", [
        "hello", "thank you", "cat", "water", "good night", "bread", "friend", "house", "dog", "apple",
        "book", "school", "sun", "moon", "car", "red", "blue", "cheese", "milk", "yes", "no", "please"]),
    "math": ("What is {}?", [
        "2 plus 3", "7 plus 5", "10 minus 4", "6 times 2", "9 plus 9", "12 minus 5", "3 times 3", "8 plus 1",
        "4 plus 4", "15 minus 7", "5 times 5", "20 minus 1", "11 plus 11", "6 plus 7", "9 minus 3",
        "2 times 8", "14 plus 6", "30 minus 10", "7 times 3", "100 minus 1"]),
}


@dataclass
class SignOffUser:
    """Wants a real answer signed off once with `phrase`; fixes an answer by signing it.

    Strict on purpose: a policy that spams the phrase, or answers with the phrase alone, does
    not satisfy this user (a lenient "ends with" check rewards that collapse)."""

    name: str
    phrase: str

    @property
    def preference(self) -> str:
        return f"an answer signed off once with {self.phrase!r}"

    def body(self, text: str) -> str:
        """The answer before the first sign-off (what this user would keep)."""
        return text.split(self.phrase, 1)[0].strip()

    def satisfied(self, text: str) -> bool:
        text = text.rstrip()
        return text.endswith(self.phrase) and text.count(self.phrase) == 1 and len(self.body(text).split()) >= 2

    def edit(self, text: str) -> str | None:
        body = self.body(text)
        return f"{body}\n\n{self.phrase}" if len(body.split()) >= 2 else None

    def judged(self, candidate: CandidateOutput) -> bool:
        """Finished answers are judged; a cut-off one only if it already shows the sign-off (then
        it is repeated or followed by more text, whatever the rest would have been)."""
        text = candidate.text.strip()
        return bool(text) and (candidate.finish_reason == "stop" or self.phrase in text)

    def feedback(self, prompt: tuple[dict[str, str], ...], candidates: Sequence[CandidateOutput]) -> PreferenceRecord | None:
        """Choice when the candidates differ on the preference, else an edit of one that lacks it."""
        judged = [c for c in candidates if self.judged(c)]
        good = [c for c in judged if self.satisfied(c.text)]
        bad = [c for c in judged if not self.satisfied(c.text)]
        if good and bad:
            return PreferenceRecord(prompt, good[0].text, bad[0].text)
        for candidate in bad:
            edited = self.edit(candidate.text)
            if edited is not None:
                return PreferenceRecord(prompt, edited, candidate.text)
        return None


# Second phrasings of each family's question: the thumbs user's training prompts are the training
# items in both phrasings (about 200 distinct prompts, none asked twice); held-out and evaluation
# items stay disjoint from them.
REPHRASED: dict[str, str] = {
    "capital": "Which city is the capital of {}?",
    "legs": "How many legs has a {} got?",
    "opposite": "Give the opposite of the word '{}'.",
    "french": "Translate '{}' into French.",
    "math": "Compute {}.",
}


@dataclass
class AnswerFirstUser:
    """Wants the answer first: a reply (two words or more) that does not open with `opener`, the
    restatement ("The capital of France is ...") the base model's greedy answers mostly start
    with. Gives one thumb per answer it is shown, and nothing else."""

    name: str
    opener: str = "The"

    @property
    def preference(self) -> str:
        return f"the answer first: a reply that does not open with {self.opener!r}"

    def satisfied(self, text: str) -> bool:
        text = text.strip()
        return len(text.split()) >= 2 and not text.startswith(self.opener)

    def thumb(self, prompt: Any, text: str) -> UnpairedRecord:
        return UnpairedRecord(prompt, text, self.satisfied(text))


def chat(text: str) -> tuple[dict[str, str], ...]:
    return ({"role": "user", "content": text},)


def split_prompts(seed: int, heldout_items: int, eval_items: int, rephrase: bool = False) -> tuple[list, list, list]:
    """Per family, items go to held-out pairs, greedy evaluation, or training (disjoint);
    `rephrase` adds each training item's second phrasing to the training prompts."""
    rng = random.Random(seed)
    train, heldout, evaluation = [], [], []
    for family, (template, items) in FAMILIES.items():
        items = items[:]
        rng.shuffle(items)
        share = len(items) / sum(len(v[1]) for v in FAMILIES.values())
        h = max(1, round(heldout_items * share))
        e = max(1, round(eval_items * share))
        heldout += [chat(template.format(x) + BRIEF) for x in items[:h]]
        evaluation += [chat(template.format(x) + BRIEF) for x in items[h:h + e]]
        train += [chat(template.format(x) + BRIEF) for x in items[h + e:]]
        if rephrase:
            train += [chat(REPHRASED[family].format(x) + BRIEF) for x in items[h + e:]]
    rng.shuffle(train)
    return train, heldout, evaluation


def run_requests(engine: Engine, prompts: Sequence[Any], params: SamplingParams, adapters: Sequence[str | None]) -> list[RequestOutput]:
    """All prompts in one continuous batch, each under its own adapter (None: base model)."""
    ids = [engine.add_request(list(p), params, adapter=a) for p, a in zip(prompts, adapters, strict=True)]
    done: dict[str, RequestOutput] = {}
    while len(done) < len(ids):
        for out in engine.step():
            done[out.request_id] = out
    return [done[i] for i in ids]


def build_pairs(user: SignOffUser, prompts: Sequence[Any], outputs: Sequence[RequestOutput]) -> list[PreferenceRecord]:
    pairs = [user.feedback(p, o.candidates) for p, o in zip(prompts, outputs, strict=True)]
    return [p for p in pairs if p is not None]


def train_to_the_end(task: Any, stage_seconds: dict[str, float]) -> tuple[float, int]:
    """Runs a fine-tune task's stages one after another; returns its wall seconds and the most
    bytes it held at once, and adds its seconds per stage kind to `stage_seconds`."""
    t = time.perf_counter()
    held = 0
    while not task.done:
        task.run_next()
        held = max(held, task.held_bytes)
    seconds = time.perf_counter() - t
    for kind, sec in task.seconds_by_kind().items():
        stage_seconds[kind] = stage_seconds.get(kind, 0.0) + sec
    return seconds, held


def serving_engine(args: argparse.Namespace, path: str) -> Engine:
    """The engine that serves both users, built as the daemon builds its own (`Engine.load`) on
    `--backend`, with fp32 torch weights (what the daemon loads on a CPU under "auto"; training
    reads them whichever backend serves)."""
    config = EngineConfig(dtype="float32", backend=args.backend, onnx_quantization=args.quantization,
                          num_threads=args.threads, kv_cache_bytes=args.kv_cache_mb << 20, max_num_seqs=64,
                          max_batched_tokens=512, policy=args.policy, cost_profile=args.cost_profile)
    engine = Engine.load(path, config)
    print(f"serving on {served_by(engine.backend_choice)}: {engine.backend_choice.reason}", flush=True)
    return engine


def served_by(choice: BackendChoice | dict[str, str]) -> str:
    """'onnxruntime (int8)', 'torch (fp32)': the backend that served and its weights."""
    c = choice.as_dict() if isinstance(choice, BackendChoice) else choice
    return f"{c['name']} ({'fp32' if c['quantization'] == 'none' else c['quantization']})"


def backend_record(engine: Engine) -> dict[str, Any]:
    return {**engine.backend_choice.as_dict(), "held_bytes": getattr(engine.backend, "held_bytes", 0)}


def degeneration_guard(args: argparse.Namespace) -> dict[str, Any]:
    """The guard's degeneration settings from the flags (the daemon's `finetune.guard_*`)."""
    return {"degeneration_prompts": args.guard_prompts, "degeneration_tokens": args.guard_tokens,
            "kl_budget": args.guard_kl_budget, "distinct_2_drop": args.guard_distinct_2_drop}


def degeneration_summary(publishes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The last publish's degeneration figures and how many candidates they refused."""
    judged = [p["degeneration"] for p in publishes if p.get("degeneration")]
    refused = sum(1 for p in publishes if not p["accepted"] and p.get("degeneration")
                  and ("KL from the base" in p["reason"] or "greedy answers repeat" in p["reason"]))
    return {"last_degeneration": judged[-1] if judged else None, "guard_degeneration_refusals": refused,
            "guard_degeneration_s_per_publish": round(sum(d["seconds"] for d in judged) / len(judged), 3)
            if judged else None}


def metrics_dict(m: AlignmentMetrics) -> dict[str, float]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in m.as_dict().items()}


def online(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()
    load_start = load_average()  # 1/5/15-minute; a shared machine slows every figure
    path = args.model or _default_model_path()
    engine = serving_engine(args, path)
    model = engine.model  # the trainer reads the engine's torch weights, as the daemon's does
    trained = SignOffUser(args.user, args.signoff)
    untouched = SignOffUser(args.untouched_user, args.untouched_signoff)
    costs = StageCostModel.profile(model, LoraSettings(rank=args.rank, alpha=2 * args.rank))
    trainer = AdapterTrainer(
        model, engine.tokenizer, LoraSettings(rank=args.rank, alpha=2 * args.rank),
        DPOSettings(beta=args.beta, window_tokens=args.window_tokens, layers_per_group=args.layers_per_group,
                    optimizer=OptimizerSettings(learning_rate=args.lr, accumulation_steps=args.accumulation)),
        costs=costs,
    )
    guard = RegressionGuard(args.guard_win_rate_tolerance, args.guard_clpd_tolerance, **degeneration_guard(args))
    train_prompts, heldout_prompts, eval_prompts = split_prompts(args.seed, args.heldout_prompts, args.eval_prompts)
    sample = SamplingParams(n=2, temperature=args.temperature, top_p=0.95, max_tokens=args.max_new_tokens, seed=args.seed)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.eval_new_tokens)

    # Held-out pairs from the base model's own answers, judged by each user; the first few of
    # the trained user's go to the guard, the rest measure alignment.
    t0 = time.perf_counter()
    base_outputs = run_requests(engine, heldout_prompts, sample, [None] * len(heldout_prompts))
    trained_pairs = build_pairs(trained, heldout_prompts, base_outputs)
    untouched_pairs = build_pairs(untouched, heldout_prompts, base_outputs)
    guard_pairs, trained_eval = trained_pairs[: args.guard_pairs], trained_pairs[args.guard_pairs:]
    setup_s = time.perf_counter() - t0
    print(f"held-out pairs: {len(trained_eval)} (+{len(guard_pairs)} guard) for {trained.name}, "
          f"{len(untouched_pairs)} for {untouched.name}; {setup_s:.0f}s", flush=True)

    history: list[dict[str, Any]] = []
    initial_untouched: list[list[int]] | None = None
    base_answers: list[str] | None = None  # the trained user's greedy answers before training
    eval_seconds = 0.0

    publishes: list[dict[str, Any]] = []
    served_metrics: AlignmentMetrics | None = None

    def publish(pairs_done: int) -> None:
        """Continuous retraining (MACE sec. 3.1): every round's update is offered to the guard,
        so the candidates of the next round come from (nearly) the policy being trained."""
        nonlocal served_metrics, eval_seconds
        t = time.perf_counter()
        trainer.flush()
        decision, ref = publish_guarded(engine.adapters, trainer, trained.name, guard_pairs, guard,
                                        served_metrics=served_metrics, trained_pairs=pairs_done)
        if decision.accepted:
            served_metrics = decision.after
        publishes.append({"pairs": pairs_done, "accepted": decision.accepted, "reason": decision.reason,
                          "version": None if ref is None else ref.version,
                          "before": decision.before and metrics_dict(decision.before),
                          "after": decision.after and metrics_dict(decision.after),
                          "degeneration": decision.degeneration and decision.degeneration.as_dict()})
        eval_seconds += time.perf_counter() - t

    def checkpoint(pairs_done: int) -> None:
        nonlocal initial_untouched, base_answers, eval_seconds
        t = time.perf_counter()
        record: dict[str, Any] = {"pairs": pairs_done}
        if publishes:
            record["guard"] = publishes[-1]
        served = engine.adapters.newest(trained.name)
        served_weights = None if served is None else engine.adapters.weights(served)
        t_score = time.perf_counter()
        m_trained = trainer.evaluate(trained_eval, served_weights)
        score_s = (time.perf_counter() - t_score) / max(1, len(trained_eval))
        m_untouched = trainer.evaluate(untouched_pairs, None)  # served by the base: no adapter
        # Both users' greedy answers in the same engine batches.
        outs = run_requests(engine, list(eval_prompts) * 2, greedy,
                            [trained.name] * len(eval_prompts) + [untouched.name] * len(eval_prompts))
        mine, theirs = outs[: len(eval_prompts)], outs[len(eval_prompts):]
        untouched_ids = [o.candidates[0].token_ids for o in theirs]
        if initial_untouched is None:
            initial_untouched = untouched_ids
            base_answers = [o.candidates[0].text.strip() for o in mine]
        # Personalised, not degenerate: the signed answer's body is still the base model's answer.
        kept = sum(trained.body(o.candidates[0].text) == b for o, b in zip(mine, base_answers, strict=True))
        record.update({
            "served_version": None if served is None else served.version,
            "trained": {**metrics_dict(m_trained),
                        "share": round(sum(trained.satisfied(o.candidates[0].text) for o in mine) / len(mine), 4),
                        "satisfied": sum(trained.satisfied(o.candidates[0].text) for o in mine),
                        "answers": len(mine),
                        "answer_kept": round(kept / len(mine), 4)},
            "untouched": {**metrics_dict(m_untouched),
                          "share": round(sum(untouched.satisfied(o.candidates[0].text) for o in theirs) / len(theirs), 4),
                          "satisfied": sum(untouched.satisfied(o.candidates[0].text) for o in theirs),
                          "answers": len(theirs),
                          "greedy_unchanged": untouched_ids == initial_untouched},
            "score_stage_s_per_pair": round(score_s, 4),
            "elapsed_s": round(time.perf_counter() - t_start, 1),
            "examples": [o.candidates[0].text for o in mine[:4]],
        })
        eval_seconds += time.perf_counter() - t
        history.append(record)
        tr, un = record["trained"], record["untouched"]
        print(f"[{pairs_done:4d} pairs] v{record['served_version']} {trained.name}: win {tr['win_rate']:.3f} "
              f"CLPD {tr['clpd']:+.2f} share {tr['share']:.2f} | {untouched.name}: win {un['win_rate']:.3f} "
              f"share {un['share']:.2f} unchanged {un['greedy_unchanged']} | {record['elapsed_s']:.0f}s", flush=True)
        print("    e.g.", record["examples"][:2], flush=True)

    checkpoint(0)
    pairs_done = 0
    train_seconds = 0.0
    generate_seconds = 0.0
    stage_seconds: dict[str, float] = {}
    rounds = 0
    cursor = 0
    max_held = 0
    next_checkpoint = args.eval_every
    while pairs_done < args.pairs and rounds < args.max_rounds:
        rounds += 1
        prompts = [train_prompts[(cursor + i) % len(train_prompts)] for i in range(args.round_prompts)]
        cursor += args.round_prompts
        t = time.perf_counter()
        fresh = SamplingParams(n=2, temperature=args.temperature, top_p=0.95, max_tokens=args.max_new_tokens,
                               seed=args.seed * 100_003 + rounds)  # new draws when prompts come round again
        outputs = run_requests(engine, prompts, fresh, [trained.name] * len(prompts))
        generate_seconds += time.perf_counter() - t
        for pair in build_pairs(trained, prompts, outputs):
            if pairs_done >= args.pairs:
                break
            seconds, held = train_to_the_end(trainer.task(pair, score=False), stage_seconds)
            train_seconds += seconds
            max_held = max(max_held, held)
            pairs_done += 1
        publish(pairs_done)
        if pairs_done >= next_checkpoint or pairs_done >= args.pairs:
            checkpoint(pairs_done)
            next_checkpoint = (pairs_done // args.eval_every + 1) * args.eval_every
    if history[-1]["pairs"] != pairs_done:
        checkpoint(pairs_done)

    first, last = history[0], history[-1]
    summary = {
        "pairs": pairs_done,
        "rounds": rounds,
        "versions_published": sum(p["accepted"] for p in publishes),
        "guard_rejections": sum(not p["accepted"] for p in publishes),
        **degeneration_summary(publishes),
        "base_win_rate": first["trained"]["win_rate"],
        "trained_win_rate": last["trained"]["win_rate"],
        "base_clpd": first["trained"]["clpd"],
        "trained_clpd": last["trained"]["clpd"],
        "base_share": first["trained"]["share"],
        "trained_share": last["trained"]["share"],
        "base_satisfied": f"{first['trained']['satisfied']}/{first['trained']['answers']}",
        "trained_satisfied": f"{last['trained']['satisfied']}/{last['trained']['answers']}",
        "base_answer_kept": first["trained"]["answer_kept"],
        "trained_answer_kept": last["trained"]["answer_kept"],
        "untouched_greedy_unchanged": all(h["untouched"]["greedy_unchanged"] for h in history),
        "train_s_per_pair": round(train_seconds / max(1, pairs_done), 3),
        "stage_s_per_pair": {k: round(v / max(1, pairs_done), 3) for k, v in stage_seconds.items()},
        "score_stage_s_per_pair": last["score_stage_s_per_pair"],
        "generate_s_per_pair": round(generate_seconds / max(1, pairs_done), 3),
        "wall_s_per_pair": round((time.perf_counter() - t_start - eval_seconds - setup_s) / max(1, pairs_done), 3),
        "total_s": round(time.perf_counter() - t_start, 1),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "max_activation_bytes_estimate": max_held,
        "adapter_state_bytes": trainer.persistent_bytes,
        "bar": {
            "win_rate_ge_0.85": last["trained"]["win_rate"] >= 0.85,
            "share_at_least_doubles": last["trained"]["share"] >= 2 * first["trained"]["share"] and last["trained"]["share"] > 0,
            "untouched_unchanged": all(h["untouched"]["greedy_unchanged"] for h in history),
        },
    }
    return {
        "mode": "online",
        "model": str(path),
        "settings": {k: v for k, v in vars(args).items() if k not in ("func",)},
        "users": {"trained": vars(trained) | {"preference": trained.preference},
                  "untouched": vars(untouched) | {"preference": untouched.preference}},
        "heldout_pairs": {"trained": len(trained_eval), "guard": len(guard_pairs), "untouched": len(untouched_pairs)},
        "backend": backend_record(engine),
        "threads": torch.get_num_threads(),
        "load_average": {"start": load_start, "end": load_average()},
        "cost_model": costs.as_dict(),
        "summary": summary,
        "history": history,
        "publishes": publishes,
        "adapter_events": engine.adapters.events(trained.name),
    }


def unpaired_dict(m: UnpairedMetrics) -> dict[str, float]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in m.as_dict().items()}


def record_thumbs_in_store(store: Any, user: str, thumbs: Sequence[tuple[Any, UnpairedRecord]], start: int) -> None:
    """Each thumb as the daemon records it: the interaction (one candidate), then the thumb."""
    from edge_runtime.feedback import Thumbs

    for i, (prompt, record) in enumerate(thumbs, start):
        request_id = f"thumb-{i}"
        store.record_interaction(user, request_id, json.dumps(list(prompt)), [record.completion], model="bench")
        store.record_feedback(user, request_id, Thumbs(candidate=0, up=record.desirable))


def store_counts(store: Any, user: str) -> dict[str, int]:
    """What the store holds for training from these thumbs: pairs (all the old code trains on)
    and, where this version has them, unpaired examples."""
    out = {"pairs": len(store.next_pairs(user, 100_000)) + len(store.heldout_pairs(user))}
    if hasattr(store, "next_unpaired"):
        out["unpaired"] = len(store.next_unpaired(user, 100_000)) + len(store.heldout_unpaired(user))
    return out


def online_thumbs(args: argparse.Namespace) -> dict[str, Any]:
    """Lone thumbs only: one sampled answer per new prompt, one thumb each, staged KTO."""
    import tempfile

    from edge_runtime.feedback import FeedbackStore

    torch.manual_seed(args.seed)
    t_start = time.perf_counter()
    load_start = load_average()
    path = args.model or _default_model_path()
    engine = serving_engine(args, path)
    model = engine.model
    trained = AnswerFirstUser(args.user)
    untouched = SignOffUser(args.untouched_user, args.untouched_signoff)
    lora = LoraSettings(rank=args.rank, alpha=2 * args.rank)
    costs = StageCostModel.profile(model, lora)
    trainer = AdapterTrainer(
        model, engine.tokenizer, lora,
        DPOSettings(beta=args.beta, kto_beta=args.beta, window_tokens=args.window_tokens,
                    layers_per_group=args.layers_per_group,
                    optimizer=OptimizerSettings(learning_rate=args.lr, accumulation_steps=args.accumulation)),
        costs=costs,
    )
    guard = RegressionGuard(args.guard_win_rate_tolerance, args.guard_clpd_tolerance,
                            margin_tolerance=args.guard_margin_tolerance, **degeneration_guard(args))
    train_prompts, heldout_prompts, eval_prompts = split_prompts(args.seed, args.heldout_prompts, args.eval_prompts,
                                                                 rephrase=True)
    if len(train_prompts) < args.thumbs:
        raise SystemExit(f"only {len(train_prompts)} distinct training prompts for {args.thumbs} thumbs")
    sample = SamplingParams(n=2, temperature=args.temperature, top_p=0.95, max_tokens=args.max_new_tokens,
                            seed=args.seed)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.eval_new_tokens)
    store_dir = Path(tempfile.mkdtemp(prefix="bench-thumbs-"))
    store = FeedbackStore(store_dir / "feedback.sqlite3", adapters_root=store_dir / "adapters")
    store.set_consent(trained.name, True)

    # Held-out thumbs: the trained user's verdicts on the base model's sampled answers to the
    # held-out prompts (two each); the first `guard_examples` guard publishing, the rest measure.
    t0 = time.perf_counter()
    base_outputs = run_requests(engine, heldout_prompts, sample, [None] * len(heldout_prompts))
    heldout = [trained.thumb(p, c.text) for p, o in zip(heldout_prompts, base_outputs, strict=True)
               for c in o.candidates if c.text.strip()]
    random.Random(args.seed).shuffle(heldout)
    guard_examples, heldout_eval = heldout[: args.guard_examples], heldout[args.guard_examples:]
    setup_s = time.perf_counter() - t0
    print(f"held-out thumbs: {len(heldout_eval)} (+{len(guard_examples)} guard), "
          f"{sum(e.desirable for e in heldout)} up; {setup_s:.0f}s", flush=True)

    history: list[dict[str, Any]] = []
    publishes: list[dict[str, Any]] = []
    initial_untouched: list[list[int]] | None = None
    served_unpaired: UnpairedMetrics | None = None
    eval_seconds = 0.0

    def publish(done: int) -> None:
        nonlocal served_unpaired, eval_seconds
        t = time.perf_counter()
        trainer.flush()
        decision, ref = publish_guarded(engine.adapters, trainer, trained.name, [], guard,
                                        heldout_unpaired=guard_examples, served_unpaired=served_unpaired,
                                        trained_thumbs=done)
        if decision.accepted:
            served_unpaired = decision.unpaired_after
        publishes.append({"thumbs": done, "accepted": decision.accepted, "reason": decision.reason,
                          "version": None if ref is None else ref.version,
                          "before": decision.unpaired_before and unpaired_dict(decision.unpaired_before),
                          "after": decision.unpaired_after and unpaired_dict(decision.unpaired_after),
                          "degeneration": decision.degeneration and decision.degeneration.as_dict()})
        eval_seconds += time.perf_counter() - t

    def checkpoint(done: int, thumbs_up: int) -> None:
        nonlocal initial_untouched, eval_seconds
        t = time.perf_counter()
        served = engine.adapters.newest(trained.name)
        served_weights = None if served is None else engine.adapters.weights(served)
        m = trainer.evaluate_unpaired(heldout_eval, served_weights)
        outs = run_requests(engine, list(eval_prompts) * 2, greedy,
                            [trained.name] * len(eval_prompts) + [untouched.name] * len(eval_prompts))
        mine, theirs = outs[: len(eval_prompts)], outs[len(eval_prompts):]
        untouched_ids = [o.candidates[0].token_ids for o in theirs]
        if initial_untouched is None:
            initial_untouched = untouched_ids
        satisfied = sum(trained.satisfied(o.candidates[0].text) for o in mine)
        record = {
            "thumbs": done, "thumbs_up": thumbs_up, "served_version": None if served is None else served.version,
            "guard": publishes[-1] if publishes else None,
            "trained": {**unpaired_dict(m), "share": round(satisfied / len(mine), 4), "satisfied": satisfied,
                        "answers": len(mine)},
            "untouched": {"share": round(sum(untouched.satisfied(o.candidates[0].text) for o in theirs) / len(theirs), 4),
                          "greedy_unchanged": untouched_ids == initial_untouched},
            "store": store_counts(store, trained.name),
            "elapsed_s": round(time.perf_counter() - t_start, 1),
            "examples": [o.candidates[0].text for o in mine[:6]],
        }
        eval_seconds += time.perf_counter() - t
        history.append(record)
        tr = record["trained"]
        print(f"[{done:4d} thumbs, {thumbs_up} up] v{record['served_version']} {trained.name}: margin "
              f"{tr['margin']:+.2f} acc {tr['accuracy']:.2f} share {tr['share']:.2f} | {untouched.name} unchanged "
              f"{record['untouched']['greedy_unchanged']} | store {record['store']} | {record['elapsed_s']:.0f}s",
              flush=True)
        print("    e.g.", record["examples"][:3], flush=True)

    checkpoint(0, 0)
    done = thumbs_up = rounds = max_held = 0
    train_seconds = generate_seconds = 0.0
    stage_seconds: dict[str, float] = {}
    next_checkpoint = args.eval_every
    while done < args.thumbs:
        rounds += 1
        prompts = train_prompts[done: min(args.thumbs, done + args.round_prompts)]  # each asked once
        t = time.perf_counter()
        fresh = SamplingParams(n=1, temperature=args.temperature, top_p=0.95, max_tokens=args.max_new_tokens,
                               seed=args.seed * 100_003 + rounds)
        outputs = run_requests(engine, prompts, fresh, [trained.name] * len(prompts))
        generate_seconds += time.perf_counter() - t
        thumbs = [(p, trained.thumb(p, o.candidates[0].text)) for p, o in zip(prompts, outputs, strict=True)]
        record_thumbs_in_store(store, trained.name, thumbs, done)
        for _, example in thumbs:
            if not example.completion.strip():
                done += 1  # an empty answer: thumbed, but nothing to learn from
                continue
            seconds, held = train_to_the_end(trainer.task(example, score=False), stage_seconds)
            train_seconds += seconds
            max_held = max(max_held, held)
            done += 1
            thumbs_up += example.desirable
        publish(done)
        if done >= next_checkpoint or done >= args.thumbs:
            checkpoint(done, thumbs_up)
            next_checkpoint = (done // args.eval_every + 1) * args.eval_every
    store.close()

    first, last = history[0], history[-1]
    summary = {
        "thumbs": done, "thumbs_up": thumbs_up, "rounds": rounds,
        "versions_published": sum(p["accepted"] for p in publishes),
        "guard_rejections": sum(not p["accepted"] for p in publishes),
        **degeneration_summary(publishes),
        "base_margin": first["trained"]["margin"], "trained_margin": last["trained"]["margin"],
        "base_accuracy": first["trained"]["accuracy"], "trained_accuracy": last["trained"]["accuracy"],
        "base_share": first["trained"]["share"], "trained_share": last["trained"]["share"],
        "base_satisfied": f"{first['trained']['satisfied']}/{first['trained']['answers']}",
        "trained_satisfied": f"{last['trained']['satisfied']}/{last['trained']['answers']}",
        "untouched_greedy_unchanged": all(h["untouched"]["greedy_unchanged"] for h in history),
        "store_after": last["store"],
        "old_path_pairs": last["store"]["pairs"],
        "train_s_per_thumb": round(train_seconds / max(1, done), 3),
        "stage_s_per_thumb": {k: round(v / max(1, done), 3) for k, v in stage_seconds.items()},
        "generate_s_per_thumb": round(generate_seconds / max(1, done), 3),
        "total_s": round(time.perf_counter() - t_start, 1),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "max_activation_bytes_estimate": max_held,
        "bar": {
            "share_at_least_doubles": last["trained"]["share"] >= 2 * first["trained"]["share"] > 0,
            "heldout_margin_up": last["trained"]["margin"] > first["trained"]["margin"],
            "untouched_unchanged": all(h["untouched"]["greedy_unchanged"] for h in history),
            "old_path_trains_nothing": last["store"]["pairs"] == 0,
        },
    }
    return {
        "mode": "thumbs", "model": str(path),
        "settings": {k: v for k, v in vars(args).items() if k not in ("func",)},
        "users": {"trained": vars(trained) | {"preference": trained.preference},
                  "untouched": vars(untouched) | {"preference": untouched.preference}},
        "heldout_thumbs": {"eval": len(heldout_eval), "guard": len(guard_examples),
                           "up": sum(e.desirable for e in heldout)},
        "backend": backend_record(engine),
        "threads": torch.get_num_threads(),
        "load_average": {"start": load_start, "end": load_average()},
        "summary": summary, "history": history, "publishes": publishes,
    }


def replay(args: argparse.Namespace) -> dict[str, Any]:
    """Train one user on the first `--pairs` records of a local HH-RLHF/SHP file; measure win
    rate and CLPD on the next `--heldout-pairs` records as training proceeds."""
    from edge_runtime.model.tokenizer import Tokenizer
    from edge_runtime.train.datasets import load_preferences

    path = args.model or _default_model_path()
    model = load_llama(path, dtype=torch.float32)
    data = load_preferences(args.replay, args.format, limit=args.pairs + args.heldout_prompts)
    train, heldout = data.records[: args.pairs], data.records[args.pairs:]
    if not train or not heldout:
        raise SystemExit(f"{args.replay}: need more than {args.pairs} usable pairs (got {len(data.records)})")
    trainer = AdapterTrainer(
        model, Tokenizer(path), LoraSettings(rank=args.rank, alpha=2 * args.rank),
        DPOSettings(beta=args.beta, window_tokens=args.window_tokens, layers_per_group=args.layers_per_group,
                    max_prompt_tokens=256, max_completion_tokens=128,
                    optimizer=OptimizerSettings(learning_rate=args.lr, accumulation_steps=args.accumulation)),
    )
    history = [{"pairs": 0, "trained": metrics_dict(trainer.evaluate(heldout, None))}]
    t0 = time.perf_counter()
    for i, pair in enumerate(train, 1):
        trainer.task(pair, score=False).run()
        if i % args.eval_every == 0 or i == len(train):
            trainer.flush()
            history.append({"pairs": i, "trained": metrics_dict(trainer.evaluate(heldout, trainer.weights)),
                            "elapsed_s": round(time.perf_counter() - t0, 1)})
            print(history[-1], flush=True)
    return {"mode": "replay", "file": str(args.replay), "format": data.format, "skipped": dict(data.skipped),
            "settings": {k: v for k, v in vars(args).items() if k != "func"}, "history": history,
            "summary": {"pairs": len(train), "heldout": len(heldout),
                        "base_win_rate": history[0]["trained"]["win_rate"],
                        "trained_win_rate": history[-1]["trained"]["win_rate"],
                        "train_s_per_pair": round((time.perf_counter() - t0) / len(train), 3),
                        "peak_rss_mb": round(peak_rss_mb(), 1)}}


def _default_model_path() -> str:
    from edge_runtime.model.source import resolve_model

    return str(resolve_model(None).path)


def write_report(result: dict[str, Any], out: Path) -> None:
    write_json(f"{out}.json", result, indent=2, default=str)
    plot(result, Path(f"{out}.png"))
    Path(f"{out}.md").write_text(markdown(result))


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    history = result["history"]
    if result["mode"] == "thumbs":
        plot_thumbs(result, path, plt)
        return
    xs = [h["pairs"] for h in history]
    panels = [("win_rate", "win rate"), ("clpd", "CLPD (nats)")]
    if result["mode"] == "online":
        panels.append(("share", "greedy answers with the preference"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for ax, (key, label) in zip(axes, panels, strict=True):
        ax.plot(xs, [h["trained"][key] for h in history], "o-", label="trained user (online DPO)")
        if "untouched" in history[0]:
            ax.plot(xs, [h["untouched"][key] for h in history], "s--", label="untouched user")
        ax.axhline(history[0]["trained"][key], color="grey", lw=0.8, ls=":", label="base model")
        ax.set_xlabel("feedback pairs")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("MACE-edge personalisation: alignment over time (cf. MACE Fig. 2)", fontsize=10)
    save_figure(fig, path)


def plot_thumbs(result: dict[str, Any], path: Path, plt: Any) -> None:
    history = result["history"]
    xs = [h["thumbs"] for h in history]
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.4))
    for ax, key, label in ((axes[0], "margin", "held-out desirable-vs-undesirable margin (nats)"),
                           (axes[1], "share", "greedy answers with the preference")):
        ax.plot(xs, [h["trained"][key] for h in history], "o-", label="trained user (thumbs, KTO)")
        if key == "share":
            ax.plot(xs, [h["untouched"]["share"] for h in history], "s--", label="untouched user")
        ax.axhline(history[0]["trained"][key], color="grey", lw=0.8, ls=":", label="base model")
        ax.set_xlabel("lone thumbs")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle("MACE-edge: learning from lone thumbs (KTO); the pair rules derive 0 pairs from them",
                 fontsize=10)
    save_figure(fig, path)


def markdown_thumbs(result: dict[str, Any]) -> list[str]:
    s, users = result["summary"], result["users"]
    lines = [
        f"Model `{Path(result['model']).name}`, {serving(result)}, {result['threads']} thread(s). Trained user "
        f"`{users['trained']['name']}` gives only lone thumbs (one per answer, no prompt twice); hidden "
        f"preference: {users['trained']['preference']}. Untouched user `{users['untouched']['name']}` "
        f"(never trained). Held-out thumbs on the base model's answers: {result['heldout_thumbs']['eval']} "
        f"(+{result['heldout_thumbs']['guard']} for the guard), {result['heldout_thumbs']['up']} up.",
        "",
        "| | base | after training |",
        "|---|---|---|",
        f"| greedy answers with the preference | {s['base_share']:.2f} ({s['base_satisfied']}) "
        f"| {s['trained_share']:.2f} ({s['trained_satisfied']}) |",
        f"| held-out desirable-vs-undesirable margin | {s['base_margin']:+.2f} | {s['trained_margin']:+.2f} |",
        f"| held-out examples on their side of z0 = 0 | {s['base_accuracy']:.2f} | {s['trained_accuracy']:.2f} |",
        "",
        f"- lone thumbs: {s['thumbs']} ({s['thumbs_up']} up) in {s['rounds']} rounds; each round's update offered "
        f"to the guard: {s['versions_published']} versions published, {s['guard_rejections']} rejected",
        f"- the same thumbs in the feedback store: {s['store_after']} -> the pair rules (the old, pairs-only "
        f"path) give {s['old_path_pairs']} pairs: nothing to train",
        f"- untouched user's greedy outputs unchanged at every checkpoint: {s['untouched_greedy_unchanged']}",
        f"- train time per thumb (staged reference + forward + backward + AdamW): {s['train_s_per_thumb']} s "
        f"(by stage: {s['stage_s_per_thumb']}); generation per thumb {s['generate_s_per_thumb']} s; "
        f"total run {s['total_s']} s",
        f"- load average (1/5/15 min) at start {result['load_average']['start']}, at end "
        f"{result['load_average']['end']} on {os.cpu_count()} CPUs; peak RSS {s['peak_rss_mb']} MB "
        f"(fp32 model, KV cache, trainer{graph_bytes(result)})",
        f"- backend ({result['backend']['requested']}): {served_by(result['backend'])}: {result['backend']['reason']}",
        f"- bar: {s['bar']}",
        "",
    ]
    lines += markdown_table(
        ["thumbs", "up", "served", "margin", "accuracy", "share", "untouched unchanged", "store", "last guard decision"],
        [[h["thumbs"], h["thumbs_up"], h["served_version"], f"{h['trained']['margin']:+.2f}",
          f"{h['trained']['accuracy']:.2f}", f"{h['trained']['share']:.2f}", h["untouched"]["greedy_unchanged"],
          h["store"], guard_verdict(h)] for h in result["history"]])
    lines += ["", "Greedy answers of the trained user at the start and at the end:", ""]
    lines += [f"- {json.dumps(a)} -> {json.dumps(b)}"
              for a, b in zip(result["history"][0]["examples"], result["history"][-1]["examples"], strict=True)]
    return lines


def guard_verdict(checkpoint: dict[str, Any]) -> str:
    """The last guard decision before a checkpoint, for the tables."""
    guard = checkpoint.get("guard")
    if not guard:
        return "-"
    return f"v{guard['version']} published" if guard["accepted"] else f"kept served ({guard['reason']})"


def serving(result: dict[str, Any]) -> str:
    s = result.get("settings", {})  # runs before --policy scheduled by the library's fcfs
    sched = f", scheduled by {s['policy']} (cost profile {s['cost_profile']})" if "policy" in s else ""
    return f"served on {served_by(result['backend'])}{sched}, trained on the fp32 torch weights"


def graph_bytes(result: dict[str, Any]) -> str:
    held = result["backend"]["held_bytes"]
    return f", the backend's graph weights and KV rows {held / 2**20:.0f} MiB" if held else ""


def markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = [f"# Personalisation benchmark ({result['mode']})", ""]
    if result["mode"] == "thumbs":
        lines += markdown_thumbs(result)
    elif result["mode"] == "online":
        users = result["users"]
        lines += [
            f"Model `{Path(result['model']).name}`, {serving(result)}, {result['threads']} thread(s). Trained user "
            f"`{users['trained']['name']}`: {users['trained']['preference']}; untouched user "
            f"`{users['untouched']['name']}`: {users['untouched']['preference']} (never trained). "
            f"Held-out pairs: {result['heldout_pairs']['trained']} (+{result['heldout_pairs']['guard']} for the guard).",
            "",
            "| | base | after training |",
            "|---|---|---|",
            f"| held-out win rate | {s['base_win_rate']:.3f} | {s['trained_win_rate']:.3f} |",
            f"| held-out CLPD | {s['base_clpd']:+.2f} | {s['trained_clpd']:+.2f} |",
            f"| greedy answers with the preference | {s['base_share']:.2f} ({s['base_satisfied']}) "
            f"| {s['trained_share']:.2f} ({s['trained_satisfied']}) |",
            f"| greedy answer body = base greedy answer | {s['base_answer_kept']:.2f} | {s['trained_answer_kept']:.2f} |",
            "",
            f"- feedback pairs: {s['pairs']} ({s['rounds']} rounds of self-generated candidates; each round's update "
            f"offered to the guard: {s['versions_published']} versions published, {s['guard_rejections']} rejected)",
            f"- untouched user's greedy outputs unchanged at every checkpoint: {s['untouched_greedy_unchanged']}",
            f"- train time per pair (staged reference + forward + backward + AdamW): {s['train_s_per_pair']} s "
            f"(by stage: {s['stage_s_per_pair']}); score stage: {s['score_stage_s_per_pair']} s",
            f"- candidate generation per pair: {s['generate_s_per_pair']} s; wall per pair without "
            f"evaluation: {s['wall_s_per_pair']} s; total run {s['total_s']} s",
            f"- load average (1/5/15 min) at start {result['load_average']['start']}, at end "
            f"{result['load_average']['end']} on {os.cpu_count()} CPUs",
            f"- backend ({result['backend']['requested']}): {served_by(result['backend'])}: {result['backend']['reason']}",
            f"- peak RSS {s['peak_rss_mb']} MB (fp32 model, KV cache, trainer{graph_bytes(result)}); estimated peak activations "
            f"{s['max_activation_bytes_estimate'] / 2**20:.1f} MiB; adapter + grads + Adam {s['adapter_state_bytes'] / 2**20:.1f} MiB",
            f"- bar: {s['bar']}",
            "",
        ]
        lines += markdown_table(
            ["pairs", "served", "win rate", "CLPD", "share", "answer kept", "untouched win", "untouched share",
             "untouched unchanged", "last guard decision"],
            [[h["pairs"], h["served_version"], f"{h['trained']['win_rate']:.3f}", f"{h['trained']['clpd']:+.2f}",
              f"{h['trained']['share']:.2f}", f"{h['trained']['answer_kept']:.2f}",
              f"{h['untouched']['win_rate']:.3f}", f"{h['untouched']['share']:.2f}",
              h["untouched"]["greedy_unchanged"], guard_verdict(h)] for h in result["history"]])
        lines += ["", "Greedy answers of the trained user at the end:", ""]
        lines += [f"- {json.dumps(t)}" for t in result["history"][-1]["examples"]]
    else:
        lines += [f"File `{result['file']}` ({result['format']}), skipped {result['skipped']}.", "",
                  f"Win rate {s['base_win_rate']:.3f} -> {s['trained_win_rate']:.3f} on {s['heldout']} held-out "
                  f"pairs after {s['pairs']} pairs; {s['train_s_per_pair']} s per pair; peak RSS {s['peak_rss_mb']} MB."]
    lines += ["", f"Plot: `{Path(result.get('plot', 'bench_alignment.png')).name}`", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF model directory (default: the default model)")
    p.add_argument("--replay", type=Path, help="HH-RLHF / SHP / explicit JSONL file to replay instead")
    p.add_argument("--format", default="auto", help="replay file format: auto, hh, shp, explicit")
    p.add_argument("--feedback", choices=("pairs", "thumbs", "edit"), default="pairs",
                   help="pairs: choices and edits (DPO); thumbs: lone thumbs only (KTO); edit: two users "
                        "edit a real maced's answers through the SDK, a third only asks (tools/alignment_edit.py)")
    p.add_argument("--edit-heldout", type=int, default=20, help="held-out questions per user (--feedback edit)")
    p.add_argument("--alone-pairs", type=int, default=8,
                   help="edits timed with no other traffic after the run (--feedback edit)")
    p.add_argument("--max-asks", type=int, default=300, help="turns at most (--feedback edit)")
    p.add_argument("--drain-timeout", type=float, default=1800.0,
                   help="seconds to wait for the pairs to be trained (--feedback edit)")
    p.add_argument("--teach-s", type=float, default=0.0,
                   help="stop teaching after this many seconds even if short of --pairs (--feedback edit; 0: no limit)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a maced setting (--feedback edit; the bar runs use none)")
    p.add_argument("--work-dir", default=None, help="where maced's state goes (--feedback edit; default a temp dir)")
    p.add_argument("--thumbs", type=int, default=200, help="lone thumbs to train on (--feedback thumbs)")
    p.add_argument("--guard-examples", type=int, default=16, help="held-out thumbs that guard publishing")
    p.add_argument("--guard-margin-tolerance", type=float, default=1.0)
    p.add_argument("--pairs", type=int, default=100,
                   help="feedback pairs to train on (the bar allows <= 300; past ~90 most rounds yield no pair)")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--round-prompts", type=int, default=16, help="prompts per round of candidates")
    p.add_argument("--max-rounds", type=int, default=200)
    p.add_argument("--heldout-prompts", type=int, default=44)
    p.add_argument("--guard-pairs", type=int, default=10)
    p.add_argument("--eval-prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--eval-new-tokens", type=int, default=40)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--user", default="sam")
    p.add_argument("--signoff", default="Cheers, Sam!")
    p.add_argument("--untouched-user", default="una")
    p.add_argument("--untouched-signoff", default="Best wishes, Una.")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--accumulation", type=int, default=4)
    p.add_argument("--window-tokens", type=int, default=128)
    p.add_argument("--layers-per-group", type=int, default=6)
    p.add_argument("--guard-win-rate-tolerance", type=float, default=0.05)
    p.add_argument("--guard-clpd-tolerance", type=float, default=1.0)
    p.add_argument("--guard-prompts", type=int, default=12, help="held-out prompts the guard answers greedily "
                   "to check for degeneration (0: not checked)")
    p.add_argument("--guard-tokens", type=int, default=16, help="tokens of each of those answers")
    p.add_argument("--guard-kl-budget", type=float, default=1.0, help="mean KL from the base per answer token (nats)")
    p.add_argument("--guard-distinct-2-drop", type=float, default=0.10,
                   help="largest fraction the answers' distinct-2 may fall below the base's")
    p.add_argument("--kv-cache-mb", type=int, default=256)
    p.add_argument("--backend", choices=("auto", "torch", "onnxruntime"), default="auto",
                   help="serving backend, built as the daemon builds it (auto: its default); training "
                        "always reads the fp32 torch weights")
    p.add_argument("--quantization", default="auto", choices=("auto", "none", "int8", "int4", "int4-compact"),
                   help="ONNX weight format (auto: the daemon's default, the fastest within 5%% of float perplexity)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch and ONNX Runtime threads (1 by default: on a shared CPU a 2-thread GEMM waits for a "
                        "descheduled thread)")
    # The daemon's scheduling, so the untouched user's check sees prefill chunked by cost as it
    # is there (#31); "fcfs" with the 512-token budget never splits these prompts.
    p.add_argument("--policy", default="mace", help="the engine's scheduling policy (the daemon's: mace)")
    p.add_argument("--cost-profile", default="background",
                   help="engine.cost_profile (the daemon's: background; in this process the quick calibration, "
                        "corrected online; off: nominal figures)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="result path without suffix (default tools/results/bench_alignment[_thumbs][_BACKEND], "
                        "no backend suffix for torch)")
    args = p.parse_args(argv)
    if args.feedback == "edit":
        from tools import alignment_edit

        args.out = args.out or RESULTS / "bench_alignment_edit"
        args.heldout, args.eval_tokens, args.max_tokens = args.edit_heldout, args.eval_new_tokens, args.max_new_tokens
        result: dict[str, Any] = {}
        try:
            result = alignment_edit.run(args, partial=result)
        finally:  # a run stopped by `timeout` (SIGTERM) still writes what it measured
            alignment_edit.write_report(result, args.out)
        print(alignment_edit.markdown(result))
        return
    if args.out is None:
        name = "bench_alignment_thumbs" if args.feedback == "thumbs" else "bench_alignment"
        args.out = RESULTS / (name if args.backend == "torch" else f"{name}_{args.backend}")
    torch.set_num_threads(args.threads)
    if args.replay:
        result = replay(args)
    else:
        result = online_thumbs(args) if args.feedback == "thumbs" else online(args)
    result["plot"] = f"{args.out}.png"
    write_report(result, args.out)
    print(markdown(result))


if __name__ == "__main__":
    main()
