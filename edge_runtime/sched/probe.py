"""Synthetic batches timed through a backend: probe sequences (just enough of a `Sequence`), the
shapes the forward's cost model is fitted on, and timing one shape in scratch KV blocks given
back afterwards. Measures; fits nothing (cost_model.py does).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from edge_runtime.kv.block_pool import BlockPool
from edge_runtime.sched.batch import Batch, ScheduledSeq


def attended_pairs(context: int, new: int) -> int:
    """(query, key) pairs of `new` causal queries after `context` cached tokens."""
    return new * context + new * (new + 1) // 2


@dataclass
class ProbeRequest:
    adapter: Any = None
    adapter_key: str = ""
    served: Any = None
    cache_salt: str = ""


@dataclass
class ProbeSeq:
    """Just enough of a `Sequence` for a backend to run a synthetic batch."""

    token_ids: list[int]
    num_computed: int
    block_table: list[int]
    request: ProbeRequest = field(default_factory=ProbeRequest)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


# (sequences, cached context per sequence, new tokens per sequence): decode batches of several
# widths and depths, prefill chunks, and one mixed batch, so every coefficient is pinned down.
SHAPES: tuple[tuple[tuple[int, int, int], ...], ...] = (
    ((1, 16, 1),), ((1, 256, 1),), ((4, 64, 1),), ((8, 128, 1),), ((16, 32, 1),), ((16, 256, 1),),
    ((1, 0, 16),), ((1, 0, 64),), ((1, 0, 192),), ((1, 128, 64),),
    ((1, 0, 64), (8, 128, 1)),
)


Shape = tuple[tuple[int, int, int], ...]


def bounded(shapes: tuple[Shape, ...], max_tokens: int | None) -> tuple[Shape, ...]:
    """`shapes` with no forward of more new tokens than an iteration may hold (the scheduler's
    `max_batched_tokens`, which with the ledger's activation estimate bounds a real prefill
    chunk): a longer prefill is cut to that many, so a calibration never needs more memory than
    serving does (issue #28). Decode rows are kept; shapes made alike are measured once."""
    if not max_tokens:
        return shapes
    out: list[Shape] = []
    for shape in shapes:
        over = sum(n * new for n, _, new in shape) - max_tokens
        cut = []
        for n, ctx, new in shape:
            if over > 0 and new > 1:
                trimmed = max(1, new - -(-over // n))
                over -= n * (new - trimmed)
                new = trimmed
            cut.append((n, ctx, new))
        if sum(n * new for n, _, new in cut) <= max_tokens and tuple(cut) not in out:
            out.append(tuple(cut))
    return tuple(out)


def measure_forward(execute: Callable[[Batch], Any], pool: BlockPool, vocab: int, repeats: int = 3,
                    seed: int = 0, max_tokens: int | None = None) -> list[tuple[int, int, int, float]]:
    """Time each shape through the real backend (writing scratch K/V into free blocks, returned
    afterwards), no forward over `max_tokens` new tokens (`bounded`). Returns rows of (tokens,
    attended pairs, logit rows, seconds); shapes that do not fit the pool are skipped."""
    gen = torch.Generator().manual_seed(seed)
    rows = [measure_shape(execute, pool, vocab, shape, repeats, gen) for shape in bounded(SHAPES, max_tokens)]
    return [row for row in rows if row is not None]


class ShapeInterrupted(Exception):
    """A background shape gave way to work that arrived between its forwards."""


def measure_shape(execute: Callable[[Batch], Any], pool: BlockPool, vocab: int,
                  shape: tuple[tuple[int, int, int], ...], repeats: int,
                  gen: torch.Generator,
                  interrupted: Callable[[], bool] = lambda: False) -> tuple[int, int, int, float] | None:
    """One shape of `measure_forward`: (tokens, attended pairs, logit rows, seconds), or None
    when it does not fit the pool's free blocks. `interrupted` is asked between forwards; when
    it says yes the shape stops there (ShapeInterrupted, its blocks returned)."""
    size = pool.block_size
    blocks_needed = sum(n * -(-(ctx + new) // size) for n, ctx, new in shape)
    if blocks_needed > pool.num_free:
        return None
    taken: list[int] = []
    items = []
    for n, ctx, new in shape:
        for _ in range(n):
            table = [pool.allocate() for _ in range(-(-(ctx + new) // size))]
            taken += table
            ids = torch.randint(0, vocab, (ctx + new,), generator=gen).tolist()
            items.append(ScheduledSeq(ProbeSeq(ids, ctx, table), new))  # type: ignore[arg-type]
    batch = Batch(items, [])
    try:
        execute(batch)  # warm-up: allocator growth, kernel choice
        times = []
        for _ in range(repeats):
            if interrupted():
                raise ShapeInterrupted
            t0 = time.perf_counter()
            execute(batch)
            times.append(time.perf_counter() - t0)
    finally:
        for block in taken:
            pool.release(block)
    tokens = sum(n * new for n, _, new in shape)
    attended = sum(n * attended_pairs(ctx, new) for n, ctx, new in shape)
    logit_rows = sum(n for n, _, _ in shape)
    # The fastest of a few runs: on a machine shared with other work, slower runs measure
    # the others; the online correction adds today's contention back.
    return tokens, attended, logit_rows, min(times)
