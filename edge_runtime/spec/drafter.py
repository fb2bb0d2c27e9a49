"""Decides, per decode row, whether a sequence speculates and with which draft: the request's
`speculation` choice, what its request allows (no grammar, no KV pruning), its acceptance so
far, and the tokens left before max_tokens or the context's end."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from edge_runtime.spec.acceptance import Acceptance
from edge_runtime.spec.lookup import NgramIndex

if TYPE_CHECKING:
    from edge_runtime.backends.base import Backend
    from edge_runtime.config import EngineConfig
    from edge_runtime.sequence import Sequence

MODES = ("auto", "on", "off")
# Backends where speculation measurably pays with the default model (tools/bench_spec.py):
# engine.speculation "auto" turns it on for requests' "auto" there only, and only where the
# backend is row-invariant (`engine.deterministic`), so that greedy answers stay the same.
PAYS_ON: tuple[str, ...] = ("onnxruntime",)


@dataclass
class SpecState:
    """One sequence's speculation: its n-gram index, its acceptance, and the draft its current
    decode row carries (set when the row is scheduled, consumed when its logits are committed)."""

    index: NgramIndex
    acceptance: Acceptance
    pending: tuple[int, ...] = ()
    index_len: int = 0  # tokens the index has seen: a sequence that lost tokens is re-indexed
    tokens_saved: int = 0  # forwards saved: tokens committed beyond one per verify step


class Drafter:
    """Prompt-lookup drafts for decode rows. `k`: the most draft tokens a row carries (0: the
    engine never speculates). `auto_on`: whether requests that leave the choice to the engine
    ("auto") speculate at all (engine.speculation); "on" always drafts, "off" never; "auto"
    drafts until its acceptance says it does not pay (Acceptance). `max_context`: drafts stop
    before the context's end; `rope_switch` (LongRoPE): such models do not speculate, since a
    draft crossing the switch would be computed with the wrong factors. `greedy`: whether greedy
    rows may draft, i.e. the backend's verify rows round as its decode rows (`row_invariant`);
    elsewhere a verify could flip a near-tie, and greedy is greedy (#31), so only sampled rows
    draft (their distribution is kept either way)."""

    def __init__(self, k: int = 4, max_n: int = 3, auto_on: bool = True, warmup: int = 16,
                 threshold: float = 0.3, cooldown: int = 64, max_context: int | None = None,
                 rope_switch: int | None = None, greedy: bool = True) -> None:
        if k < 0:
            raise ValueError(f"speculative_tokens must be >= 0, got {k}")
        self.k = 0 if rope_switch is not None else k
        self.max_context = max_context
        self.max_n = max_n
        self.auto_on = auto_on
        self.greedy = greedy
        self.warmup, self.threshold, self.cooldown = warmup, threshold, cooldown
        self.drafted = 0  # engine-wide totals (stats)
        self.accepted = 0
        self.verifies = 0

    def state(self, seq: Sequence) -> SpecState:
        if seq.spec is None:
            seq.spec = SpecState(NgramIndex(self.max_n), Acceptance(self.warmup, self.threshold, self.cooldown))
        return seq.spec

    def eligible(self, seq: Sequence) -> bool:
        """Whether this sequence's rows may carry drafts at all: its request asked for (or left
        to the engine) speculation, and nothing makes a draft unverifiable by a plain argmax
        or sample: a grammar (its mask would have to be advanced through every draft), or
        decode KV pruning (its retained layout follows one token a step); a greedy row only where
        drafts cannot change its tokens (`greedy`)."""
        mode = getattr(seq.params, "speculation", "auto")
        if mode == "off" or (mode == "auto" and not self.auto_on) or (seq.params.greedy and not self.greedy):
            return False
        return seq.matcher is None and seq.pending_matcher is None and seq.kv_pruning is None and seq.kv_layout is None

    def propose(self, seq: Sequence, room: int) -> tuple[int, ...]:
        """The draft for the sequence's next decode row (at most `room` tokens: what max_tokens
        and the context leave after the row's own token), () when it does not speculate."""
        if room <= 0 or not self.eligible(seq):
            return ()
        state = self.state(seq)
        if getattr(seq.params, "speculation", "auto") == "auto" and not state.acceptance.active:
            state.acceptance.plain_step()
            return ()
        tokens = seq.token_ids
        if len(tokens) < state.index_len:  # preempted and shortened? rebuild
            state.index = NgramIndex(self.max_n)
        state.index_len = len(tokens)
        return tuple(state.index.draft(tokens, min(self.k, room)))

    def plan(self, seq: Sequence) -> int:
        """A decode row's draft, kept as the sequence's pending one; returns its length (the
        row costs 1 + that many tokens in the bin)."""
        if not self.k:
            return 0
        room = seq.params.max_tokens - seq.num_generated - 1
        if self.max_context is not None:
            room = min(room, self.max_context - seq.num_tokens - 1)
        draft = self.propose(seq, room)
        if draft or seq.spec is not None:
            self.state(seq).pending = draft
        return len(draft)

    def admit(self, seq: Sequence, n: int, amount: int) -> tuple[int, ...]:
        """The draft an admitted item carries: its planned one, cut to the `amount` of tokens the
        bin placed, and only on a decode row (`n` = 1 token of the sequence's own)."""
        if seq.spec is None:
            return ()
        draft = seq.spec.pending[: max(0, amount - n)] if n == 1 else ()
        seq.spec.pending = draft
        return draft

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A verify step's outcome, for the request's acceptance and the engine's totals."""
        state = self.state(seq)
        state.acceptance.record(drafted, accepted)
        state.tokens_saved += accepted
        self.drafted += drafted
        self.accepted += accepted
        self.verifies += 1

    def stats(self) -> dict[str, float | int]:
        return {"drafted": self.drafted, "accepted": self.accepted, "verifies": self.verifies,
                "acceptance": round(self.accepted / self.drafted, 4) if self.drafted else 0.0}


def drafter_for(config: EngineConfig, backend: Backend, max_context: int, rope_switch: int | None) -> Drafter:
    """The engine's drafter from its settings: none (k = 0) where the backend cannot verify drafts."""
    if config.speculation not in MODES:
        raise ValueError(f"engine.speculation must be one of {MODES}, got {config.speculation!r}")
    k = config.speculative_tokens if getattr(backend, "verifies_drafts", False) else 0
    alike = getattr(backend, "row_invariant", False)
    auto_on = config.speculation == "on" or (config.speculation == "auto" and backend.name in PAYS_ON and alike)
    return Drafter(k, auto_on=auto_on, max_context=max_context, rope_switch=rope_switch, greedy=alike)
