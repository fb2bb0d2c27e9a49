"""Compaction of pruned KV (edge_runtime.kv.compaction): a pruned sequence's retained entries packed
into fewer blocks give the same tokens and logits, bit for bit, as masking alone, and the blocks
(and their pages) go back to the pool, which the scheduler and the ledger then count as free."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edge_runtime import SamplingParams
from edge_runtime.model.testing import make_tiny_model_dir

from .helpers import _set_prompt_ids, make_engine

PROMPTS = [list(range(40, 40 + 37)), list(range(100, 100 + 21)), list(range(7, 7 + 52))]
STEPS = 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-compact"), random_norms=True, seed=3,
                               num_heads=4, num_kv_heads=2, num_layers=2)


def _run(engine, prompts, steps, compacting=True, preempt=None, stagger=0):
    """Greedy-decode every prompt in shared iterations; returns each request's logits [steps,
    vocab], its tokens, and the most blocks the pool held at once. `preempt`: (iteration, prompt
    index) preempted to recompute. `stagger`: iterations between adding prompts (so a later one
    can hit an earlier one's cached prompt blocks)."""
    if not compacting:
        engine._compact_pruned_kv = lambda: None
    rows: dict[str, list[torch.Tensor]] = {}
    execute = engine.backend.execute

    def spy(batch, lora=None):
        out = execute(batch)
        sampled = [item.seq.request.request_id for item in batch.items if item.samples]
        for rid, row in zip(sampled, out, strict=True):
            rows.setdefault(rid, []).append(row.detach().cpu().clone())
        return out

    engine.backend.execute = spy
    ids, outputs, most, iteration = [], {}, 0, 0
    pending = list(prompts)
    while pending or engine.has_unfinished():
        if pending and iteration % (stagger + 1) == 0:
            prompt = pending.pop(0)
            rid = engine.add_request(engine.tokenizer.hf.decode(prompt), SamplingParams(max_tokens=steps, ignore_eos=True))
            _set_prompt_ids(engine, rid, prompt)
            ids.append(rid)
        if preempt is not None and iteration == preempt[0]:
            seq = engine.requests[ids[preempt[1]]].seqs[0]
            engine.scheduler._preempt(seq)
        for out in engine.step():
            outputs[out.request_id] = out
        most = max(most, engine.pool.num_used)
        iteration += 1
    return [torch.stack(rows[rid]) for rid in ids], [outputs[rid].token_ids for rid in ids], most


@pytest.mark.parametrize("policy", ["window", "h2o", "mace"])
def test_compacted_decoding_is_bit_identical_to_masking(model_dir: Path, policy: str) -> None:
    settings = dict(kv_prune_policy=policy, kv_prune_capacity=10, kv_prune_sinks=2)
    masked = _run(make_engine(model_dir, **settings), PROMPTS, STEPS, compacting=False)
    engine = make_engine(model_dir, **settings)
    compacted = _run(engine, PROMPTS, STEPS)
    assert engine.kv_compactions > 0
    for a, b in zip(masked[0], compacted[0], strict=True):
        assert torch.equal(a, b)
    assert masked[1] == compacted[1]
    assert compacted[2] < masked[2]
