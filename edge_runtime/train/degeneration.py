"""Degeneration measures for the publish guard: how far an adapter drifted from the reference where
the user expressed no preference (per-token KL on the candidate's own greedy answers) and how
repetitive those answers are (distinct-n, a word's repeats) next to the reference's. No registry.

KL: the RLHF objective DPO optimises in closed form (Rafailov et al. 2023, eq. 3) bounds
KL[pi_theta(y|x) || pi_ref(y|x)] over the policy's own answers y ~ pi_theta, and TRL's online
trainers report that same quantity on generated completions (`objective/kl`). We take the exact
per-token term sum_v pi_theta(v|x,y<t) log(pi_theta/pi_ref)(v|x,y<t) at every position of the
candidate's greedy answer (its chain-rule terms, deterministic, no sampling), skip the first
`skip_tokens` positions (where a preference such as "begin with 'Indeed,'" is expressed by design)
and average per token, so the budget does not depend on the answer's length.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Collection, Hashable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from edge_runtime.model.llama import LlamaModel, LoraApplier
from edge_runtime.model.tokenizer import Tokenizer
from edge_runtime.train.windows import PairKV, Window

_WORD = re.compile(r"[^\W_]+", re.UNICODE)


def words(text: str) -> list[str]:
    """Lower-cased words: "Indeed, indeed" repeats one word twice."""
    return [w.lower() for w in _WORD.findall(text)]


def distinct_n(answers: Sequence[Sequence[Hashable]], n: int) -> float:
    """Distinct-n (Li et al. 2016): distinct n-grams / all n-grams of the generated tokens over the
    answers (each answer's n-grams, none across answer boundaries); 1.0 when there is no n-gram."""
    grams = [tuple(a[i:i + n]) for a in answers for i in range(len(a) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def shared_opening(answers: Sequence[Sequence[Hashable]], most: int = 8) -> int:
    """How many leading tokens at least half of the answers (two at least) begin with alike: an
    opening the user asked for ("Indeed, ...": "Hon|est|ly|," is 4 tokens). Counted by distinct-n
    it repeats once per answer and alone reads as a 10-25% drop of distinct-2 on a dozen short
    answers (session 14 measured 11% for "Indeed, " and 24% for "Honestly, " prepended to the base's
    own answers), so the guard would refuse a preference learned without any drift."""
    need = max(2, -(-len(answers) // 2))
    length = 0
    for k in range(1, most + 1):
        heads = Counter(tuple(a[:k]) for a in answers if len(a) > k)
        if not heads or heads.most_common(1)[0][1] < need:
            break
        length = k
    return length


def shared_closing(answers: Sequence[Sequence[Hashable]], stop_ids: Collection[Hashable], most: int = 8) -> int:
    """How many trailing tokens at least half of the answers (two at least) end with alike, counting
    only answers that ended on a stop id: a sign-off the user asked for ("... \n\nCheers, Sam!"
    and the stop id). It repeats once per answer as an opening does (`shared_opening`); an answer
    that collapsed into a loop runs to the length cap, so its loop is no closing."""
    return shared_opening([list(reversed(a)) if a and a[-1] in stop_ids else [] for a in answers], most)


def max_word_repeats(answers: Sequence[Sequence[str]]) -> int:
    """The most times any one word occurs in a single answer."""
    return max((max(Counter(a).values()) for a in answers if a), default=0)


def token_kl(policy_logits: Tensor, reference_logits: Tensor) -> Tensor:
    """KL(pi || pi_ref) per row of logits [n, vocab] -> [n], over the whole vocabulary, in float64."""
    logp = F.log_softmax(policy_logits.double(), dim=-1)
    logq = F.log_softmax(reference_logits.double(), dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1)


@dataclass(frozen=True)
class Answers:
    """Greedy answers to the same prompts: ids per prompt and the logits that chose each id."""

    ids: list[list[int]]
    logits: list[Tensor]  # [len(ids[i]), vocab] per prompt, float32 on the CPU


@torch.no_grad()
def greedy_answers(model: LlamaModel, prompts: Sequence[Sequence[int]], lora: LoraApplier | None,
                   max_new_tokens: int, stop_ids: frozenset[int] = frozenset()) -> Answers:
    """Each prompt's greedy continuation under `lora` (None: the model alone), one prompt at a time
    through the training path's KV windows (`windows.PairKV`): the prompt as one window, then one
    window per new token, so the candidate adapter is applied as the guard scores it, without
    registering it with the serving engine."""
    out_ids, out_logits = [], []
    device = model.device
    for prompt in prompts:
        p = len(prompt)
        # One rotary offset for the whole answer (LongRoPE picks it by length; 0 elsewhere).
        offset = model.rope.offset(p + max_new_tokens)
        kv = PairKV(model.cfg.num_layers, model.cfg.layer_windows, model.cfg.attn_softcap)
        win = _window("prompt", 0, list(prompt), [offset + t for t in range(p)])
        ids: list[int] = []
        rows: list[Tensor] = []
        for step in range(max_new_tokens):
            hidden = model.run_layers(model.embed_tokens(win.input_ids.to(device)), win.positions.to(device),
                                      kv.context(win, lora))
            logits = model.logits(hidden[-1:]).float()[0]
            token = int(logits.argmax())
            rows.append(logits.cpu())
            ids.append(token)
            if token in stop_ids:
                break
            win = _window("completion", step, [token], [offset + p + step])
        out_ids.append(ids)
        out_logits.append(torch.stack(rows) if rows else torch.zeros(0, model.cfg.vocab_size))
    return Answers(out_ids, out_logits)


@torch.no_grad()
def answer_logits(model: LlamaModel, prompt: Sequence[int], answer: Sequence[int],
                  lora: LoraApplier | None) -> Tensor:
    """The logits [len(answer), vocab] that predict each answer token given the prompt and the
    answer before it, under `lora`, in one forward (the same windows as `greedy_answers`)."""
    if not answer:
        return torch.zeros(0, model.cfg.vocab_size)
    p, n = len(prompt), len(answer)
    offset = model.rope.offset(p + n)
    kv = PairKV(model.cfg.num_layers, model.cfg.layer_windows, model.cfg.attn_softcap)
    ids = list(prompt) + list(answer[:-1])
    win = _window("prompt", 0, ids, [offset + t for t in range(len(ids))])
    device = model.device
    hidden = model.run_layers(model.embed_tokens(win.input_ids.to(device)), win.positions.to(device),
                              kv.context(win, lora))
    return model.logits(hidden[p - 1:]).float().cpu()


def _window(part: str, index: int, ids: list[int], positions: list[int]) -> Window:
    empty = torch.zeros(0, dtype=torch.long)
    return Window(index, part, positions[0], positions[0] + len(ids), 1, torch.tensor(ids, dtype=torch.long),
                  torch.tensor(positions, dtype=torch.long), empty, empty, empty)


@dataclass(frozen=True)
class DegenerationMetrics:
    """The candidate's greedy answers against the reference's on the same held-out prompts."""

    prompts: int
    new_tokens: int  # the answers' length cap
    kl_per_token: float  # mean KL(candidate || reference) over the candidate's answer tokens (nats)
    kl_tokens: int  # positions that mean is over (after the skipped leading ones)
    distinct_1: float
    distinct_2: float
    base_distinct_1: float
    base_distinct_2: float
    max_word_repeats: int  # in any one of the candidate's answers
    base_max_word_repeats: int
    seconds: float = 0.0  # what measuring took (generation and the reference forward)
    opening_tokens: int = 0  # leading tokens left out of both sides' distinct-n (`shared_opening`)
    closing_tokens: int = 0  # trailing tokens left out likewise (`shared_closing`)

    @property
    def distinct_2_drop(self) -> float:
        """How far the candidate's distinct-2 fell below the reference's, as a fraction of it."""
        return 0.0 if self.base_distinct_2 <= 0 else (self.base_distinct_2 - self.distinct_2) / self.base_distinct_2

    def as_dict(self) -> dict[str, float | int]:
        return {**asdict(self), "distinct_2_drop": self.distinct_2_drop}


def degeneration_metrics(model: LlamaModel, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]],
                         candidate: LoraApplier | None, reference: LoraApplier | None,
                         max_new_tokens: int = 24, skip_tokens: int = 2,
                         reference_answers: Sequence[Sequence[int]] | None = None, batch_prompts: int = 4,
                         ) -> tuple[DegenerationMetrics, list[list[int]]]:
    """Greedy answers of the candidate and of the reference (or `reference_answers`, its answers
    to these prompts computed before: the reference is frozen) on `prompts`, `batch_prompts` at a
    time; the KL on the candidate's answers; distinct-1/2 and word repeats of both. Returns the
    reference's answers for reuse. (The daemon runs the same steps as stages: train/guard_task.py.)"""
    from edge_runtime.train.batch_decode import BatchDecode, batch_answer_logits

    start = time.monotonic()
    stop = tokenizer.eos_ids
    mine: list[list[int]] = []
    base: list[list[int]] = []
    kls: list[Tensor] = []
    for i in range(0, len(prompts), max(1, batch_prompts)):
        batch = [list(p) for p in prompts[i:i + max(1, batch_prompts)]]
        run = BatchDecode(model, batch, candidate, max_new_tokens, stop)
        run.prefill()
        run.decode(max_new_tokens)
        mine.extend(run.ids)
        logits = [torch.stack(r) if r else torch.zeros(0, model.cfg.vocab_size) for r in run.logits]
        ref = batch_answer_logits(model, batch, run.ids, reference, max_new_tokens)
        kls.extend(token_kl(a[skip_tokens:], b[skip_tokens:]) for a, b in zip(logits, ref, strict=True)
                   if a.shape[0] > skip_tokens)
        if reference_answers is None:
            run = BatchDecode(model, batch, reference, max_new_tokens, stop)
            run.prefill()
            run.decode(max_new_tokens)
            base.extend(run.ids)
    if reference_answers is not None:
        base = [list(a) for a in reference_answers]
    return (summarize(tokenizer, len(prompts), max_new_tokens, mine, kls, base, time.monotonic() - start, skip_tokens),
            base)


def summarize(tokenizer: Tokenizer, prompts: int, max_new_tokens: int, mine: Sequence[Sequence[int]],
              kls: Sequence[Tensor], base: Sequence[Sequence[int]], seconds: float,
              kl_skip_tokens: int = 2) -> DegenerationMetrics:
    """The measures from the candidate's answers (`mine`), the per-token KL rows on them (`kls`:
    one per answer longer than `kl_skip_tokens`, from that position on) and the reference's
    answers (`base`) to the same prompts."""
    close = shared_closing(mine, tokenizer.eos_ids)
    closing = Counter(tuple(a[-close:]) for a in mine if close and len(a) > close).most_common(1)
    long_enough = [a for a in mine if len(a) > kl_skip_tokens] if kls else []  # no kls: no KL measured
    if len(long_enough) != len(kls) or any(len(a) - kl_skip_tokens != r.numel()
                                           for a, r in zip(long_enough, kls, strict=True)):
        raise ValueError("the KL rows do not match the answers past their skipped leading tokens")
    # The KL leaves out the shared closing where an answer carries it, as it leaves out the leading
    # tokens: there the preference shows by design (a sign-off the base would never write is
    # several nats a token), and the answer before it is what must not drift.
    kls = [r[:max(0, r.numel() - close)] if closing and tuple(a[-close:]) == closing[0][0] else r
           for a, r in zip(long_enough, kls, strict=True)]
    kl = torch.cat(list(kls)) if kls else torch.zeros(0, dtype=torch.float64)
    # Distinct-n over token ids as Li et al. count generated tokens ("indeed indeed" and "ssss"
    # both repeat); a word's repeats over lower-cased words ("Indeed, indeed" is one word twice).
    # Both sides' distinct-n from past the candidate's shared opening (`shared_opening`) and before
    # its shared closing (`shared_closing`): the same number of leading and trailing tokens left out
    # of each answer, so a base answer and the same answer inside the preference compare alike; a
    # template between them still repeats.
    mine_words = [words(tokenizer.decode(list(ids))) for ids in mine]
    base_words = [words(tokenizer.decode(list(ids))) for ids in base]
    skip = shared_opening(mine)
    mine, base = [a[skip:max(skip, len(a) - close)] for a in mine], [b[skip:max(skip, len(b) - close)] for b in base]
    return DegenerationMetrics(
        prompts=prompts, new_tokens=max_new_tokens,
        kl_per_token=float(kl.mean()) if kl.numel() else 0.0, kl_tokens=int(kl.numel()),
        distinct_1=distinct_n(mine, 1), distinct_2=distinct_n(mine, 2),
        base_distinct_1=distinct_n(base, 1), base_distinct_2=distinct_n(base, 2),
        max_word_repeats=max_word_repeats(mine_words), base_max_word_repeats=max_word_repeats(base_words),
        seconds=seconds, opening_tokens=skip, closing_tokens=close,
    )
