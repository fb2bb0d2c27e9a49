"""The TBT SLO as latency budgets: the fixed share of the SLO an iteration packs to, and the
larger budget streams that decode faster than the SLO bank for fine-tune stages to spend
(`headroom_budget`). Arithmetic on streams' progress and costs; allocates and orders nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from edge_runtime.sched.cost_model import CostModel
from edge_runtime.sequence import SeqStatus, Sequence


def slo_budgets(slo_tbt_s: float, budget_fraction: float, max_fraction: float) -> tuple[float, float]:
    """(the iteration's fixed latency budget, the most headroom may grow it to) for a TBT SLO."""
    return budget_fraction * slo_tbt_s, slo_tbt_s * max(budget_fraction, max_fraction)


def headroom_budget(streams: Iterable[Sequence], now: float, base: float, cap: float, slo_tbt_s: float,
                    margin: float, next_forward_s: float, costs: CostModel) -> float:
    """This iteration's latency budget grown by the TBT headroom every stream has built up.

    The TBT SLO bounds a stream's *mean* time between tokens. A stream whose first token came
    at t_first and that holds k tokens gets its (k+1)-th from this iteration's forward and its
    next one at now + L + F (L: this iteration, forward and stages; F: the next forward,
    `next_forward_s`). Its mean gap stays within the SLO, with a safety margin m, as long as
        L <= t_first + (k + 1) * m * SLO - now - F.
    Holding that for every prefix keeps the mean within the SLO wherever the stream stops
    (EOS at any token). A stream that gets no token this iteration counts k instead of k + 1;
    one with no token yet needs its first gap alone to meet the SLO: L <= m * SLO plus its
    own remaining prefill (which this iteration's forward holds before that gap starts). The
    budget is the smallest such bound, at least `base` (the fixed share of the SLO) and at
    most `cap` (so a prompt arriving mid-iteration still meets its TTFT SLO). Streams decoding
    fast (a small batch on an idle machine) thus bank headroom that fine-tune stages too long
    for the fixed budget can spend."""
    if not (cap > base and math.isfinite(base) and math.isfinite(slo_tbt_s)):
        return base
    slo = margin * slo_tbt_s
    bound = cap
    for seq in streams:
        k = seq.num_generated
        if k >= seq.params.max_tokens:
            continue
        metrics = seq.request.metrics
        first = None if metrics is None else metrics.first_token_time
        if k == 0 or first is None:
            # Its first gap starts when its prefill forward ends: this iteration may
            # hold that prefill (not part of the gap) plus m * SLO of other work.
            left = seq.num_tokens - seq.num_computed
            allowance = slo + costs.inference_s(seq.num_computed, left, True)
        else:
            gets = 1 if seq.status is SeqStatus.RUNNING and not seq.in_prefill else 0
            allowance = first + (k + gets) * slo - now - next_forward_s
        if allowance < bound:
            bound = allowance
            if bound <= base:
                return base
    return bound


def budget_ms(seconds: float) -> float | None:
    """A budget in milliseconds for stats; None where it is unbounded."""
    return round(seconds * 1000, 3) if math.isfinite(seconds) else None
