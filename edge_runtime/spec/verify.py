"""The acceptance rule of speculative sampling for a deterministic draft (Leviathan et al. 2023,
Chen et al. 2023): the draft is a point mass q = 1 at x, so x is kept with probability
min(1, p(x)/q(x)) = p(x); on rejection the token comes from max(0, p - q) renormalised, which
is p with x removed. The committed token is then distributed exactly as p."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from edge_runtime.sampling import SamplingParams, sampling_probs
from edge_runtime.sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    from edge_runtime.kv.block_pool import BlockPool
    from edge_runtime.outputs import RequestOutput
    from edge_runtime.spec.drafter import Drafter


def verify_sampled(probs: torch.Tensor, drafted: int, generator: torch.Generator | None) -> tuple[int, bool]:
    """(token, whether it is the drafted one) for one row whose target distribution is `probs`
    (float64 [vocab], what `sampling.sample_next` would draw from)."""
    p = float(probs[drafted])
    if p > 0.0 and float(torch.rand((), generator=generator, dtype=torch.float64)) < p:
        return drafted, True
    residual = probs.clone()
    residual[drafted] = 0.0
    if float(residual.sum()) <= 0.0:  # p(x) = 1 yet u >= 1 cannot happen; guard rounding anyway
        return drafted, True
    return int(torch.multinomial(residual, 1, generator=generator)), False


class Verifier:
    """Commits a decode row that carried a draft: walks its rows in order, each token chosen as a
    plain decode step would choose it (greedy: the argmax; sampling: the rule above), stops at
    the first token that differs from the draft, at the end of the request, or after the row
    that follows the whole draft; then keeps the keys and values of the accepted drafts and
    gives back the blocks that held only rejected ones."""

    def __init__(self, commit_token: Callable[..., RequestOutput | None], pool: BlockPool, drafter: Drafter) -> None:
        self.commit_token = commit_token  # TokenCommitter.commit_token: stream, stop, count one token
        self.pool = pool
        self.drafter = drafter

    def commit(self, seq: Sequence, logits: torch.Tensor, first: int, greedy: list[int] | None,
               now: float) -> RequestOutput | None:
        draft = seq.spec.pending
        seq.spec.pending = ()
        params = seq.params
        accepted = 0
        output = None
        for i in range(len(draft) + 1):
            row = first + i
            proposed = draft[i] if i < len(draft) else None
            if proposed is None or params.greedy:
                output = self.commit_token(seq, logits[row], greedy[row] if greedy is not None else None, now)
                token = seq.token_ids[-1] if seq.status is not SeqStatus.FINISHED else None
                hit = token == proposed
            else:
                outcome: list[bool] = []
                output = self.commit_token(seq, logits[row], None, now,
                                           chosen=lambda row, x=proposed, o=outcome: pick(row, x, params, seq, o))
                hit = outcome[0]
            if seq.status is SeqStatus.FINISHED or proposed is None or not hit:
                break
            accepted += 1
        self.drafter.record(seq, len(draft), accepted)
        if seq.status is not SeqStatus.FINISHED:
            self.roll_back(seq, accepted)
        return output

    def roll_back(self, seq: Sequence, accepted: int) -> None:
        """The row's own token and the accepted drafts now have valid keys and values (the
        scheduler counted the first); the rejected drafts' slots are past the sequence's end,
        where its next tokens overwrite them, and blocks that hold nothing else go back."""
        seq.num_computed += accepted
        keep = -(-seq.num_slots // self.pool.block_size)
        for block in reversed(seq.block_table[keep:]):
            self.pool.release(block)
        del seq.block_table[keep:]


def pick(shaped: torch.Tensor, proposed: int, params: SamplingParams, seq: Sequence, outcome: list[bool]) -> int:
    """The sampled row's token under the speculative rule, noting whether it was the draft's."""
    token, hit = verify_sampled(sampling_probs(shaped, params), proposed, seq.generator)
    outcome.append(hit)
    return token
