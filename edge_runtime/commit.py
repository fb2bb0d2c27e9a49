"""The commit step of an iteration: from the forward's logits to each sequence's next token
(grammar masks, logit shaping, sampling, logprobs; plain rows on the logits' device when they
are on one, edge_runtime.device_sampling), then stop checks and streaming. A request whose token
cannot be committed fails alone. Owns no request lifecycle: it asks the engine.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from edge_runtime.constraints import GrammarCompiler, unpack_masks
from edge_runtime.device_sampling import Chosen, RowChoice, choose_rows
from edge_runtime.outputs import RequestOutput, TokenEvent, TokenLogprob
from edge_runtime.sampling import (
    SamplingError,
    choose,
    mask_rows,
    sample_next,
    shape_logits,
    token_logprobs,
)
from edge_runtime.sched.scheduler import Scheduler
from edge_runtime.sequence import Request, SeqStatus, Sequence
from edge_runtime.spec.drafter import drafter_for
from edge_runtime.spec.verify import Verifier

if TYPE_CHECKING:
    from edge_runtime.backends.base import Backend
    from edge_runtime.config import EngineConfig

log = logging.getLogger(__name__)

DEVICE_SAMPLING = ("auto", "on", "off")

EndRequest = Callable[[Request, str, float], RequestOutput]
FailRequest = Callable[[Request, str], RequestOutput]


class TokenCommitter:
    def __init__(self, grammars: GrammarCompiler, eos_ids: set[int] | frozenset[int], vocab_size: int,
                 max_context: int, scheduler: Scheduler, requests: dict[str, Request],
                 end_request: EndRequest, fail_request: FailRequest, clock: Callable[[], float],
                 speculation: tuple[EngineConfig, Backend] | None = None, device_sampling: str | None = None) -> None:
        self.grammars = grammars
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.scheduler = scheduler
        self.requests = requests  # the engine's requests in flight (shared, not copied)
        self.end_request = end_request
        self.fail_request = fail_request
        self.clock = clock
        self.tokens_generated = 0
        # Speculative decoding (edge_runtime.spec): the engine's settings and backend give the
        # scheduler's drafter, whose decode rows' drafts this step verifies.
        if speculation is not None:
            scheduler.drafter = drafter_for(*speculation, max_context, scheduler.rope_switch)
        self.verifier = Verifier(self.commit_token, scheduler.pool, scheduler.drafter)
        # Where plain rows choose their token: "auto" = on the logits' device when it is not the
        # CPU; "on" = that path for CPU logits too (tests); "off" = every row on the host.
        if device_sampling is None:
            device_sampling = speculation[0].device_sampling if speculation is not None else "auto"
        if device_sampling not in DEVICE_SAMPLING:
            raise ValueError(f"device_sampling must be one of {DEVICE_SAMPLING}, got {device_sampling!r}")
        self.device_sampling = device_sampling
        # Rows whose token was chosen on the device, and rows chosen on the host and why.
        self.sampling_stats: dict[str, int | str] = {
            "device_rows": 0, "host_rows": 0, "host_rows_grammar": 0, "host_rows_speculative": 0,
            "host_rows_fallback": 0, "device_failures": 0, "last_device_failure": ""}

    def commit(self, seqs: list[Sequence], logits: torch.Tensor | None) -> list[RequestOutput]:
        """Each sampling sequence's next token from its row of `logits` (None: the forward ran
        nothing); the outputs of the requests that finished."""
        if logits is None:
            return []
        if self.device_sampling == "on" or (self.device_sampling == "auto" and logits.device.type != "cpu"):
            return self.commit_on_device(seqs, logits)
        logits = logits.cpu()  # a no-op for CPU logits: the host path as it always was
        self.sampling_stats["host_rows"] += sum(seq.status is not SeqStatus.FINISHED for seq in seqs)
        done: list[RequestOutput] = []
        now = self.clock()
        first = first_rows(seqs)  # a sequence's first logits row (a draft adds rows after it)
        logits = self.apply_grammars(seqs, logits, first)
        greedy = greedy_tokens(logits) if any(seq.params.greedy for seq in seqs) else None
        for j, seq in enumerate(seqs):
            if seq.status is SeqStatus.FINISHED:
                continue  # its request failed on an earlier row of this step
            row = first[j]
            try:
                if seq.spec is not None and seq.spec.pending:
                    output = self.verifier.commit(seq, logits, row, greedy, now)
                else:
                    output = self.commit_token(seq, logits[row], greedy[row] if greedy is not None else None, now)
            except Exception as exc:  # sampling, stop check, detokenising, the callback: this request's
                output = self.fail_request(seq.request, f"{type(exc).__name__}: {exc}")
            if output is not None:
                done.append(output)
        return done

    def commit_on_device(self, seqs: list[Sequence], logits: torch.Tensor) -> list[RequestOutput]:
        """`commit` with every plain row's token chosen on the logits' device in one pass (one
        transfer of the ids); the rows the host must see (a grammar's mask is computed there, a
        draft is verified there) are copied there alone, in one transfer, and go the host way."""
        done: list[RequestOutput] = []
        now = self.clock()
        first = first_rows(seqs)
        plain: list[int] = []
        host: list[int] = []
        for j, seq in enumerate(seqs):
            if seq.status is SeqStatus.FINISHED:
                continue
            if seq.spec is not None and seq.spec.pending:
                host.append(j)
                self.sampling_stats["host_rows_speculative"] += 1
            elif seq.matcher is not None:
                host.append(j)
                self.sampling_stats["host_rows_grammar"] += 1
            else:
                plain.append(j)
        chosen = self.choose_plain(seqs, logits, first, plain)
        if chosen is None:  # the device pass failed (logged): those rows go the host way too
            host = sorted(host + plain)
            chosen = {}
        rows_of = {j: self._rows(seqs[j], first[j]) for j in host}
        host_logits, host_first = None, {}
        if host:
            index = [row for j in host for row in rows_of[j]]
            host_logits = logits.index_select(0, torch.tensor(index, device=logits.device)).cpu()
            at = 0
            for j in host:
                host_first[j] = at
                at += len(rows_of[j])
            host_logits = self.apply_grammars([seqs[j] for j in host], host_logits, [host_first[j] for j in host])
        greedy = greedy_tokens(host_logits) if host_logits is not None else None
        for j, seq in enumerate(seqs):
            if seq.status is SeqStatus.FINISHED or (j not in chosen and j not in host_first):
                continue
            try:
                if j in chosen:
                    pick = chosen[j]
                    if pick.error is not None:
                        raise SamplingError(pick.error)
                    logprob = self.make_logprob(pick.token, *pick.logprobs) if pick.logprobs is not None else None
                    output = self.accept_token(seq, pick.token, logprob, now)
                elif seq.spec is not None and seq.spec.pending:
                    output = self.verifier.commit(seq, host_logits, host_first[j], greedy, now)
                else:
                    row = host_first[j]
                    output = self.commit_token(seq, host_logits[row], greedy[row] if greedy is not None else None, now)
            except Exception as exc:  # as in `commit`: this request fails, the others go on
                output = self.fail_request(seq.request, f"{type(exc).__name__}: {exc}")
            if output is not None:
                done.append(output)
        return done

    def choose_plain(self, seqs: list[Sequence], logits: torch.Tensor, first: list[int],
                     plain: list[int]) -> dict[int, Chosen] | None:
        """The plain rows' choices (by sequence index), or None when the device pass failed."""
        if not plain:
            return {}
        rows = [RowChoice(first[j], seqs[j].params, seqs[j].counts, sampling_key(seqs[j]), seqs[j].num_generated)
                for j in plain]
        try:
            picks = choose_rows(logits, rows)
        except Exception as exc:  # a device that cannot run a kernel must not stop serving: the host can
            # A kernel that failed once fails again (a missing image, a sticky fault): the host
            # chooses from now on, said once here and kept in `sampling_stats`.
            log.warning("sampling on %s failed (%s: %s); the host chooses every row from now on",
                        logits.device, type(exc).__name__, exc)
            self.device_sampling = "off"
            self.sampling_stats["device_failures"] += 1
            self.sampling_stats["host_rows_fallback"] += len(plain)
            self.sampling_stats["last_device_failure"] = f"{type(exc).__name__}: {exc}"
            return None
        self.sampling_stats["device_rows"] += len(plain)
        return dict(zip(plain, picks, strict=True))

    @staticmethod
    def _rows(seq: Sequence, first: int) -> list[int]:
        return list(range(first, first + 1 + (len(seq.spec.pending) if seq.spec is not None else 0)))

    def apply_grammars(self, seqs: list[Sequence], logits: torch.Tensor, first: list[int]) -> torch.Tensor:
        """The step's logits with every constrained row's disallowed tokens at -inf (a float32
        copy; `logits` itself when no row is constrained), the masks computed together; a
        request whose grammar fails here fails alone. Constrained rows never carry drafts."""
        constrained = [j for j, s in enumerate(seqs) if s.matcher is not None and s.status is not SeqStatus.FINISHED]
        if not constrained:
            return logits
        try:
            packed = self.grammars.masks([seqs[j].matcher for j in constrained])
        except Exception as exc:
            for j in constrained:
                if seqs[j].request.request_id in self.requests:
                    self.fail_request(seqs[j].request, f"the grammar's mask failed: {type(exc).__name__}: {exc}")
            return logits
        return mask_rows(logits, [first[j] for j in constrained], unpack_masks(packed, self.vocab_size))

    def commit_token(self, seq: Sequence, logits: torch.Tensor, greedy: int | None,
                     now: float, chosen: Callable[[torch.Tensor], int] | None = None) -> RequestOutput | None:
        """Shape the row (its grammar's mask already applied), choose, stream and stop-check one
        sequence's new token; its request's output when this token finished the request.
        `chosen`: picks the token from the shaped row instead (speculative verification)."""
        params = seq.params
        row = logits
        if params.shapes_logits:
            row = shape_logits(logits, params, seq.counts)
        if chosen is not None:
            token = chosen(row)
        elif params.shapes_logits:
            token = choose(row, params, seq.generator)
        elif params.greedy and greedy is not None:
            token = greedy
        else:
            token = sample_next(logits, params, seq.generator)
        logprob = self.logprob(row, token, params.logprobs) if params.logprobs is not None else None
        return self.accept_token(seq, token, logprob, now)

    def accept_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None,
                     now: float) -> RequestOutput | None:
        """One sequence's chosen token: its grammar, counts, stream and stop checks; its
        request's output when this token finished the request."""
        params = seq.params
        grammar_done = False
        if seq.matcher is not None:
            if not seq.matcher.consume_token(token):
                raise SamplingError(f"the grammar refused token {token}: {seq.matcher.get_error()}")
            grammar_done = seq.matcher.is_stopped()
        if params.presence_penalty or params.frequency_penalty:
            seq.counts[token] = seq.counts.get(token, 0) + 1
        seq.token_ids.append(token)
        self.tokens_generated += 1
        metrics = seq.request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.generated_tokens += 1
        reason = None
        thought = ""
        eos = token in self.eos_ids and (not params.ignore_eos or seq.matcher is not None)
        if eos or token in params.stop_token_ids:
            reason = "stop"
            logprob = None  # the stop token makes no text
        else:
            piece = seq.decoder.step(token)
            if seq.reasoning is not None:
                thought, piece = seq.reasoning.feed(piece)
                if seq.pending_matcher is not None and seq.reasoning.answering:
                    grammar_done = start_grammar(seq)
            seq.text += piece
            if logprob is not None:
                seq.logprobs.append(logprob)
            if params.stop:
                cut = find_stop(seq.text, params.stop, seq.emitted)
                if cut is not None:
                    seq.text = seq.text[:cut]
                    reason = "stop"
            if reason is None and grammar_done:
                reason = "stop"  # the grammar is complete and can take nothing more
        if reason is None and (seq.num_generated >= params.max_tokens or seq.num_tokens >= self.max_context):
            reason = "length"
        if reason is not None:
            if seq.reasoning is not None:  # what the splitter held: a tag that never completed
                held_thought, held_answer = seq.reasoning.finish()
                thought += held_thought
                seq.text += held_answer
            self.scheduler.finish(seq, reason)
        else:
            self.scheduler.token_appended(seq)  # LongRoPE: past the switch, the sequence is recomputed
        seq.thought += thought
        emit(seq, releasable(seq, reason is not None), token, finished=reason is not None, logprob=logprob,
             reasoning=thought)
        request = seq.request
        if reason is not None and request.finished and request.request_id in self.requests:
            return self.end_request(request, reason, now)
        return None

    def logprob(self, row: torch.Tensor, token: int, k: int) -> TokenLogprob:
        return self.make_logprob(token, *token_logprobs(row, token, k))

    def make_logprob(self, token: int, chosen: float, top: list[tuple[int, float]]) -> TokenLogprob:
        spell = self.grammars.token_bytes
        return TokenLogprob(token, chosen, spell(token), [(t, lp, spell(t)) for t, lp in top])


def first_rows(seqs: list[Sequence]) -> list[int]:
    """Each sampling sequence's first row in the step's logits: one row each, plus one per
    token of the draft its decode row carried."""
    rows, at = [], 0
    for seq in seqs:
        rows.append(at)
        at += 1 + (len(seq.spec.pending) if seq.spec is not None else 0)
    return rows


def releasable(seq: Sequence, finished: bool) -> str:
    """Text that can be streamed now: all of it at the end, otherwise all but a tail that
    could still turn out to be the start of a stop string."""
    hold = 0 if finished or not seq.params.stop else max(len(s) for s in seq.params.stop) - 1
    upto = max(seq.emitted, len(seq.text) - hold)
    piece = seq.text[seq.emitted : upto]
    seq.emitted = upto
    return piece


def emit(seq: Sequence, text: str, token: int | None, finished: bool, logprob: TokenLogprob | None = None,
         reasoning: str = "") -> None:
    """Hand one event of `seq` to its request's callback, if it has one."""
    callback = seq.request.on_token
    if callback is not None:
        callback(TokenEvent(seq.request.request_id, seq.index, token, text, finished,
                            seq.finish_reason if finished else None, logprob, reasoning))


def start_grammar(seq: Sequence) -> bool:
    """The think block closed: the grammar that shapes the answer takes over from the next token.
    A reply that answered without opening a block has its answer so far read by the grammar
    first (SamplingError if it cannot be an answer's start). Returns whether it is complete."""
    matcher, seq.pending_matcher = seq.pending_matcher, None
    if not seq.reasoning.opened and not matcher.consume_tokens(seq.output_ids):
        raise SamplingError(f"the answer began outside the grammar: {matcher.get_error()}")
    seq.matcher = matcher
    return matcher.is_stopped()


def greedy_tokens(logits: torch.Tensor) -> list[int] | None:
    """Every row's argmax in one call (the first maximal index, like `torch.argmax`), or None
    where numpy cannot read the logits in place. NumPy's float32 argmax is vectorised: ~15x
    torch's on one thread, ~0.9 ms a step at 16 rows of a 49k vocabulary."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2 or logits.requires_grad:
        return None
    return logits.numpy().argmax(axis=1).tolist()


def sampling_key(seq: Sequence) -> int:
    """The key of a sequence's counter-based draws: its generator's seed (the request's seed plus
    the candidate's index, or a random one drawn once, edge_runtime.intake); greedy rows draw
    nothing. A sampling sequence built without a generator gets one here, as intake makes it."""
    if seq.params.greedy:
        return 0
    if seq.generator is None:
        seq.generator = torch.Generator().manual_seed(secrets.randbits(63))
    return seq.generator.initial_seed()


def find_stop(text: str, stops: tuple[str, ...], emitted: int) -> int | None:
    """Earliest index where a stop string starts, searching only text not yet streamed (plus
    the overlap a stop string could straddle)."""
    best = None
    for stop in stops:
        idx = text.find(stop, max(0, emitted - len(stop) + 1))
        if idx != -1 and (best is None or idx < best):
            best = idx
    return best
