"""The publish guard's evaluation of one candidate adapter as no-grad stages the scheduler packs beside
serving (a `FineTuneWork`, queued like a pair's update): held-out pairs' and unpaired examples'
log-probs one item per stage, and the degeneration check's greedy answers in batches of prompts,
a few tokens per stage, then the reference's logits on them. Nothing here waits on, or holds, the
adapter a training job is updating: the candidate is a frozen snapshot.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from edge_runtime.lora.weights import LoraWeights
from edge_runtime.train.batch_decode import BatchDecode, each_answer_logits
from edge_runtime.train.costs import StageEstimate
from edge_runtime.train.degeneration import DegenerationMetrics, summarize, token_kl
from edge_runtime.train.dpo import AlignmentMetrics, alignment_metrics
from edge_runtime.train.kto import UnpairedMetrics, unpaired_metrics
from edge_runtime.train.pairs import PairLike, PairTokens
from edge_runtime.train.staged import Stage, StageCursor, StageKind
from edge_runtime.train.unpaired import UnpairedLike

if TYPE_CHECKING:
    from edge_runtime.train.trainer import AdapterTrainer

Row = tuple[float, ...]
Rows = list[Row]


@dataclass(frozen=True)
class GuardDecision:
    accepted: bool
    reason: str
    before: AlignmentMetrics | None  # the served version (or the base) on the held-out pairs
    after: AlignmentMetrics | None  # the candidate
    unpaired_before: UnpairedMetrics | None = None  # the same on held-out unpaired examples
    unpaired_after: UnpairedMetrics | None = None
    degeneration: DegenerationMetrics | None = None  # the candidate's greedy answers vs the reference's

    def as_dict(self) -> dict[str, Any]:
        out = {
            "accepted": self.accepted,
            "reason": self.reason,
            "before": None if self.before is None else self.before.as_dict(),
            "after": None if self.after is None else self.after.as_dict(),
        }
        if self.unpaired_before is not None or self.unpaired_after is not None:
            out["unpaired_before"] = None if self.unpaired_before is None else self.unpaired_before.as_dict()
            out["unpaired_after"] = None if self.unpaired_after is None else self.unpaired_after.as_dict()
        if self.degeneration is not None:
            out["degeneration"] = self.degeneration.as_dict()
        return out


class GuardRules(Protocol):
    """What the evaluation asks of the guard's settings (`guard.RegressionGuard`)."""

    min_heldout_pairs: int
    max_heldout_pairs: int
    degeneration_prompts: int
    degeneration_tokens: int
    kl_skip_tokens: int

    def judges_unpaired(self, examples: Sequence[UnpairedLike]) -> bool: ...

    def check(self, before: AlignmentMetrics | None, after: AlignmentMetrics | None,
              unpaired_before: UnpairedMetrics | None = None, unpaired_after: UnpairedMetrics | None = None,
              degeneration: DegenerationMetrics | None = None) -> GuardDecision: ...

    def degenerated(self, d: DegenerationMetrics) -> list[str]: ...




class GuardEvaluation(StageCursor):
    """Stages of one candidate's evaluation; `decision()` once `done`. Run them in order
    (`run_next()`), all at once (`run()`), or give the current batch's keys/values back under
    memory pressure (`abandon()`: that batch's answers start again)."""

    def __init__(self, source: AdapterTrainer, guard: GuardRules, candidate: LoraWeights,
                 heldout: Sequence[PairLike | PairTokens] = (), heldout_unpaired: Sequence[UnpairedLike] = (),
                 served: LoraWeights | None = None, served_metrics: AlignmentMetrics | None = None,
                 served_unpaired: UnpairedMetrics | None = None, batch_prompts: int = 4,
                 tokens_per_stage: int = 4, served_rows: Mapping[PairTokens, Row] | None = None) -> None:
        # No adapter of the scheduler's to hold between stages (FineTuneQueue keys jobs by trainer).
        self.trainer: Any = None
        self.source = source
        self.guard = guard
        self.candidate = candidate
        self.served = served
        self.before, self.after = served_metrics, None
        self.unpaired_before, self.unpaired_after = served_unpaired, None
        self.degeneration: DegenerationMetrics | None = None
        self.seconds = 0.0
        self.pairs = len(heldout) >= guard.min_heldout_pairs
        self.unpaired = guard.judges_unpaired(heldout_unpaired)
        self.judged = self.pairs or self.unpaired
        self.counts = (len(heldout), len(heldout_unpaired))
        self.stages: list[Stage] = []
        self._restart: list[int] = []  # per stage: where its batch begins again after `abandon`
        self._cursor = 0
        self._live: BatchDecode | None = None
        # Each judged pair's (policy chosen, policy rejected, reference chosen, reference rejected)
        # log-probs under the candidate ("after") and the served version ("before"): a version is
        # immutable, so its rows can be given back as `served_rows` to the next evaluation.
        self.pair_rows: dict[str, dict[PairTokens, Row]] = {"after": {}, "before": {}}
        self.judged_pairs = 0
        if self.pairs:
            tokens = judged_pairs([p if isinstance(p, PairTokens) else source.tokenize(p) for p in heldout],
                                  guard.max_heldout_pairs)
            self.judged_pairs = len(tokens)
            self._pair_stages(tokens, candidate, "after")
            if served_metrics is None:
                self._pair_stages(tokens, served, "before", served_rows or {})
        if self.unpaired:
            examples = [source.tokenize_unpaired(e, mismatched=False) for e in heldout_unpaired]
            self._unpaired_stages(examples, candidate, "unpaired_after")
            if served_unpaired is None:
                self._unpaired_stages(examples, served, "unpaired_before")
        self.prompts = heldout_prompts(source, heldout if self.pairs else (),
                                       heldout_unpaired if self.unpaired else (), guard.degeneration_prompts)
        if self.prompts:
            self._degeneration_stages(max(1, batch_prompts), max(1, tokens_per_stage))

    # -- driving (edge_runtime.sched.finetune.FineTuneWork) ---------------------------------

    def run_next(self) -> Stage:
        stage = super().run_next()
        self.seconds += stage.seconds or 0.0  # a re-run batch's stages count again
        return stage

    def run(self) -> GuardDecision:
        while not self.done:
            self.run_next()
        return self.decision()

    @property
    def held_bytes(self) -> int:
        return 0 if self._live is None else self._live.held_bytes

    def abandon(self) -> None:
        if self._live is not None:
            self._live.reset()
            self._live = None
        if not self.done:
            self._cursor = self._restart[self._cursor]

    def decision(self) -> GuardDecision:
        if not self.done:
            raise RuntimeError("the guard's evaluation has stages left")
        if not self.judged:
            n, u = self.counts
            return GuardDecision(True, f"only {n} held-out pairs and {u} unpaired examples (of one kind or none); "
                                 "published unguarded", None, None)
        return self.guard.check(self.before, self.after, self.unpaired_before, self.unpaired_after,
                                self.degeneration)

    # -- stages ------------------------------------------------------------------------------

    def _add(self, kind: StageKind, name: str, estimate: Callable[[], StageEstimate], run: Callable[[], None],
             restart: int | None = None) -> None:
        self._restart.append(len(self.stages) if restart is None else restart)
        self.stages.append(Stage(kind, name, estimate, run))

    def _pair_stages(self, tokens: list[PairTokens], weights: LoraWeights | None, field: str,
                     known: Mapping[PairTokens, Row] | None = None) -> None:
        """One stage per pair whose row is not `known`; the metrics once every row is there."""
        src, layers = self.source, self.source.model.cfg.num_layers
        kind = StageKind.SCORE if weights is self.candidate else StageKind.REFERENCE
        rows: list[Row | None] = [None if known is None else known.get(t) for t in tokens]

        def finish() -> None:
            m = torch.tensor(rows, dtype=torch.float64)
            setattr(self, field, alignment_metrics(m[:, 0], m[:, 1], m[:, 2], m[:, 3], src.dpo.beta))
            self.pair_rows[field] = {t: r for t, r in zip(tokens, rows, strict=True) if r is not None}
        todo = [i for i, r in enumerate(rows) if r is None]
        if not todo:
            finish()
            return
        for n, i in enumerate(todo):
            def run(i: int = i, last: bool = n == len(todo) - 1) -> None:
                rows[i] = src.policy_logps(tokens[i], weights) + src.reference_logps(tokens[i])
                if last:
                    finish()

            def estimate(t: PairTokens = tokens[i]) -> StageEstimate:
                return src.costs.score(t.num_rows, layers, len(t.chosen) + len(t.rejected),
                                       with_reference=not src.has_reference(t))
            self._add(kind, f"guard {field}[pair {i}]", estimate, run)

    def _unpaired_stages(self, examples: list[Any], weights: LoraWeights | None, field: str) -> None:
        rows: Rows = []
        labels: list[bool] = []
        src, layers = self.source, self.source.model.cfg.num_layers
        kind = StageKind.SCORE if weights is self.candidate else StageKind.REFERENCE
        for i, ex in enumerate(examples):
            def run(ex: Any = ex, last: bool = i == len(examples) - 1) -> None:
                rows.append((src.policy_logps(ex.tokens, weights)[0], src.reference_logps(ex.tokens)[0]))
                labels.append(bool(ex.desirable))
                if last:
                    m = torch.tensor(rows, dtype=torch.float64)
                    setattr(self, field, unpaired_metrics(m[:, 0], m[:, 1], torch.tensor(labels, dtype=torch.bool)))

            def estimate(ex: Any = ex) -> StageEstimate:
                return src.costs.score(ex.tokens.num_rows, layers, ex.tokens.num_rows, with_reference=True)
            self._add(kind, f"guard {field}[example {i}]", estimate, run)

    def _degeneration_stages(self, batch_prompts: int, per_stage: int) -> None:
        src, guard = self.source, self.guard
        n_tokens, stop = guard.degeneration_tokens, src.tokenizer.eos_ids
        keys = [(src.fleet_key, n_tokens, p) for p in self.prompts]
        known = [src.reference_answers.get(k) for k in keys]
        need_reference = any(a is None for a in known)
        batches = [self.prompts[i:i + batch_prompts] for i in range(0, len(self.prompts), batch_prompts)]
        mine: list[list[int]] = []
        kls: list[torch.Tensor] = []
        base: list[list[int]] = [] if need_reference else [list(a) for a in known if a is not None]
        layers = src.model.cfg.num_layers
        # The prefill chooses the first token; each decode stage `per_stage` more.
        decode_stages = max(1, -(-(n_tokens - 1) // per_stage))
        first_stage = len(self.stages)

        def generate(prompts: list[tuple[int, ...]], lora: Any, label: str, finished: Callable[[BatchDecode], None],
                     kind: StageKind) -> None:
            width = max(len(p) for p in prompts)
            first = len(self.stages)

            def prefill() -> None:
                self._live = BatchDecode(src.model, prompts, lora, n_tokens, stop)
                self._live.prefill()

            def decode(last: bool) -> None:
                live = self._live
                assert live is not None
                live.decode(per_stage)
                if last:
                    self._live = None
                    finished(live)
            b = len(prompts)
            self._add(kind, f"guard {label} prefill[{b} prompts]",
                      lambda: src.costs.score(b * width, layers, b, with_reference=False), prefill, first)
            for s in range(decode_stages):
                self._add(kind, f"guard {label} decode[{b} prompts, {per_stage} tokens]",
                          lambda: _times(src.costs.score(b, layers, b, with_reference=False), per_stage),
                          lambda last=s == decode_stages - 1: decode(last), first)

        for batch in batches:
            logits: list[torch.Tensor | None] = []

            def kept(live: BatchDecode, logits: list[torch.Tensor | None] = logits) -> None:
                mine.extend(live.ids)
                logits.clear()
                for i, rows in enumerate(live.logits):  # each row's steps freed once stacked (#28)
                    logits.append(torch.stack(rows) if rows else torch.zeros(0, src.model.cfg.vocab_size))
                    live.logits[i] = []

            generate(batch, src.policy(self.candidate), "candidate", kept, StageKind.SCORE)

            def kl(batch: list[tuple[int, ...]] = batch, logits: list[torch.Tensor | None] = logits) -> None:
                ref = each_answer_logits(src.model, batch, mine[-len(batch):], src.policy(None), n_tokens)
                skip = guard.kl_skip_tokens
                # One answer's reference logits at a time, each answer's own dropped once compared:
                # a batch's two [answers x tokens x vocab] never sit side by side (#28).
                for i, reference in enumerate(ref):
                    mine_logits, logits[i] = logits[i], None
                    if mine_logits.shape[0] > skip:
                        kls.append(token_kl(mine_logits[skip:], reference[skip:]))
                    del mine_logits, reference
                logits.clear()
            b = len(batch)
            rows = b * (max(len(p) for p in batch) + n_tokens)
            self._add(StageKind.REFERENCE, f"guard KL[{b} prompts]",
                      lambda rows=rows, b=b: src.costs.score(rows, layers, b * n_tokens, with_reference=False), kl)
        if need_reference:
            for batch in batches:
                generate(batch, src.policy(None), "reference", lambda live: base.extend(live.ids), StageKind.REFERENCE)
        own = self.stages[first_stage:]

        def conclude() -> None:
            seconds = sum(s.seconds or 0.0 for s in own)
            self.degeneration = summarize(src.tokenizer, len(self.prompts), n_tokens, mine, kls, base, seconds,
                                          guard.kl_skip_tokens)
            if len(src.reference_answers) > 16 * max(1, guard.degeneration_prompts):
                src.reference_answers.clear()  # the held-out prompts changed many times over
            for key, answer in zip(keys, base, strict=True):
                src.reference_answers[key] = tuple(answer)
        self._add(StageKind.REFERENCE, "guard verdict", lambda: StageEstimate(0.0, 0, 0), conclude)


def _times(est: StageEstimate, n: int) -> StageEstimate:
    return StageEstimate(est.seconds * n, est.peak_bytes, est.held_bytes)


def judged_pairs(tokens: Sequence[PairTokens], limit: int) -> list[PairTokens]:
    """At most `limit` held-out pairs (0: all), in their order: the newest quarter (at least one)
    always, the rest chosen by a hash of each pair's ids, so the same pairs stay chosen as the
    held-out set grows (a candidate is judged on the pairs its predecessor was, and the served
    version's rows for them are known) and a new pair enters in proportion."""
    if not limit or len(tokens) <= limit:
        return list(tokens)
    newest = max(1, limit // 4)
    older = list(range(len(tokens) - newest))
    older.sort(key=lambda i: hashlib.blake2b(repr((tokens[i].prompt, tokens[i].chosen, tokens[i].rejected))
                                             .encode(), digest_size=8).digest())
    keep = set(older[:limit - newest]) | set(range(len(tokens) - newest, len(tokens)))
    return [t for i, t in enumerate(tokens) if i in keep]


def heldout_prompts(trainer: AdapterTrainer, pairs: Sequence[PairLike | PairTokens],
                    unpaired: Sequence[UnpairedLike], limit: int) -> list[tuple[int, ...]]:
    """The first `limit` distinct held-out prompts as ids, the pairs' before the unpaired examples'."""
    out: list[tuple[int, ...]] = []
    for item in (*pairs, *unpaired):
        if len(out) >= limit:
            break
        if isinstance(item, PairTokens):
            prompt = item.prompt
        elif hasattr(item, "desirable"):
            prompt = trainer.tokenize_unpaired(item, mismatched=False).tokens.prompt  # type: ignore[arg-type]
        else:
            prompt = trainer.tokenize(item).prompt  # type: ignore[arg-type]
        if prompt not in out:
            out.append(prompt)
    return out
