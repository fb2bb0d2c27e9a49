#!/usr/bin/env python3
"""Structured output on the default model: how often JSON-schema answers validate with and
without the grammar's mask, and what the mask costs per token at 1 and N streams.

    python tools/bench_structured.py [--max-tokens 320] [--tokens 64] [--streams 1,16] [--repeats 3]
                                     [--threads 1]

Validity: 20 chat prompts, each naming its schema (a nested object, an enum, an array; four
schemas, five prompts each), answered greedily once with `response_format` json_schema (the
mask) and once without (the schema only in the prompt; a ```json fence around the answer is
forgiven). Each answer must parse and validate with `jsonschema`.

Overhead: decode tokens/s of the same prompts with and without a JSON-schema mask whose
answer cannot end before `--tokens` tokens (a string with a minimum length), every stream
generating exactly `--tokens` tokens; best of `--repeats` rounds, the two alternating. Then
the mask alone, replayed on the recorded token sequences outside the forward: the engine's
whole mask path per step (masks, unpacking, the masked rows, argmax, advancing; the figure that
a loaded machine leaves readable), and the masks plus advancing alone for llguidance (what the
engine uses) and, when it is importable, xgrammar (the alternative the choice was made against),
with how many tokens their masks disagree on.
Writes tools/results/bench_structured.{json,md}; `--skip-validity` re-measures the overhead and
keeps the validity section of the earlier result.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jsonschema  # noqa: E402
import torch  # noqa: E402

from edge_runtime import Engine, SamplingParams  # noqa: E402
from edge_runtime.commit import greedy_tokens as _greedy_tokens  # noqa: E402
from edge_runtime.constraints import Constraint, unpack_masks  # noqa: E402
from edge_runtime.sampling import mask_rows  # noqa: E402
from tools.report import RESULTS, cpu_name, load_average, write_json  # noqa: E402

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["student", "teacher", "engineer", "artist"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                     "country": {"type": "string", "maxLength": 40}},
                    "required": ["city", "country"], "additionalProperties": False},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 4}},
        "required": ["name", "age", "role", "address", "hobbies"], "additionalProperties": False},
    "recipe": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 60},
        "difficulty": {"enum": ["easy", "medium", "hard"]},
        "ingredients": {"type": "array", "minItems": 1, "maxItems": 6, "items": {
            "type": "object", "properties": {"item": {"type": "string", "maxLength": 30},
                                             "grams": {"type": "integer", "minimum": 1, "maximum": 5000}},
            "required": ["item", "grams"], "additionalProperties": False}},
        "vegetarian": {"type": "boolean"}},
        "required": ["title", "difficulty", "ingredients", "vegetarian"], "additionalProperties": False},
    "event": {"type": "object", "properties": {
        "event": {"type": "string", "maxLength": 60},
        "day": {"enum": ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]},
        "time": {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                                  "minute": {"type": "integer", "minimum": 0, "maximum": 59}},
                 "required": ["hour", "minute"], "additionalProperties": False},
        "attendees": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5}},
        "required": ["event", "day", "time", "attendees"], "additionalProperties": False},
    "review": {"type": "object", "properties": {
        "product": {"type": "string", "maxLength": 50},
        "stars": {"enum": [1, 2, 3, 4, 5]},
        "pros": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
        "cons": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
        "verdict": {"type": "object", "properties": {"buy": {"type": "boolean"},
                                                     "summary": {"type": "string", "maxLength": 80}},
                    "required": ["buy", "summary"], "additionalProperties": False}},
        "required": ["product", "stars", "pros", "cons", "verdict"], "additionalProperties": False},
}
REQUESTS = {
    "person": ["Describe a teacher named Ana who lives in Lisbon.", "Describe a young engineer from Kyoto.",
               "Describe an artist who likes painting and hiking.", "Describe a student from Nairobi.",
               "Describe your favourite fictional character."],
    "recipe": ["Give a recipe for pancakes.", "Give a recipe for a tomato salad.", "Give a recipe for bread.",
               "Give a recipe for a vegetable soup.", "Give a recipe for chocolate cake."],
    "event": ["Plan a team meeting on Monday morning.", "Plan a birthday party on Saturday evening.",
              "Plan a yoga class on Wednesday.", "Plan a dinner with three friends on Friday.",
              "Plan a study session on Sunday afternoon."],
    "review": ["Review a pair of running shoes.", "Review a cheap laptop.", "Review a coffee machine.",
               "Review a science fiction novel.", "Review a pair of headphones."],
}
LONG_ANSWER = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}},
               "required": ["story"], "additionalProperties": False}
STORY = {**LONG_ANSWER, "properties": {"story": {"type": "string"}}}
# The libraries are replayed on the recorded sequences under two schemas both accept: the one
# they were made with, and the same without the minimum length, whose counted repetition is
# costly in xgrammar and grows with the string.
REPLAY_SCHEMAS = {"story, minLength 2000": LONG_ANSWER, "story, no minLength": STORY}
TOPICS = ["the sea", "a mountain", "a robot", "the moon", "a library", "a bakery", "a river", "winter",
          "a violin", "a garden", "a train", "the desert", "a lighthouse", "a volcano", "a forest", "a city"]


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def validity(engine: Engine, max_tokens: int) -> dict[str, Any]:
    """Every prompt with its schema's mask, then every prompt without, each set as one batch
    (greedy: a row's answer does not depend on the others')."""
    asks = [(name, ask) for name in SCHEMAS for ask in REQUESTS[name]]
    prompts = [chat(f"{ask} Answer with only a JSON object that follows this JSON schema:\n"
                    f"{json.dumps(SCHEMAS[name])}") for name, ask in asks]
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens,
                                                constraint=Constraint.json_schema(SCHEMAS[name])))
           for p, (name, _) in zip(prompts, asks, strict=True)]
    masked_out = _run(engine, ids)
    free_out = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    rows = []
    for (name, ask), masked, free in zip(asks, masked_out, free_out, strict=True):
        schema = SCHEMAS[name]
        rows.append({"schema": name, "request": ask,
                     "masked": masked.text, "masked_valid": _valid(masked.text, schema, fence=False),
                     "masked_finish": masked.candidates[0].finish_reason,
                     "free": free.text, "free_valid": _valid(free.text, schema, fence=True),
                     "free_finish": free.candidates[0].finish_reason})
        print(f"  {name:7s} masked {rows[-1]['masked_valid']!s:5s} free {rows[-1]['free_valid']!s:5s}  "
              f"{masked.text[:70]!r}", flush=True)
    return {"prompts": len(rows), "masked_valid": sum(r["masked_valid"] for r in rows),
            "free_valid": sum(r["free_valid"] for r in rows), "rows": rows}


def _run(engine: Engine, ids: list[str]) -> list[Any]:
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    return [outputs[i] for i in ids]


def _valid(text: str, schema: dict[str, Any], fence: bool) -> bool:
    if fence:
        found = re.search(r"```(?:json)?\s*(.*?)```", text, re.DOTALL)
        text = found.group(1) if found else text
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def decode_rate(engine: Engine, streams: int, tokens: int, constraint: Constraint | None) -> tuple[float, list]:
    """Aggregate decode tokens/s once every stream has its first token; every stream makes
    exactly `tokens` tokens. Returns the rate and each stream's token ids."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, constraint=constraint)
    prompts = [chat(f"Write a short story about {TOPICS[i % len(TOPICS)]} as JSON.") for i in range(streams)]
    first: dict[str, float] = {}
    ids = [engine.add_request(p, params, on_token=lambda e: first.setdefault(e.request_id, time.perf_counter()))
           for p in prompts]
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    end = time.perf_counter()
    made = [outputs[i].token_ids for i in ids]
    assert all(len(t) == tokens for t in made), [len(t) for t in made]
    return streams * (tokens - 1) / (end - max(first.values())), made


def replay_llguidance(engine: Engine, sequences: list[list[int]], schema: dict[str, Any]) -> float:
    """Seconds per step for masks + advancing the grammars of len(sequences) streams."""
    compiler = engine.grammars
    matchers = [compiler.matcher(Constraint.json_schema(schema)) for _ in sequences]
    steps = min(len(s) for s in sequences)
    start = time.perf_counter()
    for t in range(steps):
        compiler.masks(matchers)
        for m, seq in zip(matchers, sequences, strict=True):
            assert m.consume_token(seq[t]), m.get_error()
    return (time.perf_counter() - start) / steps


def replay_engine_path(engine: Engine, sequences: list[list[int]], schema: dict[str, Any]) -> float:
    """Seconds per step for everything a mask adds to a decode step in the engine's own code
    (`TokenCommitter.apply_grammars` and the argmax of `_commit_tokens`): the streams' packed masks,
    unpacked together, a float32 copy of the batch's logits with each row's disallowed tokens at
    -inf, the batch's argmax over it, and the grammars advanced (all of it counted: the engine's
    batched argmax of the unmasked path runs either way). Independent of the model's forward, so
    machine load moves it far less than the end-to-end rates."""
    compiler = engine.grammars
    vocab = engine.model.cfg.vocab_size
    logits = torch.randn(len(sequences), vocab, dtype=engine.model.dtype)
    matchers = [compiler.matcher(Constraint.json_schema(schema)) for _ in sequences]
    rows = list(range(len(sequences)))
    steps = min(len(s) for s in sequences)
    start = time.perf_counter()
    for t in range(steps):
        shaped = mask_rows(logits, rows, unpack_masks(compiler.masks(matchers), vocab))
        _greedy_tokens(shaped)
        for m, seq in zip(matchers, sequences, strict=True):
            assert m.consume_token(seq[t]), m.get_error()
    return (time.perf_counter() - start) / steps


def replay_xgrammar(engine: Engine, sequences: list[list[int]], schema: dict[str, Any]) -> float | None:
    """Seconds per step for xgrammar's masks + advancing, the work `replay_llguidance` times:
    the batch's bitmasks filled by its batch matcher (its thread pool, as llguidance's
    executor), then each matcher fed its token. None when xgrammar is not importable."""
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    compiled = _xgrammar_schema(xgr, engine, schema)
    matchers = [xgr.GrammarMatcher(compiled) for _ in sequences]
    batch = xgr.BatchGrammarMatcher()
    bitmask = xgr.allocate_token_bitmask(len(sequences), engine.model.cfg.vocab_size)
    steps = min(len(s) for s in sequences)
    start = time.perf_counter()
    for t in range(steps):
        batch.batch_fill_next_token_bitmask(matchers, bitmask)
        for m, seq in zip(matchers, sequences, strict=True):
            assert m.accept_token(seq[t])
    return (time.perf_counter() - start) / steps


def _xgrammar_schema(xgr: Any, engine: Engine, schema: dict[str, Any]) -> Any:
    vocab = engine.model.cfg.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(engine.tokenizer.hf, vocab_size=vocab,
                                              stop_token_ids=sorted(engine.tokenizer.eos_ids))
    # The same schema. xgrammar bounds the count of whitespace characters between JSON tokens,
    # not their shape; 35 is the longest run the engine's JSON_WHITESPACE allows (1 + 2 + 32),
    # so it accepts every sequence the engine produced and forbids the same long blank runs.
    return xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=True,
                                                         max_whitespace_cnt=35)


def mask_agreement(engine: Engine, sequences: list[list[int]], schema: dict[str, Any]) -> dict[str, float] | None:
    """How far xgrammar's masks are from llguidance's on the replayed steps (tokens allowed by
    one and not the other, per step): near 0 means both replays do the same work."""
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    vocab = engine.model.cfg.vocab_size
    compiled = _xgrammar_schema(xgr, engine, schema)
    ll_matchers = [engine.grammars.matcher(Constraint.json_schema(schema)) for _ in sequences]
    xg_matchers = [xgr.GrammarMatcher(compiled) for _ in sequences]
    bitmask = xgr.allocate_token_bitmask(len(sequences), vocab)
    steps = min(len(s) for s in sequences)
    differ, allowed = [], []
    for t in range(steps):
        ll = unpack_masks(engine.grammars.masks(ll_matchers), vocab)
        xgr.BatchGrammarMatcher().batch_fill_next_token_bitmask(xg_matchers, bitmask)
        xg = unpack_masks(bitmask, vocab)
        differ += (ll != xg).sum(dim=1).tolist()
        allowed += ll.sum(dim=1).tolist()
        for lm, xm, seq in zip(ll_matchers, xg_matchers, sequences, strict=True):
            assert lm.consume_token(seq[t]) and xm.accept_token(seq[t])
    return {"mean_tokens_differing": round(sum(differ) / len(differ), 1), "max_tokens_differing": max(differ),
            "mean_tokens_allowed_llguidance": round(sum(allowed) / len(allowed), 1)}


def _best_ms(seconds: list[float | None]) -> float | None:
    return None if None in seconds else round(min(seconds) * 1000, 3)


def overhead(engine: Engine, streams_list: list[int], tokens: int, repeats: int) -> list[dict[str, Any]]:
    constraint = Constraint.json_schema(LONG_ANSWER)
    engine.generate([chat("Warm up.")], SamplingParams(max_tokens=8, constraint=constraint))
    rows = []
    for streams in streams_list:
        free_rates, masked_rates, sequences = [], [], []
        for _ in range(repeats):  # alternate, so drifting load hits both alike
            free_rates.append(decode_rate(engine, streams, tokens, None)[0])
            rate, sequences = decode_rate(engine, streams, tokens, constraint)
            masked_rates.append(rate)
        free, masked = max(free_rates), max(masked_rates)
        paths, replays = [], {label: {"llguidance": [], "xgrammar": []} for label in REPLAY_SCHEMAS}
        for _ in range(repeats):  # interleaved too: the replays are compared with each other
            paths.append(replay_engine_path(engine, sequences, LONG_ANSWER))
            for label, schema in REPLAY_SCHEMAS.items():
                replays[label]["llguidance"].append(replay_llguidance(engine, sequences, schema))
                replays[label]["xgrammar"].append(replay_xgrammar(engine, sequences, schema))
        libraries = [{"schema": label,
                      **{f"{lib}_ms_per_step": _best_ms(times) for lib, times in replays[label].items()},
                      "xgrammar_vs_llguidance_masks": mask_agreement(engine, sequences, REPLAY_SCHEMAS[label])}
                     for label in REPLAY_SCHEMAS]
        path = min(paths)
        rows.append({"streams": streams, "decode_tok_s_free": round(free, 2), "decode_tok_s_masked": round(masked, 2),
                     "ms_per_token_free": round(1000 / (free / streams), 3),
                     "ms_per_token_masked": round(1000 / (masked / streams), 3),
                     "overhead_ms_per_step": round(1000 * (streams / masked - streams / free), 3),
                     "overhead_fraction": round(free / masked - 1, 4),
                     "llguidance_ms_per_step": libraries[0]["llguidance_ms_per_step"],
                     "mask_path_ms_per_step": round(path * 1000, 3),
                     "mask_path_ms_per_token": round(path * 1000 / streams, 3),
                     "xgrammar_ms_per_step": libraries[0]["xgrammar_ms_per_step"],
                     "libraries": libraries,
                     "rates_free": [round(r, 2) for r in free_rates], "rates_masked": [round(r, 2) for r in masked_rates]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def write_markdown(result: dict[str, Any], path: Path) -> None:
    v = result["validity"]
    machine = result["machine"]
    lines = [f"Default model ({result['model']}, {result['dtype']}, {machine['torch_threads']} torch thread(s)), "
             f"{machine['cores']} cores ({machine['cpu']}), shared with other work: load average (1, 5, 15 min) "
             f"{result['loadavg_start']} at the start, {result['loadavg_end']} at the end.", ""]
    if "from" in v:
        lines += [f"Validity from an earlier run of the same code (load average {v['from']['loadavg_start']} -> "
                  f"{v['from']['loadavg_end']}); overhead re-measured in this one.", ""]
    lines += [f"**Validity** ({v['prompts']} prompts, greedy, at most {result['max_tokens']} tokens, the schema "
              "in the prompt both times): "
              f"with the mask **{v['masked_valid']}/{v['prompts']}** parse and validate; without it "
              f"{v['free_valid']}/{v['prompts']}.", "",
              "| schema | request | masked valid | masked finish | free valid | free finish |",
              "|---|---|---|---|---|---|"]
    for r in v["rows"]:
        lines.append(f"| {r['schema']} | {r['request']} | {r['masked_valid']} | {r['masked_finish']} | "
                     f"{r['free_valid']} | {r['free_finish']} |")
    lines += ["", f"**Overhead** ({result['tokens']} tokens per stream). Mask path = what a mask adds to a decode "
              "step in the engine's own code (masks of all streams, unpacked together and applied to a float32 "
              "copy of the batch's logits, the batch's argmax, grammars advanced), replayed on the recorded "
              "token sequences, best of "
              f"{result['repeats']}; independent of the forward, so the machine's load moves it little. "
              "llguidance replay = masks + advance alone. End to end = decode tok/s of the same streams with "
              f"and without the mask, best of {result['repeats']} alternating rounds (noisy on a loaded machine: "
              "the rounds are listed in the JSON).", "",
              "| streams | mask path ms/step | mask path ms/token | llguidance replay ms/step | "
              "xgrammar replay ms/step | decode tok/s free | decode tok/s masked | end-to-end overhead ms/step |",
              "|---|---|---|---|---|---|---|---|"]
    for r in result["overhead"]:
        lines.append(f"| {r['streams']} | {r.get('mask_path_ms_per_step')} | {r.get('mask_path_ms_per_token')} | "
                     f"{r['llguidance_ms_per_step']} | {r['xgrammar_ms_per_step']} | {r['decode_tok_s_free']} | "
                     f"{r['decode_tok_s_masked']} | {r['overhead_ms_per_step']} |")
    if any(r.get("libraries") for r in result["overhead"]):
        lines += ["", f"**The two grammar libraries**, llguidance {machine.get('llguidance')} (the engine's) and "
                  f"xgrammar {machine.get('xgrammar')}: masks of all streams by each library's batch call plus each "
                  "matcher advanced, replayed on the same recorded token sequences, best of "
                  f"{result['repeats']} interleaved rounds, under the schema the sequences were made with and the "
                  "same schema without the string's minimum length (xgrammar's whitespace bounded to the 35 "
                  "characters the engine's grammar allows). Masks differ = tokens allowed by one library and not "
                  "the other, per stream and step (mean / max, of the mean allowed by llguidance).", "",
                  "| streams | schema | llguidance ms/step | xgrammar ms/step | masks differ |",
                  "|---|---|---|---|---|"]
        for r in result["overhead"]:
            for lib in r.get("libraries", []):
                m = lib["xgrammar_vs_llguidance_masks"] or {}
                lines.append(f"| {r['streams']} | {lib['schema']} | {lib['llguidance_ms_per_step']} | "
                             f"{lib['xgrammar_ms_per_step']} | {m.get('mean_tokens_differing')} / "
                             f"{m.get('max_tokens_differing')} of {m.get('mean_tokens_allowed_llguidance')} |")
    path.write_text("\n".join(lines) + "\n")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-validity", action="store_true",
                    help="measure the overhead only; the validity section of an earlier result at --out is kept")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: OpenMP workers spinning on a shared box slow every step)")
    ap.add_argument("--out", default=str(RESULTS / "bench_structured.json"))
    args = ap.parse_args()
    out = Path(args.out)
    load_start = load_average()
    engine = Engine.load(args.model, kv_cache_bytes=512 << 20, num_threads=args.threads)
    cpu = cpu_name()
    result: dict[str, Any] = {
        "model": engine.model_name, "dtype": str(engine.model.dtype).removeprefix("torch."),
        "max_tokens": args.max_tokens, "tokens": args.tokens, "repeats": args.repeats,
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "llguidance": _version("llguidance"), "xgrammar": _version("xgrammar")},
        "loadavg_start": load_start}
    if not args.skip_validity:
        print("validity ...", flush=True)
        result["validity"] = validity(engine, args.max_tokens)
    elif out.exists():
        earlier = json.loads(out.read_text())
        if "validity" in earlier:
            result["validity"] = {**earlier["validity"], "from": {
                k: earlier["validity"].get("from", {}).get(k, earlier.get(k)) for k in ("loadavg_start", "loadavg_end")}}
            result["max_tokens"] = earlier["max_tokens"]
    print("overhead ...", flush=True)
    result["overhead"] = overhead(engine, [int(s) for s in args.streams.split(",")], args.tokens, args.repeats)
    result["loadavg_end"] = load_average()
    write_json(out, result)
    if "validity" in result:
        write_markdown(result, out.with_suffix(".md"))
        print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
