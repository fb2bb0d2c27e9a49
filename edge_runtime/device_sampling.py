"""The step's token choice for every plain row at once, on the logits' device: logit bias and
penalties, greedy argmax, temperature/top-k/top-p draws from a counter-based hash, and the
log-probabilities asked for; only the chosen ids (and those few log-probabilities) reach the host.

Same semantics as `edge_runtime.sampling` (shaping in float32 as `shape_logits`, scores in float64
as `sampling_probs`, nucleus ranked by score, ties as argmax, non-finite sampled rows refused),
except the random draw: an exponential race (Gumbel-max, argmax of score + Gumbel noise) whose
noise is a hash of (the sequence's key, its generated-token count, the token id). So a seeded
sequence draws the same token whatever shares its batch, on the CPU and on a GPU alike.

Cost of one step, whatever its number of rows R (every op covers all rows at once; counted with a
dispatch mode at R = 1 and R = 16 alike, views not counted, the host's packing included): one
host->device copy (every row's parameters and sparse shaping adds packed in one float64 tensor),
then 7 aten ops greedy, 16 with bias and penalties, 58 sampled at a temperature (the hash's ~27
int64 ops over [R, vocab] among them), 75 with top-k and top-p, 92 with logprobs too; and one
device->host copy, the step's one synchronisation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from edge_runtime.sampling import SamplingParams

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so the int64 torch ops
# never overflow (signed overflow has no defined result a CPU and a GPU must agree on).
_MIX = (0x7FEB352D, 0x31848BAB)
Column = Callable[[str], torch.Tensor]  # one named column of a step's packed parameters, on the device
NOT_FINITE = "the model's logits for this row are not finite numbers"  # sampling_probs' words


@dataclass(frozen=True)
class RowChoice:
    """What one row needs chosen: its row in the step's logits, its parameters, the counts of
    the tokens it generated (penalties), its sampling key and how many tokens it generated."""

    row: int
    params: SamplingParams
    counts: Mapping[int, int] = field(default_factory=dict)
    key: int = 0
    step: int = 0


@dataclass
class Chosen:
    """The row's token, its log-probabilities as `sampling.token_logprobs` gives them (when
    asked), or why the row could not be sampled (`error`: the request fails alone)."""

    token: int
    logprobs: tuple[float, list[tuple[int, float]]] | None = None
    error: str | None = None


def splitmix64(x: int) -> int:
    """Steele, Lea and Flood's SplitMix64 finaliser on Python ints: a 64-bit hash of `x`."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def row_salt(key: int, step: int) -> tuple[int, int]:
    """Two 32-bit words that key one row's noise: a different pair for every (key, step)."""
    z = splitmix64(splitmix64(key & _M64) ^ (step & _M64))
    return z & _M32, z >> 32


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche (xorshift-multiply, in the manner of Wellons' lowbias32) in place on
    int64 values in [0, 2**32)."""
    for mult in _MIX:
        h.bitwise_xor_(h >> 16)
        h.mul_(mult).bitwise_and_(_M32)
    h.bitwise_xor_(h >> 16)
    return h


def gumbel_noise(salt_a: torch.Tensor, salt_b: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise float64 [rows, vocab] from the rows' salts (int64 [rows]): a pure
    function of (salt, token id), the same on every device."""
    tokens = torch.arange(vocab, dtype=torch.int64, device=salt_a.device)
    h = _mix32(tokens.unsqueeze(0) ^ salt_a.unsqueeze(1))
    h = _mix32(h.bitwise_xor_(salt_b.unsqueeze(1)))
    # u in (0, 1) strictly: -log(-log(u)) is finite for every hash value.
    u = (h.to(torch.float64) + 0.5) * 2.0**-32
    return u.log_().neg_().log_().neg_()


def choose_rows(logits: torch.Tensor, rows: list[RowChoice]) -> list[Chosen]:
    """Every row's token from `logits` [n, vocab] (any device), in one vectorised pass."""
    if not rows:
        return []
    plan, column = _pack(logits, rows)
    shaped = _shape(logits, plan, column)
    tokens = shaped.argmax(dim=1)
    bad = torch.zeros(len(rows), dtype=torch.bool, device=logits.device)
    if plan.any_sampled:
        scores, bad = _scores(shaped, column, plan)
        noise = gumbel_noise(column("salt_a").long(), column("salt_b").long(), shaped.shape[1])
        tokens = torch.where(column("sampled") > 0, scores.add_(noise).argmax(dim=1), tokens)
    parts = [tokens.to(torch.float64), bad.to(torch.float64)]
    if plan.logprob_rows:
        parts += _logprobs(shaped, tokens, column("logprob_row").long(), plan.top_logprobs)
    numbers = torch.cat(parts).cpu().tolist()  # the one device->host copy: the step's only sync
    return plan.read(numbers)


def shape_rows(logits: torch.Tensor, rows: list[RowChoice]) -> torch.Tensor:
    """The rows as `shape_logits` shapes them (float32 [len(rows), vocab]): what the greedy
    argmax and the log-probabilities read."""
    return _shape(logits, *_pack(logits, rows))


def row_scores(logits: torch.Tensor, rows: list[RowChoice]) -> torch.Tensor:
    """The rows' float64 scores after temperature, top-k and top-p (-inf outside the support):
    their softmax is `sampling_probs`; the draw is their argmax plus Gumbel noise."""
    plan, column = _pack(logits, rows)
    return _scores(_shape(logits, plan, column), column, plan)[0]


def _pack(logits: torch.Tensor, rows: list[RowChoice]) -> tuple[_Plan, Column]:
    plan = _Plan(rows, logits.shape[-1])
    packed = to_device(torch.tensor(plan.numbers, dtype=torch.float64), logits.device)  # the one host->device copy
    return plan, plan.fields(packed)


def _shape(logits: torch.Tensor, plan: _Plan, column: Column) -> torch.Tensor:
    shaped = logits.index_select(0, column("row").long()).to(torch.float32)  # a copy: shaped in place
    flat = shaped.view(-1)
    # Bias, then penalties, as two additions like `shape_logits`: the same float32 roundings.
    if plan.sizes["bias_at"]:
        flat.index_add_(0, column("bias_at").long(), column("bias").to(torch.float32))
    if plan.sizes["penalty_at"]:
        flat.index_add_(0, column("penalty_at").long(), column("penalty").to(torch.float32))
    return shaped


class _Plan:
    """The host's half of a step: the rows' parameters and sparse adds packed into one list of
    float64 numbers (ids and 32-bit salts are exact in float64), and reading the answer back."""

    def __init__(self, rows: list[RowChoice], vocab: int) -> None:
        self.rows = rows
        self.vocab = vocab
        self.errors: dict[int, str] = {}
        self.penalties: list[tuple[int, float, float]] = []  # (times, frequency, presence) per add
        self.any_sampled = any(not r.params.greedy for r in rows)
        self.logprob_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        self.top_logprobs = max((min(rows[i].params.logprobs, vocab) for i in self.logprob_rows), default=0)
        columns: dict[str, list[float]] = {name: [] for name in (
            "row", "sampled", "temperature", "top_k", "need_k", "top_p", "need_p", "salt_a", "salt_b",
            "bias_at", "bias", "penalty_at", "penalty", "logprob_row")}
        for i, r in enumerate(rows):
            p = r.params
            columns["row"].append(r.row)
            columns["sampled"].append(0.0 if p.greedy else 1.0)
            columns["temperature"].append(1.0 if p.greedy else p.temperature)
            # A greedy row's cuts change nothing: it never makes the step sort.
            need_k = not p.greedy and 0 < p.top_k < vocab
            columns["top_k"].append(p.top_k if need_k else 1)
            columns["need_k"].append(1.0 if need_k else 0.0)
            columns["top_p"].append(p.top_p)
            columns["need_p"].append(1.0 if not p.greedy and p.top_p < 1.0 else 0.0)
            salt_a, salt_b = row_salt(r.key, r.step) if not p.greedy else (0, 0)
            columns["salt_a"].append(salt_a)
            columns["salt_b"].append(salt_b)
            self._shaping(i, r, columns)
        columns["logprob_row"] = [float(i) for i in self.logprob_rows]
        self._in_float32(columns)
        self.any_k = any(columns["need_k"])
        self.any_p = any(columns["need_p"])
        self.max_k = max((int(k) for k, n in zip(columns["top_k"], columns["need_k"], strict=True) if n), default=1)
        self.sizes = {name: len(values) for name, values in columns.items()}
        self.numbers = [x for values in columns.values() for x in values]

    def _shaping(self, i: int, r: RowChoice, columns: dict[str, list[float]]) -> None:
        p, base = r.params, i * self.vocab
        if p.logit_bias:
            outside = [t for t, _ in p.logit_bias if t >= self.vocab]
            if outside:  # on a GPU an index past the row is a device assert, not an error
                self.errors[i] = f"IndexError: logit_bias token {outside[0]} is past the vocabulary ({self.vocab})"
                return
            columns["bias_at"] += [base + t for t, _ in p.logit_bias]
            columns["bias"] += [b for _, b in p.logit_bias]
        if r.counts and (p.presence_penalty or p.frequency_penalty):
            columns["penalty_at"] += [base + t for t in r.counts]
            self.penalties += [(n, p.frequency_penalty, p.presence_penalty) for n in r.counts.values()]

    def _in_float32(self, columns: dict[str, list[float]]) -> None:
        """The adds as `shape_logits` computes them, in float32 (one torch call each for all rows):
        the device then adds exactly the same float32 numbers."""
        if columns["bias"]:
            columns["bias"] = torch.tensor(columns["bias"], dtype=torch.float32).tolist()
        if self.penalties:
            times, frequency, presence = torch.tensor(self.penalties, dtype=torch.float32).unbind(1)
            columns["penalty"] = (-(times * frequency + presence)).tolist()

    def fields(self, packed: torch.Tensor) -> Column:
        """A reader of one named column of the packed tensor (a view on the device)."""
        offsets, at = {}, 0
        for name, size in self.sizes.items():
            offsets[name] = (at, size)
            at += size

        def column(name: str) -> torch.Tensor:
            start, size = offsets[name]
            return packed.narrow(0, start, size)

        return column

    def read(self, numbers: list[float]) -> list[Chosen]:
        count = len(self.rows)
        tokens, bad = numbers[:count], numbers[count : 2 * count]
        chosen_lp = numbers[2 * count : 2 * count + len(self.logprob_rows)]
        k = self.top_logprobs
        rest = numbers[2 * count + len(self.logprob_rows) :]
        half = len(self.logprob_rows) * k
        top_values, top_ids = rest[:half], rest[half:]
        out = [Chosen(int(t)) for t in tokens]
        for n, i in enumerate(self.logprob_rows):
            want = min(self.rows[i].params.logprobs, self.vocab)
            values = top_values[n * k : n * k + want]
            ids = top_ids[n * k : n * k + want]
            top = [(int(t), v) for t, v in zip(ids, values, strict=True) if math.isfinite(v)]
            out[i].logprobs = (chosen_lp[n], top)
        for i, flag in enumerate(bad):
            if flag:
                out[i] = Chosen(-1, error=NOT_FINITE)
        for i, why in self.errors.items():
            out[i] = Chosen(-1, error=why)
        return out


def _scores(shaped: torch.Tensor, column: Column, plan: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's scores as `sampling_probs` weighs them (greedy rows' too; the caller keeps
    their argmax), and which sampled rows are not finite."""
    scores = shaped.to(torch.float64)
    best = scores.max(dim=1, keepdim=True).values
    bad = (~torch.isfinite(best.squeeze(1)) | scores.isnan().any(dim=1)) & (column("sampled") > 0)
    # Shift so the best is 0, then divide in float64: a temperature of 5e-324 gives 0 for the
    # best and -inf for the rest, never inf - inf (sample_next's docstring). A bad row's scores
    # are zeroed so that nothing below meets a NaN; its draw is discarded.
    scores = (scores - best).div_(column("temperature").unsqueeze(1)).masked_fill_(bad.unsqueeze(1), 0.0)
    minus_inf = float("-inf")
    if plan.any_p:
        ranked, order = torch.sort(scores, dim=1, descending=True, stable=True)
        if plan.any_k:
            kth = ranked.gather(1, (column("top_k").long() - 1).unsqueeze(1))
            kth = kth.masked_fill_(column("need_k").unsqueeze(1) == 0, minus_inf)
            ranked = ranked.masked_fill(ranked < kth, minus_inf)
        # The nucleus: the smallest prefix (by score, ties as argmax) whose mass reaches top_p.
        probs = torch.softmax(ranked, dim=1)
        drop = (torch.cumsum(probs, dim=1) - probs) >= column("top_p").unsqueeze(1)
        drop &= column("need_p").unsqueeze(1) > 0
        scores = torch.empty_like(scores).scatter_(1, order, ranked.masked_fill_(drop, minus_inf))
    elif plan.any_k:
        top = torch.topk(scores, plan.max_k, dim=1).values
        kth = top.gather(1, (column("top_k").long() - 1).unsqueeze(1))
        kth = kth.masked_fill_(column("need_k").unsqueeze(1) == 0, minus_inf)
        scores = scores.masked_fill_(scores < kth, minus_inf)
    return scores, bad


def _logprobs(shaped: torch.Tensor, tokens: torch.Tensor, index: torch.Tensor, k: int) -> list[torch.Tensor]:
    """The asked rows' (`index`) chosen-token log-probabilities and k best (values, then ids),
    flattened: `token_logprobs`' distribution (the shaped row at temperature 1, in float64)."""
    logp = torch.log_softmax(shaped.index_select(0, index).to(torch.float64), dim=1)
    chosen = logp.gather(1, tokens.index_select(0, index).unsqueeze(1)).squeeze(1)
    parts = [chosen]
    if k:
        values, ids = torch.topk(logp, k, dim=1)
        parts += [values.reshape(-1), ids.to(torch.float64).reshape(-1)]
    return parts


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`; to a GPU from page-locked memory without waiting (a copy from pageable
    memory waits for the queue to drain), else a plain copy where pinning is not available."""
    if device.type != "cuda":
        return host.to(device)
    try:
        return host.pin_memory().to(device, non_blocking=True)
    except RuntimeError:  # no pinned memory on this machine: the copy waits, the result is the same
        return host.to(device)


def synchronize(tensor: torch.Tensor) -> None:
    """Wait for the work queued on `tensor`'s device: a GPU's launches return before the kernels
    run, so a clock read without this times the launch, not the forward."""
    kind = tensor.device.type
    if kind == "cpu":
        return
    backend = getattr(torch, kind, None)
    wait = getattr(backend, "synchronize", None)
    if wait is not None:
        wait(tensor.device) if kind == "cuda" else wait()
