"""`bench_alignment.py --feedback edit`: two users teach a real `maced` through the SDK by editing
its answers, a third only asks (issue #32's run, as an app would do it).

User 1 wants answers that begin with "Indeed,", user 3 with "Honestly,"; each asks everyday
questions and corrects every answer that does not begin with their word (once) by an `edit` that
adds it, until `--pairs` edits are given; user 2 asks the same kind of questions and gives no
feedback. `maced` runs on the default model with its defaults (auto backend, `pairs_per_version`,
the guard, retention), except cost calibration off and `--threads` threads, as in the issue.
Reported: held-out greedy answers with the user's word (x/20 each), answers repeating it >= 3
times, distinct-2 of the answers against the base's on the same prompts (word bigrams), whether
user 2's greedy answers changed, pairs trained/pending, the longest stall without a finished item
while work was pending, time per trained pair alone and while serving, the guard's figures per
version (published and refused, from the versions' event logs) and the versions left on disk.
"""

from __future__ import annotations

import argparse
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_runtime.train.degeneration import distinct_n, words

# Everyday questions (the kind: "a leap year is ..."); with BRIEF appended most answers
# end within 40 tokens, so the opening word and any repetition are visible.
BRIEF = " Answer in one short sentence."
EVERYDAY = [
    "What is a leap year?", "Why is the sky blue?", "How do I boil an egg?", "What should I eat for breakfast?",
    "How can I sleep better?", "What is a good name for a cat?", "How do I make a cup of tea?",
    "Why do leaves change colour in autumn?", "How often should I water a cactus?", "What is a rainbow?",
    "How do I remove a coffee stain?", "Why do we yawn?", "What is the best way to learn a language?",
    "How long should I cook pasta?", "Why is exercise good for you?", "What is a healthy snack?",
    "How do I keep bread fresh?", "Why do cats purr?", "What causes thunder?", "How do I tie a tie?",
    "What is the tallest animal?", "How many days are in a week?", "Why do we need sleep?",
    "What is the fastest land animal?", "How do plants make food?", "What is the boiling point of water?",
    "How do I clean a window without streaks?", "Why does ice float?", "What is a good houseplant for beginners?",
    "How do I save money on groceries?", "What is the largest ocean?", "Why do birds migrate?",
    "How do I make my phone battery last longer?", "What is a good way to relax after work?",
    "How many hours of sleep does an adult need?", "Why is breakfast important?", "What is photosynthesis?",
    "How do I stop hiccups?", "What is the capital of Australia?", "Why do onions make you cry?",
    "How do I pick a ripe avocado?", "What is the longest river in the world?", "How do bees make honey?",
    "Why is the ocean salty?", "What should I pack for a weekend trip?", "How do I get rid of fruit flies?",
    "What is the difference between weather and climate?", "How do I start running?",
    "Why do we have seasons?", "What is a good gift for a friend?", "How do I make rice fluffy?",
    "Why do dogs wag their tails?", "What is the moon made of?", "How do I keep cut flowers fresh?",
    "What is a healthy amount of water to drink a day?", "Why do stars twinkle?", "How do I fold a fitted sheet?",
    "What is the smallest planet?", "How can I be more productive?", "Why do we dream?",
]
TEMPLATES = {
    "What is the capital of {}?": ["France", "Japan", "Italy", "Spain", "Canada", "Egypt", "Kenya", "Peru",
                                   "Norway", "Germany", "Brazil", "India", "China", "Mexico", "Greece", "Turkey",
                                   "Sweden", "Poland", "Chile", "Cuba", "Ireland", "Portugal", "Austria"],
    "How many legs does a {} have?": ["dog", "cat", "bird", "ant", "horse", "cow", "duck", "spider", "beetle",
                                      "chicken", "goat", "sheep", "frog", "lion", "bee", "crab"],
    "What is the opposite of the word '{}'?": ["hot", "fast", "happy", "up", "light", "early", "open", "strong",
                                               "tall", "rich", "full", "loud", "young", "wet"],
    "How do you say '{}' in French?": ["hello", "thank you", "cat", "water", "good night", "bread", "friend",
                                       "house", "dog", "apple", "book", "school"],
    "What is {}?": ["2 plus 3", "7 plus 5", "10 minus 4", "6 times 2", "9 plus 9", "12 minus 5", "3 times 3",
                    "8 plus 1", "4 plus 4", "15 minus 7", "5 times 5", "20 minus 1"],
}


def questions(seed: int, heldout: int) -> tuple[list[str], list[str]]:
    """(training pool, held-out questions): held-out ones are never asked while teaching."""
    pool = list(EVERYDAY) + [t.format(x) for t, xs in TEMPLATES.items() for x in xs]
    random.Random(seed).shuffle(pool)
    return pool[heldout:], pool[:heldout]


@dataclass
class EditingUser:
    """Wants answers that begin with `word` + "," once; fixes an answer by prefixing it."""

    name: str
    word: str  # "Indeed"
    edits: int = 0
    asks: int = 0

    def satisfied(self, text: str) -> bool:
        return text.lstrip().startswith(f"{self.word},") and self.repeats(text) == 1

    def repeats(self, text: str) -> int:
        return words(text).count(self.word.lower())

    def edit(self, text: str) -> str | None:
        """The answer as this user wants it: their word once, in front; None if nothing is left."""
        body = re.sub(rf"(?i)\b{re.escape(self.word)}\b[,.!;:]?\s*", "", text).strip()
        if len(body.split()) < 2:
            return None
        first = body.split()[0]
        if first != "I" and not first[1:2].isupper():
            body = body[0].lower() + body[1:]
        return f"{self.word}, {body}"


@dataclass
class Watch:
    """Polls the daemon's status: the longest stretch without a finished item while work waited."""

    client: Any
    period_s: float = 1.0
    samples: list[dict[str, Any]] = field(default_factory=list)
    longest_stall_s: float = 0.0
    stall_at: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="status-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        last_done: float | None = None
        last_count = -1
        t0 = time.monotonic()
        while not self._stop.is_set():
            try:
                with self._lock:
                    status = self.client.status()
            except Exception:  # noqa: BLE001 - a slow reply under load: try again
                time.sleep(self.period_s)
                continue
            now = time.monotonic()
            ft, fb = status.get("finetune", {}), status.get("feedback", {})
            count = int(ft.get("pairs_trained", 0)) + int(ft.get("unpaired_trained", 0))
            waiting = bool(ft.get("current")) or int(fb.get("pairs_pending", 0) or 0) > 0
            self.samples.append({"t": round(now - t0, 1), "trained": count, "pending": fb.get("pairs_pending"),
                                 "state": ft.get("state"), "restarts": ft.get("restarts"),
                                 "published": ft.get("versions_published"), "rejected": ft.get("versions_rejected"),
                                 "finetune_s": ft.get("finetune_seconds")})
            if count != last_count or not waiting or ft.get("paused"):
                # Admission pausing fine-tuning (memory, thermal, power) is by design, not a stall:
                # the pause is reported on its own (admission_from_log).
                last_done, last_count = now, count
            elif last_done is not None and now - last_done > self.longest_stall_s:
                self.longest_stall_s = now - last_done
                self.stall_at = round(now - t0, 1)
            self._stop.wait(self.period_s)


def start_maced(args: argparse.Namespace, work: Path) -> tuple[subprocess.Popen[bytes], Path, Path]:
    root = Path(__file__).resolve().parents[1]
    sock = work / "maced.sock"
    log = work / "maced.log"
    cmd = [sys.executable, "-m", "daemon.main", "--state-dir", str(work / "state"), "--ipc", str(sock),
           "--http", "", "--log-format", "text", "--set", f"engine.num_threads={args.threads}",
           "--set", "engine.cost_profile=off"]
    for item in args.set or ():
        cmd += ["--set", item]
    if args.model:
        cmd += ["--model", args.model]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=root, stdout=out, stderr=subprocess.STDOUT)
    return proc, sock, log


def wait_ready(proc: subprocess.Popen[bytes], sock: Path, log: Path, timeout_s: float) -> float:
    from daemon.sdk import Client

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f"maced exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        if sock.exists():
            try:
                with Client(f"ipc://{sock}", timeout_s=5) as c:
                    if c.health(timeout_s=5).get("ok"):
                        return time.monotonic() - t0
            except Exception:  # noqa: BLE001 - not up yet
                pass
        time.sleep(1.0)
    raise SystemExit(f"maced not ready in {timeout_s} s; see {log}")


def greedy(c: Any, user: str | None, prompts: Sequence[str], tokens: int, adapter: str | None = None) -> list[str]:
    extra = {} if adapter is None else {"adapter": adapter}
    return [c.generate(messages=chat(p), max_tokens=tokens, temperature=0.0, user=user, record=False, **extra).text
            for p in prompts]


def chat(question: str) -> list[dict[str, str]]:
    """What an app sends: the question as the user's chat message (the model's chat template)."""
    return [{"role": "user", "content": question + BRIEF}]


def judge(answers: Sequence[str], base: Sequence[str], user: EditingUser | None,
          others: Sequence[EditingUser]) -> dict[str, Any]:
    out: dict[str, Any] = {"n": len(answers),
                           "distinct_2": round(distinct_n([words(a) for a in answers], 2), 4),
                           "base_distinct_2": round(distinct_n([words(a) for a in base], 2), 4)}
    out["distinct_2_vs_base"] = round(out["distinct_2"] / out["base_distinct_2"] - 1, 4) if out["base_distinct_2"] else None
    if user is not None:
        out["with_word"] = sum(a.lstrip().startswith(f"{user.word},") for a in answers)
        out["repeats_3plus"] = sum(user.repeats(a) >= 3 for a in answers)
    for other in others:
        out[f"with_{other.word.lower()}_anywhere"] = sum(other.repeats(a) > 0 for a in answers)
    out["unchanged_vs_base"] = sum(a == b for a, b in zip(answers, base, strict=True))
    return out


def wait_trained(c: Any, timeout_s: float) -> dict[str, Any]:
    """Until nothing is pending or in flight and the fine-tuner is idle (the last publish done)."""
    t0 = time.monotonic()
    while True:
        status = c.status()
        ft, fb = status["finetune"], status["feedback"]
        if not ft.get("current") and not fb.get("pairs_pending") and ft.get("state") == "idle":
            return status
        if time.monotonic() - t0 > timeout_s:
            return status
        time.sleep(2.0)


def guard_versions(state: Path, user: str) -> list[dict[str, Any]]:
    """Each published or refused candidate of `user` with the guard's figures (events.jsonl)."""
    import json

    path = state / "adapters" / user / "events.jsonl"
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        e = json.loads(line)
        if e.get("kind") not in ("published", "rejected"):
            continue
        deg = e.get("degeneration") or {}
        after = e.get("heldout") or e.get("after") or {}
        rows.append({"kind": e["kind"], "version": e.get("version"), "pairs": len(e.get("pair_ids", [])),
                     "win_rate": after.get("win_rate"), "clpd": after.get("clpd"),
                     "kl_per_token": deg.get("kl_per_token"), "distinct_2": deg.get("distinct_2"),
                     "base_distinct_2": deg.get("base_distinct_2"), "max_word_repeats": deg.get("max_word_repeats"),
                     "guard_s": e.get("guard_s"),  # the evaluation's background stages (seconds)
                     "reason": None if e["kind"] == "published" else e.get("reason")})
    return rows


def longest_stall(samples: Sequence[dict[str, Any]]) -> float:
    """From the status samples: the longest stretch with items pending or in flight, none
    finishing and fine-tuning not paused by admission (state "paused")."""
    longest, since, last = 0.0, None, None
    for s in samples:
        if s["state"] == "paused" or not (s.get("pending") or s["state"] in ("training", "publishing")) \
                or s["trained"] != last:
            since, last = s["t"], s["trained"]
        elif since is not None:
            longest = max(longest, s["t"] - since)
    return round(longest, 1)


def admission_from_log(text: str) -> dict[str, Any]:
    """Admission's state changes in maced's log: how long fine-tuning was shed (memory, thermal
    or power pressure pauses it; on a shared machine other processes' memory counts too)."""
    import datetime as dt

    changes = []
    for line in text.splitlines():
        m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+ INFO daemon\.admission: admission (\S+) -> (\S+): (.*)", line)
        if m:
            changes.append((dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"), m.group(2), m.group(3), m.group(4)))
    shed_s, since = 0.0, None
    for when, _old, new, _why in changes:
        if new in ("shed_finetune", "queue", "reject") and since is None:
            since = when
        elif new == "normal" and since is not None:
            shed_s += (when - since).total_seconds()
            since = None
    return {"changes": len(changes), "finetune_shed_s": round(shed_s, 1), "still_shed_at_end": since is not None,
            "first": [f"{w:%H:%M:%S} {o} -> {n}: {why[:100]}" for w, o, n, why in changes[:6]]}


def run(args: argparse.Namespace, partial: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole run; `partial` is filled as it goes (what is written if the run is stopped)."""
    import signal

    from daemon.sdk import Client

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)

    teachers = [EditingUser("user1", "Indeed"), EditingUser("user3", "Honestly")]
    quiet = "user2"
    pool, heldout = questions(args.seed, args.heldout)
    work = Path(tempfile.mkdtemp(prefix="bench-edit-", dir=args.work_dir))
    result: dict[str, Any] = partial if partial is not None else {}
    result.update({"mode": "edit", "loadavg_start": Path("/proc/loadavg").read_text().strip(),
                   "pairs_per_user": args.pairs, "threads": args.threads, "settings": args.set or [],
                   "heldout_prompts": len(heldout), "eval_tokens": args.eval_tokens,
                   "max_tokens": args.max_tokens, "started": time.strftime("%Y-%m-%d %H:%M:%S")})
    proc, sock, log = start_maced(args, work)  # nothing may raise between here and the try
    try:
        result["ready_s"] = round(wait_ready(proc, sock, log, 900), 1)
        with Client(f"ipc://{sock}", timeout_s=600) as c, Client(f"ipc://{sock}", timeout_s=60) as watcher:
            for u in [*teachers]:
                c.consent(u.name)
            c.consent(quiet)
            print(f"[edit] ready in {result['ready_s']} s; base answers", flush=True)
            base = greedy(c, None, heldout, args.eval_tokens, adapter="base")
            result["base_answers"] = base
            watch = Watch(watcher)
            watch.start()
            order = {u.name: random.Random(f"{args.seed}-{u.name}").sample(pool, len(pool)) for u in teachers}
            quiet_order = random.Random(f"{args.seed}-quiet").sample(pool, len(pool))
            t_teach = time.monotonic()
            before = c.status()["finetune"]
            turn = 0
            teach_until = t_teach + args.teach_s if args.teach_s else float("inf")
            while (any(u.edits < args.pairs for u in teachers) and turn < args.max_asks
                   and time.monotonic() < teach_until):
                for u in teachers:
                    if u.edits >= args.pairs:
                        continue
                    q = order[u.name][turn % len(pool)]
                    r = c.generate(messages=chat(q), max_tokens=args.max_tokens, temperature=args.temperature,
                                   seed=turn, user=u.name)
                    u.asks += 1
                    if not u.satisfied(r.text) and (fixed := u.edit(r.text)) is not None:
                        c.edit(u.name, r.interaction_id, fixed)
                        u.edits += 1
                c.generate(messages=chat(quiet_order[turn % len(pool)]), max_tokens=args.max_tokens,
                           temperature=args.temperature, seed=turn, user=quiet)
                turn += 1
                if turn % 10 == 0:
                    ft = c.status()["finetune"]
                    result["progress"] = {"turn": turn, "edits": {u.name: u.edits for u in teachers},
                                          "finetune": ft, "longest_stall_s": round(watch.longest_stall_s, 1)}
                    result["status_samples"] = watch.samples[:: max(1, len(watch.samples) // 400)]
                    print(f"[edit] turn {turn}: edits {[u.edits for u in teachers]}, trained {ft['pairs_trained']}, "
                          f"published {ft['versions_published']}, refused {ft['versions_rejected']}, "
                          f"longest stall {watch.longest_stall_s:.0f} s, load {Path('/proc/loadavg').read_text().split()[0]}",
                          flush=True)
            teach_s = time.monotonic() - t_teach
            mid = c.status()["finetune"]
            print("[edit] teaching done; waiting for training to finish", flush=True)
            status = wait_trained(c, args.drain_timeout)
            drained_s = time.monotonic() - t_teach
            after = status["finetune"]
            watch.stop()
            pairs_during = mid["pairs_trained"] - before["pairs_trained"]
            result["teaching"] = {
                "asks": {u.name: u.asks for u in teachers}, "edits": {u.name: u.edits for u in teachers},
                "turns": turn, "teach_s": round(teach_s, 1), "teach_limit_s": args.teach_s, "until_all_trained_s": round(drained_s, 1),
                "pairs_trained": after["pairs_trained"], "pairs_pending": status["feedback"].get("pairs_pending"),
                "pairs_heldout": status["feedback"].get("pairs_heldout"),
                "in_flight_at_end": after.get("current"), "optimizer_steps": after.get("optimizer_steps"),
                "versions_published": after["versions_published"], "versions_rejected": after["versions_rejected"],
                "restarts": after.get("restarts"), "stalled_jobs": after.get("stalled_jobs"), "errors": after["errors"],
                "longest_stall_s": round(watch.longest_stall_s, 1), "stall_at_s": watch.stall_at,
                "daemon_longest_stall_s": after.get("longest_stall_s"), "stall_warnings": after.get("stall_warnings"),
                "while_serving": {
                    "pairs": pairs_during,
                    "finetune_s_per_pair": round((mid["finetune_seconds"] - before["finetune_seconds"])
                                                 / max(1, pairs_during), 2),
                    "wall_s_per_pair": round(teach_s / max(1, pairs_during), 2)},
            }
            result["status_samples"] = watch.samples[:: max(1, len(watch.samples) // 400)]
            result["teaching"]["longest_stall_unpaused_s"] = longest_stall(watch.samples)
            print("[edit] held-out answers", flush=True)
            per_user = {}
            for u in teachers:
                answers = greedy(c, u.name, heldout, args.eval_tokens)
                per_user[u.name] = {"word": u.word, **judge(answers, base, u, [o for o in teachers if o is not u]),
                                    "answers": answers}
            quiet_after = greedy(c, quiet, heldout, args.eval_tokens)
            # User 2 has no adapter: its greedy answers must equal the base's, asked at the start
            # with no training running, whatever the teaching traffic did.
            per_user[quiet] = {**judge(quiet_after, base, None, teachers), "answers": quiet_after}
            result["heldout"] = per_user
            result["alone"] = time_alone(c, teachers[0], pool, args) if args.alone_pairs else {}
            state = work / "state"
            result["guard_versions"] = {u.name: guard_versions(state, u.name) for u in teachers}
            result["versions_on_disk"] = {u.name: sorted(p.name for p in (state / "adapters" / u.name).glob("v*"))
                                          for u in teachers if (state / "adapters" / u.name).exists()}
            result["status_end"] = {k: c.status().get(k) for k in ("finetune", "feedback", "adapters", "memory")}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        text = log.read_text(errors="replace")
        result["log_tail"] = text[-3000:]
        result["admission"] = admission_from_log(text)
        result["loadavg_end"] = Path("/proc/loadavg").read_text().strip()
    return result


def time_alone(c: Any, user: EditingUser, pool: Sequence[str], args: argparse.Namespace) -> dict[str, Any]:
    """`--alone-pairs` more edits of one user with no other traffic, then the wall and engine
    seconds until they are trained and published (a guarded publish every pairs_per_version)."""
    # The answers first, then the edits in a row: the timing covers training (and its publishes)
    # with no request in flight.
    replies = [c.generate(messages=chat(q), max_tokens=args.max_tokens, temperature=1.0, seed=1000 + i, user=user.name)
               for i, q in enumerate(pool[::-1][: args.alone_pairs])]
    before = c.status()["finetune"]
    t0 = time.monotonic()
    given = 0
    for r in replies:
        fixed = user.edit(r.text) if not user.satisfied(r.text) else None
        if fixed is None:  # already as wanted: the user edits in a remark of their own instead
            fixed = f"{user.edit(r.text) or r.text} Thanks."
        c.edit(user.name, r.interaction_id, fixed)
        given += 1
    status = wait_trained(c, args.drain_timeout)
    wall = time.monotonic() - t0
    ft = status["finetune"]
    pairs = ft["pairs_trained"] - before["pairs_trained"]
    return {"pairs_given": given, "pairs_trained": pairs, "wall_s": round(wall, 1),
            "wall_s_per_pair": round(wall / max(1, pairs), 2),
            "finetune_s_per_pair": round((ft["finetune_seconds"] - before["finetune_seconds"]) / max(1, pairs), 2),
            "versions": ft["versions_published"] + ft["versions_rejected"]
            - before["versions_published"] - before["versions_rejected"]}


# README's figure for a staged DPO pair on the default model (float copy, quiet machine).
README_PAIR_S = 1.33


def markdown(result: dict[str, Any]) -> str:
    from tools.report import markdown_table

    if "threads" not in result:
        return "# bench_alignment --feedback edit: no result\n"
    t, h = result.get("teaching", {}), result.get("heldout", {})
    lines = ["# bench_alignment --feedback edit: two users teach maced by editing, one only asks", "",
             f"maced on the default model with its defaults, except `engine.cost_profile=off` and "
             f"`engine.num_threads={result['threads']}`{'; settings ' + ', '.join(result['settings']) if result['settings'] else ''}. "
             f"Load average at start `{result['loadavg_start']}`, at end `{result.get('loadavg_end')}` "
             "(a shared 2-core machine: timings are slow by that much).", ""]
    if not t:
        return "\n".join(lines + ["The run did not finish teaching; see the JSON's log tail."])
    lines += ["## Held-out greedy answers (20 questions never asked while teaching)", ""]
    rows = []
    for name, r in h.items():
        rows.append([name, r.get("word", "(none: only asks)"),
                     f"{r['with_word']}/{r['n']}" if "with_word" in r else "-",
                     f"{r['repeats_3plus']}/{r['n']}" if "repeats_3plus" in r else "-",
                     ", ".join(f"{k[5:-9]} {v}/{r['n']}" for k, v in r.items() if k.endswith("_anywhere")),
                     f"{r['distinct_2']:.3f} vs {r['base_distinct_2']:.3f} ({100 * (r['distinct_2_vs_base'] or 0):+.1f}%)",
                     f"{r['unchanged_vs_base']}/{r['n']}"])
    lines += markdown_table(["user", "wants", "begins with the word", "word >= 3 times", "other user's word",
                             "distinct-2 (word bigrams) vs base", "identical to base"], rows)
    ws, alone = t["while_serving"], result.get("alone", {})
    lines += ["", "## Training", "",
              f"- edits given: {t['edits']} over {t['turns']} turns (asks {t['asks']}); teaching took {t['teach_s']} s, "
              f"every pair trained {t['until_all_trained_s']} s after it began",
              f"- pairs trained {t['pairs_trained']}, pending after the last publish {t['pairs_pending']}, held out "
              f"{t['pairs_heldout']}, in flight {t['in_flight_at_end']}; optimizer steps {t['optimizer_steps']}",
              f"- versions published {t['versions_published']}, refused {t['versions_rejected']}; restarts "
              f"{t['restarts']}, stalled jobs {t['stalled_jobs']}, errors {t['errors']}",
              f"- longest stretch without a finished item while work was pending: **{t['longest_stall_s']} s** "
              f"(at {t['stall_at_s']} s); from the status samples, leaving out admission's pauses: "
              f"{t.get('longest_stall_unpaused_s', longest_stall(result.get('status_samples') or []))} s; "
              f"maced's own (status `longest_stall_s`, in flight or judged, not paused): "
              f"{t.get('daemon_longest_stall_s')} s, {t.get('stall_warnings')} warning(s) past 60 s",
              f"- time per trained pair while serving the teaching traffic: {ws['finetune_s_per_pair']} s of engine "
              f"fine-tune stages, {ws['wall_s_per_pair']} s wall ({ws['pairs']} pairs)",
              f"- alone ({alone.get('pairs_trained')} pairs, no other request): {alone.get('finetune_s_per_pair')} s "
              f"of stages, {alone.get('wall_s_per_pair')} s wall per pair including {alone.get('versions')} guarded "
              f"publish(es); the README's figure for a staged pair is {README_PAIR_S} s (quiet machine, stages only)",
              f"- versions left on disk: {result.get('versions_on_disk')}",
              f"- admission (from maced's log): {result.get('admission')}", "",
              "## The guard, per candidate", ""]
    for name, rows_ in result.get("guard_versions", {}).items():
        lines += [f"### {name}", ""]
        lines += markdown_table(
            ["kind", "version", "pairs", "win rate", "CLPD", "KL/token", "distinct-2 vs base", "max word repeats", "why refused"],
            [[g["kind"], g["version"], g["pairs"], _f(g["win_rate"]), _f(g["clpd"]), _f(g["kl_per_token"]),
              f"{_f(g['distinct_2'])} vs {_f(g['base_distinct_2'])}", g["max_word_repeats"], (g["reason"] or "")[:160]]
             for g in rows_])
        lines.append("")
    lines += ["## Examples", ""]
    for name, r in h.items():
        lines += [f"- {name}: " + " | ".join(f"`{a[:90]}`" for a in r["answers"][:4])]
    return "\n".join(lines) + "\n"


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def write_report(result: dict[str, Any], out: Path) -> None:
    from tools.report import pyplot, save_figure, write_json, write_markdown

    samples = result.get("status_samples") or []
    if samples:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot([s["t"] for s in samples], [s["trained"] for s in samples], label="items trained")
        ax.plot([s["t"] for s in samples], [s["pending"] or 0 for s in samples], label="pairs pending")
        ax.plot([s["t"] for s in samples], [(s["published"] or 0) for s in samples], label="versions published")
        ax.set_xlabel("seconds since teaching began")
        ax.set_title(f"two users x {result['pairs_per_user']} edits through maced (longest stall "
                     f"{result.get('teaching', {}).get('longest_stall_s')} s)")
        ax.legend()
        result["plot"] = save_figure(fig, f"{out}.png")
    write_json(f"{out}.json", result)
    write_markdown(f"{out}.md", markdown(result).splitlines())
