"""The decode stack (`gguf_stack`, `gg_decode_stack`): a decode-only step over a GGUF read in place runs
every layer in one call and gives the per-layer path's logits and KV cache bit for bit, rows of
different contexts batched together, adapter rows among them (their LoRA terms in C on both paths); it
stays off wherever the per-layer path would differ (prefill rows, engine.deterministic where the fast
path is not row-invariant, the attention kernel or the stack turned off)."""

from __future__ import annotations

import pytest
import torch

from edge_runtime import Engine
from edge_runtime.lora import LoraSettings
from edge_runtime.model import gguf_kernel, gguf_stack
from tests.engine.helpers import engine_greedy_batch
from tests.lora.helpers import ALL_LINEAR, random_adapter
from tests.model.quant_helpers import Q4_K_M_LIKE, tiny_quant_gguf
from tests.model.test_gguf_kernel import _VARIANTS, use_variant

# Q4_K_M_LIKE but for layer 0's Q8_0 ffn_up (a part the fused layer does not take): every layer fused.
K_QUANTS = {**{k: v for k, v in Q4_K_M_LIKE.items() if v != "Q8_0"}, "blk.0.ffn_up.weight": "Q5_K"}
PROMPTS = [[5, 9, 13, 17, 21, 25, 29], list(range(40, 63)), [7, 300, 12]]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    if not gguf_kernel.available():
        pytest.skip("gguf_kernel's compiled library is not built here")
    _, path = tiny_quant_gguf(tmp_path_factory.mktemp("q4km"), K_QUANTS, num_layers=3)
    return path


@pytest.fixture
def stack_calls(monkeypatch) -> list[int]:
    """How many steps the stack ran (one entry per step it was asked, 1 where it ran)."""
    for name in (gguf_stack.ENV, *gguf_stack._ENVS):
        monkeypatch.delenv(name, raising=False)
    calls: list[int] = []
    run = gguf_stack.run

    def spy(*args):
        out = run(*args)
        calls.append(int(out is not None))
        return out

    monkeypatch.setattr(gguf_stack, "run", spy)
    return calls


def _engine(path, **settings) -> Engine:
    """The torch backend on the file's own blocks; a policy without a latency budget, so both engines
    of a comparison chunk the prompts alike (the per-layer path's prefill rows follow the chunks)."""
    return Engine.load(str(path), backend="torch", torch_weights="gguf", dtype="float32", kv_cache_bytes=8 << 20,
                       block_size=4, max_batched_tokens=16, policy="continuous", **settings)


def _serve(engine: Engine, steps: int = 6, adapters: list[str | None] | None = None
           ) -> tuple[list[tuple[list[int], torch.Tensor, torch.Tensor]], list[list[int]]]:
    """Every step's rows per sequence, logits and the keys/values it wrote (every layer, in row
    order: where they lie in the cache follows the pool's history, e.g. a cost calibration's
    probes), and each prompt's greedy ids, the prompts admitted together."""
    steps_seen: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
    execute = engine.backend.execute
    cache, size = engine.backend.cache.data, engine.pool.block_size

    def spy(batch, lora=None):
        out = execute(batch) if lora is None else execute(batch, lora)
        slots = [item.seq.block_table[p // size] * size + p % size for item in batch.items
                 for p in range(item.seq.num_computed, item.seq.num_computed + item.num_tokens)]
        written = cache[:, :, torch.tensor(slots)].clone()  # [layers, 2, rows, kv_heads, d]
        steps_seen.append(([item.num_tokens for item in batch.items], out.clone(), written))
        return out

    engine.backend.execute = spy
    try:
        return steps_seen, engine_greedy_batch(engine, PROMPTS, steps, adapters)
    finally:
        engine.backend.execute = execute


def _with_adapters(engine: Engine) -> Engine:
    """alice: every projection at rank 4; bob: q and v at rank 2."""
    cfg = engine.model.cfg
    engine.publish_adapter("alice", random_adapter(cfg, LoraSettings(rank=4, alpha=8, target_modules=ALL_LINEAR), 1))
    engine.publish_adapter("bob", random_adapter(cfg, LoraSettings(rank=2, alpha=4, target_modules=("q_proj", "v_proj")), 2))
    return engine


@pytest.mark.parametrize("build, users", [("compiled", None), ("portable", None), ("compiled", ["alice", None, "bob"])])
def test_the_stack_gives_the_per_layer_paths_logits_and_cache_bit_for_bit(gguf, stack_calls, monkeypatch, build, users):
    """Also with two users' adapters beside a base row (`users`): the adapter rows' LoRA terms
    (gguf_native_lora.c) run inside the stack as the per-layer path runs them."""
    if build in _VARIANTS:
        use_variant(build, monkeypatch)  # the portable loops (-DGG_GENERIC): what other machines run
    engine = _engine(gguf)  # dtype float32: a float32 KV cache, which the stack serves
    logits, ids = _serve(_with_adapters(engine) if users else engine, adapters=users)
    assert sum(stack_calls) >= 4  # the decode-only steps, three rows of different contexts each
    assert 0 in stack_calls  # the prefill steps took the per-layer path
    monkeypatch.setenv(gguf_stack.ENV, "off")
    stack_calls.clear()
    reference = _engine(gguf)
    want_logits, want_ids = _serve(_with_adapters(reference) if users else reference, adapters=users)
    assert sum(stack_calls) == 0
    assert ids == want_ids
    assert len(logits) == len(want_logits)
    assert [rows for rows, _, _ in logits] == [rows for rows, _, _ in want_logits]  # the same steps
    for (_, got, got_kv), (_, want, want_kv) in zip(logits, want_logits, strict=True):
        assert torch.equal(got, want)
        assert torch.equal(got_kv, want_kv)


@pytest.mark.parametrize("switch", [("MACE_ATTN_KERNEL", "off"), ("MACE_GGUF_FUSED_LAYER", "off"),
                                    ("MACE_GGUF_ACTIVATIONS", "f32")])
def test_the_stack_stays_off_where_the_layers_would_not_take_its_calls(gguf, stack_calls, monkeypatch, switch):
    monkeypatch.setenv(*switch)
    _serve(_engine(gguf), steps=3)
    assert stack_calls and sum(stack_calls) == 0


def test_under_engine_deterministic_the_stack_runs_only_where_the_fast_path_is_row_invariant(gguf, stack_calls,
                                                                                             tmp_path):
    """engine.deterministic takes the fast path as it is where that path is row-invariant
    (TorchBackend.fast_path_gap; docs/scheduler.md), and torch's tiles, without the stack, elsewhere."""
    engine = _engine(gguf, deterministic=True)
    assert engine.backend.fast_path_gap() is None
    _serve(engine, steps=3)
    assert sum(stack_calls) > 0
    stack_calls.clear()
    _, path = tiny_quant_gguf(tmp_path, {**K_QUANTS, "output.weight": "Q8_0"}, num_layers=2)  # every layer fused
    engine = _engine(path, deterministic=True)
    assert "LM head" in engine.backend.fast_path_gap()
    _serve(engine, steps=3)
    assert stack_calls and sum(stack_calls) == 0


def test_the_stack_stays_off_where_a_layer_is_not_fused(tmp_path, stack_calls):
    _, path = tiny_quant_gguf(tmp_path, Q4_K_M_LIKE, num_layers=2)  # layer 0's Q8_0 ffn_up
    _serve(_engine(path), steps=3)
    assert stack_calls and sum(stack_calls) == 0
