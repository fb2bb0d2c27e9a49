"""The MACE policy: alignment-aware dynamic priorities (paper §4.1) and Algorithm 1's best-fit
packing of prefill chunks, decode steps and fine-tune stages into iteration bins (§4.2).
"""

from __future__ import annotations

import math

from edge_runtime.sched.bins import Bin
from edge_runtime.sched.policy import Policy
from edge_runtime.sched.task import Task, TaskKind


class MacePolicy(Policy):
    """MACE (Li, Fu, Dong, Liu: "MACE: A Hybrid LLM Serving System with Colocated SLO-Aware
    Continuous Retraining Alignment", section 4).

    Priority (§4.1): P_w(t) = pi_w + delta_w * (t - t_arr), plus gamma * L_DPO for fine-tune
    tasks, with pi_decode > pi_prefill > pi_ft (serve first) and delta_ft > delta_prefill >
    delta_decode (waiting fine-tunes climb fastest, so retraining never starves). t_arr is when
    the task was last (re)queued: a prompt's arrival, a stream's previous token, a fine-tune
    job's previous stage, as Algorithm 1 pushes unfinished tasks back "with updated priority".

    Packing (Algorithm 1): dequeue by priority; stop once bin 1 holds tau_mem of the memory or
    tau_task tasks were dequeued; put each task in the open bin where it fits with the smallest
    f = l1 * |free_mem - m| / M + l2 * |free_latency - l| / L, else open a new bin. Only bin 1
    runs; the others are re-planned next iteration. Our bins have a latency capacity (the
    iteration budget derived from the TBT SLO) because one engine thread runs a bin's work in
    sequence, so the latency term measures how tightly a task fills the remaining budget rather
    than the divergence from the bin's longest parallel task. A prefill that fits no bin whole
    may take a chunk of bin 1 (chunked prefill), unless chunks of what the bins leave would
    bring its first token past its TTFT SLO: then it takes the rest whole, beyond the budget
    (as an SLO-aware scheduler serves the request about to miss; chunking only spreads a
    prompt's cost, and the TBT SLO bounds a stream's mean gap, not each one). A fine-tune job
    placed in a bin takes its next stage in priority order; once every task was dequeued, its
    following stages fill what bin 1 has left (an aged job thus runs ahead of inference by one
    stage per iteration, not by as many stages as the budget holds). At most `max_bins` bins
    are planned (a bound on scheduler time; later bins are re-planned before they would run).
    """

    name = "mace"
    uses_slo_headroom = True

    @classmethod
    def defaults(cls) -> dict[str, float]:
        return {
            "pi_decode": 3.0,
            "pi_prefill": 2.0,
            "pi_ft": 0.0,
            "delta_decode": 0.05,  # per second waited
            "delta_prefill": 0.25,
            "delta_ft": 0.5,
            "gamma": 1.0,  # weight of the pair's DPO loss (nats)
            "lambda_mem": 1.0,
            "lambda_lat": 1.0,
            "tau_mem": 0.95,
            "tau_task": 64,
            "max_bins": 4,  # bins planned ahead; only bin 1 runs, the rest only steer best-fit
        }

    def __init__(self, **params: float) -> None:
        super().__init__(**params)
        p = self.params
        if not p["pi_decode"] > p["pi_prefill"] > p["pi_ft"]:
            raise ValueError("MACE needs pi_decode > pi_prefill > pi_ft")
        if not p["delta_ft"] > p["delta_prefill"] > p["delta_decode"]:
            raise ValueError("MACE needs delta_ft > delta_prefill > delta_decode")
        self._base = {TaskKind.DECODE: (p["pi_decode"], p["delta_decode"]),
                      TaskKind.PREFILL: (p["pi_prefill"], p["delta_prefill"]),
                      TaskKind.FINETUNE: (p["pi_ft"], p["delta_ft"])}

    def priority(self, task: Task, now: float) -> float:
        pi, delta = self._base[task.kind]
        p = pi + delta * (now - task.enqueued)
        if task.job is not None:
            p += self.params["gamma"] * task.job.loss_for_priority()
        return p

    @staticmethod
    def _chunking_misses_ttft(task: Task, bin: Bin, now: float) -> bool:
        """Whether a prompt prefilled in chunks of what this bin leaves (the same again in each
        later iteration of this bin's length; with nothing left, whole after this iteration)
        gets its first token after its TTFT SLO (`slo_ttft_factor` x its unloaded prefill,
        from its arrival)."""
        seq = task.seq
        if seq is None or seq.num_generated > 0 or not math.isfinite(bin.latency_budget_s):
            return False
        deadline = task.arrival + bin.slo_ttft_factor * bin.costs.unloaded_prefill_s(seq.num_prompt)
        whole, _ = bin.cost(task)
        free = bin.free_latency_s
        if free >= whole:
            return False
        length = max(bin.latency_budget_s, bin.latency_s)  # this iteration's, about
        # Nothing left in this bin: the prompt waits this iteration and then gets the budget.
        first_token = now + (math.ceil(whole / free) * length if free > 0 else length + whole)
        return first_token > deadline

    def pack(self, tasks: list[Task], bin: Bin, now: float) -> None:
        p = self.params
        l1, l2 = p["lambda_mem"], p["lambda_lat"]
        mem_scale = max(1, bin.memory_bytes)
        lat_scale = bin.latency_budget_s if math.isfinite(bin.latency_budget_s) else 1.0
        bins = [bin]
        dequeued = 0
        for task in self.order(tasks, now):
            if not bin.empty and (bin.used_bytes >= p["tau_mem"] * bin.memory_bytes or dequeued >= p["tau_task"]):
                break
            dequeued += 1
            best: Bin | None = None
            best_score = math.inf
            for b in bins:
                workload = b.whole_fit(task)  # GETWORKLOAD, where it fits at all
                if workload is None:
                    continue
                lat, m = workload
                score = l1 * abs(b.free_memory - m) / mem_scale + l2 * abs(b.free_latency_s - lat) / lat_scale
                if score < best_score:
                    best, best_score = b, score
            if best is not None:
                # A fine-tune job takes one stage in priority order; its following stages only
                # fill what the inference placed after it leaves (below).
                best.add(task, 1 if task.kind is TaskKind.FINETUNE else task.remaining)
                continue
            if task.kind is TaskKind.DECODE and bin.finetune:
                # A fine-tune stage that had aged past this stream took bin 1's budget first. The
                # stream waits that stage either way; a decode step adds one row to the forward,
                # whereas leaving it out makes the stream wait a whole next iteration as well.
                if bin.largest_fit(task, ignore_latency=True):
                    bin.add(task, 1)
                    continue
            if task.kind is TaskKind.PREFILL and self._chunking_misses_ttft(task, bin, now):
                # Chunks of what the budget leaves would bring its first token past its TTFT
                # SLO: the prompt takes the rest of its prefill now, as a decode rides along.
                piece = bin.largest_fit(task, ignore_latency=True)
                if piece:
                    bin.add(task, piece)
                    continue
            piece = bin.largest_fit(task)
            if piece:
                bin.add(task, piece)  # a chunk now beats the whole of it next iteration
            elif len(bins) < p["max_bins"]:
                later = bin.empty_like()
                piece = later.largest_fit(task)
                if piece:
                    later.add(task, piece)
                    bins.append(later)
            # else: it waits; bins beyond max_bins would be re-planned before they run anyway
        for placement in list(bin.finetune):  # in priority order
            if bin.free_latency_s <= 0 or bin.free_memory <= 0:
                break
            bin.extend_stages(placement)
