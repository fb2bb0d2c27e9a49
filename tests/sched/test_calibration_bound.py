"""No calibration forward is longer than a served one (issue #28: the 8B first start's peak was
put at its quick calibration's largest prefill): the shapes are cut to `max_batched_tokens`, the
bound a served prefill chunk has beside the ledger's activation estimate, which bounds it too."""

from __future__ import annotations

import time

import torch

from edge_runtime.kv.block_pool import BlockPool
from edge_runtime.model.config import ModelConfig
from edge_runtime.sched import cost_model
from edge_runtime.sched.cost_model import (
    QUICK_SHAPES,
    BackgroundCalibration,
    load_cost_model,
    quick_calibration,
)
from edge_runtime.sched.mace import MacePolicy
from edge_runtime.sched.probe import SHAPES, bounded
from tests.sched.sim import KV_BLOCK_BYTES, WEIGHTS_BYTES, Sim


def _tokens(shape) -> int:
    return sum(n * new for n, _, new in shape)


def test_bounded_cuts_prefills_and_keeps_decodes() -> None:
    assert bounded(SHAPES, None) == SHAPES
    cut = bounded(SHAPES, 64)
    assert max(_tokens(s) for s in cut) <= 64
    assert all(s in cut for s in SHAPES if _tokens(s) <= 64)  # what fits is measured as it was
    assert ((1, 0, 64),) in cut and ((1, 0, 192),) not in cut
    assert ((1, 0, 56), (8, 128, 1)) in cut  # the mixed batch keeps its decode rows
    assert len(set(cut)) == len(cut)


def _recording(widest: list[int]):
    def execute(batch) -> None:
        widest.append(sum(item.num_tokens for item in batch.items))
        time.sleep(1e-4 * (1 + widest[-1]))  # a forward's time grows with its tokens
    execute.__name__ = "torch"
    return execute


def test_calibrations_never_run_a_forward_over_the_chunk_bound(tiny_model_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cost_model, "machine_busy", lambda: False)
    cfg = ModelConfig.from_dir(tiny_model_dir)
    for max_tokens in (32, 100):
        widest: list[int] = []
        execute = _recording(widest)
        pool = BlockPool(512, 16, False)
        quick_calibration(execute, pool, cfg, max_tokens=max_tokens)
        background = BackgroundCalibration(cfg, execute, pool, None, repeats=1, max_tokens=max_tokens)
        while not background.done:
            background.step()
        load_cost_model(cfg, torch.float32, torch.device("cpu"), "torch", execute, pool, KV_BLOCK_BYTES,
                        mode="auto", cache_dir=str(tmp_path / f"c{max_tokens}"), max_tokens=max_tokens)
        assert widest and max(widest) <= max_tokens, (max_tokens, max(widest))
    unbounded: list[int] = []
    quick_calibration(_recording(unbounded), BlockPool(512, 16, False), cfg)
    assert max(unbounded) == max(_tokens(s) for s in QUICK_SHAPES)


def test_a_prefill_chunk_follows_the_activation_estimate() -> None:
    # The sim's cost model: 512 B of activations per token and 1 KiB per logits row. With room for
    # ~40 tokens' activations and KV beside the weights, a long prompt is fed in chunks that fit
    # the ledger's free bytes, not max_batched_tokens (128) at once; with room to spare, 128.
    per_token = 512 + KV_BLOCK_BYTES // 16
    for room in (40 * per_token + 1024 + 2 * KV_BLOCK_BYTES, 1 << 22):
        sim = Sim(MacePolicy(), budget=WEIGHTS_BYTES + room, max_batched_tokens=128, latency_budget_s=10.0)
        sim.add_request(500, 1)
        chunks = []
        for _ in range(40):
            if sim.finished:
                break
            free = sim.ledger.free
            batch = sim.step()
            for item in batch.items:
                chunks.append(item.num_tokens)
                assert sim.costs.inference_bytes(item.num_tokens, True) <= free
        assert chunks
        if room < 1 << 20:
            assert max(chunks) <= 48, chunks
        else:
            assert max(chunks) == 128 and sum(chunks) >= 500, chunks
