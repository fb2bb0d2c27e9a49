"""Runs an iteration's forward on the backend and, when it raises, isolates the rows that make
it fail: their requests fail alone and the rest keep their logits. Tells a broken engine from
broken requests with a one-token probe. Owns no request lifecycle: it asks the engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from edge_runtime.backends.base import Backend
from edge_runtime.device_sampling import synchronize
from edge_runtime.errors import EngineBroken
from edge_runtime.kv.block_pool import BlockPool
from edge_runtime.model.tokenizer import IncrementalDecoder
from edge_runtime.outputs import RequestOutput
from edge_runtime.sampling import SamplingParams
from edge_runtime.sched.batch import Batch, ScheduledSeq
from edge_runtime.sched.cost_model import CostModel
from edge_runtime.sequence import Request, SeqStatus, Sequence

log = logging.getLogger(__name__)

# Fails a request still in flight and returns its output; None when it already left.
FailInFlight = Callable[[Request, str], RequestOutput | None]


@dataclass
class Forward:
    """What an iteration's forward produced: the logits rows of the sequences that sample (None
    when no item was left to run) and the outputs of requests failed because of their rows."""

    seqs: list[Sequence]
    logits: torch.Tensor | None
    failed: list[RequestOutput] = field(default_factory=list)


class ForwardRunner:
    def __init__(self, backend: Backend, costs: CostModel, pool: BlockPool, vocab_size: int,
                 new_decoder: Callable[[], IncrementalDecoder], clock: Callable[[], float]) -> None:
        self.backend = backend
        self.costs = costs
        self.pool = pool
        self.vocab_size = vocab_size
        self.new_decoder = new_decoder  # a stream decoder for the probe's scratch sequence
        self.clock = clock

    def run(self, batch: Batch, fail: FailInFlight) -> Forward:
        """The bin's forward. If it raises, the requests whose rows make it fail are failed
        alone (`fail`), their items leave the batch, and the rest still run."""
        failed: list[RequestOutput] = []
        logits = self._logits(batch, fail, failed)
        return Forward([item.seq for item in batch.items if item.samples], logits, failed)

    def _logits(self, batch: Batch, fail: FailInFlight, failed: list[RequestOutput]) -> torch.Tensor | None:
        if not batch.items:
            return None
        started = time.perf_counter()
        try:
            # The logits stay on their device (the commit chooses tokens there); waiting for the
            # device also makes a GPU's fault surface here, where it can be isolated.
            logits = self.backend.execute(batch)
            synchronize(logits)
        except Exception as exc:
            return self.isolate_fault(batch, exc, fail, failed)
        self.costs.observe_forward(batch.planned_forward_s, time.perf_counter() - started)
        return logits

    def isolate_fault(self, batch: Batch, exc: Exception, fail: FailInFlight,
                      failed: list[RequestOutput]) -> torch.Tensor | None:
        """Run the items again in halves until each failure is pinned on single items; their
        requests fail, every other item keeps the logits of a run that worked (rewriting a
        position's keys and values is harmless: same tokens, same slots). When no item runs even
        alone, a one-token probe on a scratch sequence tells a broken engine (raise
        `EngineBroken`) from requests that break the forward (they fail, the engine goes on)."""
        log.warning("the forward of %d sequence(s) failed (%s: %s); retrying in parts to find the cause",
                    len(batch.items), type(exc).__name__, exc)
        rows: dict[int, torch.Tensor] = {}  # id(item) -> its logits rows [num_logits, vocab], for items that sample
        culprits: dict[int, Exception] = {}  # id(item) -> what it raised alone

        def attempt(items: list[ScheduledSeq], error: Exception | None) -> None:
            if error is None:
                try:
                    out = self.backend.execute(Batch(items, []))
                    # A part's rows are kept while later parts run: a copy, in case the backend
                    # returns a buffer it reuses (a replayed graph's output) on its device.
                    out = out if out.device.type == "cpu" else out.clone()
                    synchronize(out)
                except Exception as exc:
                    error = exc
                else:
                    sampling = [i for i in items if i.samples]
                    parts = out.split([i.num_logits for i in sampling])  # a draft's item has several
                    for part, item in zip(parts, sampling, strict=True):
                        rows[id(item)] = part
                    return
            if len(items) == 1:
                culprits[id(items[0])] = error
                return
            half = len(items) // 2
            attempt(items[:half], None)
            attempt(items[half:], None)

        items = list(batch.items)
        attempt(items, exc)
        bad = [item for item in items if id(item) in culprits]
        for item in bad:
            cause = culprits[id(item)]
            output = fail(item.seq.request, f"the forward failed on this request: {type(cause).__name__}: {cause}")
            if output is not None:
                failed.append(output)
        batch.items = [item for item in items if item.seq.status is not SeqStatus.FINISHED]
        if len(bad) == len(items) and not self.forward_works():
            raise EngineBroken(f"the forward fails for every request and for a one-token probe: "
                               f"{type(exc).__name__}: {exc}") from exc
        if not batch.items:
            return None
        sampled = [rows[id(item)] for item in batch.items if item.samples]
        return torch.cat(sampled) if sampled else torch.empty(0, self.vocab_size)

    def forward_works(self) -> bool:
        """One token of a scratch sequence on the base model, in a block of its own."""
        if not self.pool.num_free:
            return False
        block = self.pool.allocate()
        probe = Request("engine-probe", "", [0], SamplingParams(max_tokens=1), self.clock())
        seq = Sequence(-1, probe, 0, [0], self.new_decoder(), block_table=[block])
        probe.seqs.append(seq)
        try:
            self.backend.execute(Batch([ScheduledSeq(seq, 1)], []))
        except Exception:
            log.exception("the engine's one-token probe failed too")
            return False
        finally:
            seq.status = SeqStatus.FINISHED
            self.pool.release(block)
        return True
