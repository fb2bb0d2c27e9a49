"""Decode KV cache pruning (edge_runtime.kv.pruning): off changes nothing, a budget that holds the
whole context changes nothing, a pruned head attends exactly its retained positions (against a
dense reference written here), and the rules (capacities, W, tau, sinks, baselines) as stated."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from edge_runtime.kv import paged_attention
from edge_runtime.kv.cache import KVCache
from edge_runtime.kv.paged_attention import PagedContext, SeqAttention, attend
from edge_runtime.kv.pruning import (
    HeadPruning,
    PruningSettings,
    attend_observed,
    evict_over_capacity,
    head_capacities,
)
from edge_runtime.model.testing import make_tiny_model_dir

from .helpers import engine_logits_for, make_engine

PROMPT = list(range(40, 40 + 37))
STEPS = 30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Random norm weights make attention far from uniform, so pruned positions change logits.
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-prune"), random_norms=True, seed=3,
                               num_heads=4, num_kv_heads=2, num_layers=2)


@pytest.fixture(scope="module")
def unpruned(model_dir: Path) -> tuple[torch.Tensor, list[int]]:
    return engine_logits_for(make_engine(model_dir), PROMPT, STEPS)


def test_kv_pruning_off_by_default_and_decode_path_untouched(model_dir: Path, unpruned) -> None:
    engine = make_engine(model_dir)
    assert engine.config.kv_prune_policy == "off" and engine.kv_pruning is None
    contexts = []
    real = paged_attention.PagedContext.attention

    def spy(self, layer, q, k, v):
        contexts.append(self)
        return real(self, layer, q, k, v)

    paged_attention.PagedContext.attention = spy
    try:
        logits, ids = engine_logits_for(engine, PROMPT, STEPS)
    finally:
        paged_attention.PagedContext.attention = real
    assert all(getattr(c, "decode_pruning", None) is None for c in contexts)
    assert torch.equal(logits, unpruned[0]) and ids == unpruned[1]


@pytest.mark.parametrize("policy", ["mace", "window", "h2o"])
def test_kv_pruning_with_budget_holding_the_context_is_bit_identical(model_dir: Path, unpruned, policy) -> None:
    engine = make_engine(model_dir, kv_prune_policy=policy, kv_prune_capacity=len(PROMPT) + STEPS)
    logits, ids = engine_logits_for(engine, PROMPT, STEPS)
    assert torch.equal(logits, unpruned[0])
    assert ids == unpruned[1]


def test_attend_observed_has_the_bits_of_attend() -> None:
    g = torch.Generator().manual_seed(0)
    for rows in (1, 3):
        q = torch.randn(2, 2, rows, 8, generator=g)
        k, v = torch.randn(2, 2, 11, 8, generator=g), torch.randn(2, 2, 11, 8, generator=g)
        mask = torch.rand(2, 2, 1, 11, generator=g) > 0.3
        mask[..., 0] = True
        out, weights = attend_observed(q, k, v, mask)
        assert torch.equal(out, attend(q, k, v, mask))
        assert weights.shape == (2, 2, rows, 11)
        assert torch.allclose(weights.sum(-1), torch.ones(2, 2, rows))
        assert bool((weights[mask.expand_as(weights) == 0] == 0).all())


def _dense_masked_attention(q, k, v, allowed):
    """Reference in float64: q [heads, d], k/v [ctx, kv_heads, d], allowed [kv_heads, ctx]."""
    heads, d = q.shape
    group = heads // k.shape[1]
    out = torch.empty(heads, d, dtype=torch.float64)
    for h in range(heads):
        kv = h // group
        keys = k[allowed[kv], kv].double()
        vals = v[allowed[kv], kv].double()
        w = torch.softmax(keys @ q[h].double() / d**0.5, dim=0)
        out[h] = w @ vals
    return out


def test_pruned_head_attends_exactly_its_retained_positions() -> None:
    torch.manual_seed(1)
    layers, kv_heads, heads, d, block = 2, 2, 4, 8, 4
    cfg = SimpleNamespace(num_layers=layers, num_kv_heads=kv_heads, head_dim=d)
    cache = KVCache(cfg, 16, block, torch.float32, "cpu")
    settings = PruningSettings("mace", capacity=100)
    lengths = [13, 7]  # two decoding sequences of different lengths in one batch, plus one unpruned
    tables = [[3, 0, 9, 5], [7, 2], [11, 12, 13]]
    states = [HeadPruning(settings, layers, kv_heads) for _ in lengths]
    for state, n in zip(states, lengths, strict=True):
        state.mask(n)
        state.retained[:, :, :n] = torch.rand(layers, kv_heads, n) > 0.5
        state.retained[:, :, 0] = True
        state.retained[:, :, n - 1] = True
    ctx_lens = lengths + [10]
    # Earlier positions' keys/values, written straight into their slots.
    for table, n in zip(tables, ctx_lens, strict=True):
        slots = (torch.tensor(table)[:, None] * block + torch.arange(block)).view(-1)[: n - 1]
        cache.data[:, :, slots] = torch.randn(layers, 2, n - 1, kv_heads, d)
    seqs = [SeqAttention(i, 1, n, table, states[i] if i < 2 else None)
            for i, (table, n) in enumerate(zip(tables, ctx_lens, strict=True))]
    ctx = PagedContext(cache, seqs, torch.device("cpu"))
    for layer in range(layers):
        q, k, v = torch.randn(3, heads, d), torch.randn(3, kv_heads, d), torch.randn(3, kv_heads, d)
        out = ctx.attention(layer, q, k, v).view(3, heads, d)
        k_cache, v_cache = cache.layer(layer)
        for i, (table, n) in enumerate(zip(tables, ctx_lens, strict=True)):
            slots = (torch.tensor(table)[:, None] * block + torch.arange(block)).view(-1)[:n]
            allowed = (states[i].retained[layer, :, :n] if i < 2
                       else torch.ones(kv_heads, n, dtype=torch.bool))
            ref = _dense_masked_attention(q[i], k_cache[slots], v_cache[slots], allowed)
            assert torch.allclose(out[i].double(), ref, atol=1e-5), (layer, i)
    # After the last layer each state took one step.
    assert [s.steps for s in states] == [1, 1]


def test_pruned_decoding_equals_a_dense_forward_masking_the_same_positions(model_dir: Path, unpruned,
                                                                            monkeypatch) -> None:
    """The whole model: each decode step's logits equal a full-sequence forward whose attention
    (written here, float64) lets every decode query see exactly the positions its head kept."""
    recorded: list[torch.Tensor] = []
    real_init = paged_attention.DecodePruning.__init__

    def recording_init(self, rows, decode_mask, num_layers, num_kv_heads):
        real_init(self, rows, decode_mask, num_layers, num_kv_heads)
        (row, n, _), = rows
        recorded.append(self.masks[:, row, :, 0, :n].clone())

    monkeypatch.setattr(paged_attention.DecodePruning, "__init__", recording_init)
    engine = make_engine(model_dir, kv_prune_policy="mace", kv_prune_capacity=12, kv_prune_sinks=2)
    logits, ids = engine_logits_for(engine, PROMPT, STEPS)
    assert len(recorded) == STEPS - 1
    assert any(bool((~m).any()) for m in recorded)  # it did prune
    assert not torch.allclose(logits, unpruned[0], atol=1e-3)  # and pruning mattered

    tokens = PROMPT + ids[:-1]
    total, prompt = len(tokens), len(PROMPT)

    class DenseMasked:
        lora = None

        def attention(self, layer, q, k, v):
            t, heads, d = q.shape
            out = torch.empty(t, heads, d, dtype=torch.float64)
            for p in range(total):
                if p < prompt:
                    allowed = torch.zeros(k.shape[1], p + 1, dtype=torch.bool) | True
                else:
                    allowed = recorded[p - prompt][layer]
                out[p] = _dense_masked_attention(q[p], k[: p + 1], v[: p + 1], allowed)
            return out.to(q.dtype).reshape(t, heads * d)

    with torch.no_grad():
        dense = engine.model(torch.tensor(tokens), torch.arange(total), DenseMasked()).float()
    assert torch.allclose(logits, dense[prompt - 1 :], atol=1e-4)


def test_head_capacities_floor_and_remainder_to_largest_weights() -> None:
    norms = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    caps = head_capacities(norms, 11)  # w = .1 .2 .3 .4 -> 1.1 2.2 3.3 4.4 -> 1 2 3 4, +1 to the largest
    assert caps.tolist() == [[1, 2], [3, 5]]
    assert int(head_capacities(torch.rand(3, 5), 1000).sum()) == 1000
    assert head_capacities(torch.zeros(2, 2), 8).tolist() == [[2, 2], [2, 2]]  # nothing seen: equal
    assert head_capacities(torch.tensor([1.0, 1.0, 5.0]), 2).tolist() == [0, 0, 2]
    assert head_capacities(torch.tensor([1.0, 1.0]), 0).tolist() == [0, 0]
    # Capacity a head cannot use (more than the context) goes to the others by weight.
    assert head_capacities(torch.tensor([8.0, 1.0, 1.0]), 30, limit=12).tolist() == [12, 9, 9]
    assert head_capacities(torch.tensor([8.0, 1.0, 1.0]), 36, limit=12).tolist() == [12, 12, 12]
    assert head_capacities(torch.tensor([0.0, 0.0, 5.0]), 10, limit=4).tolist() == [3, 3, 4]


def test_evict_over_capacity_keeps_protected_and_drops_smallest_keys() -> None:
    retained = torch.ones(1, 6, dtype=torch.bool)
    protected = torch.tensor([[True, False, False, False, False, True]])
    key = torch.tensor([[0.0, 5.0, 1.0, 3.0, 2.0, 0.0]])
    evict_over_capacity(retained, key, torch.tensor([4]), protected)
    assert retained.tolist() == [[True, True, False, True, False, True]]
    evict_over_capacity(retained, key, torch.tensor([0]), protected)  # never below the protected
    assert retained.tolist() == [[True, False, False, False, False, True]]


def _step(state: HeadPruning, n: int, used: list[int], norms: float | torch.Tensor = 1.0) -> None:
    """One decode step in which every head gives its attention to positions `used`."""
    weights = torch.zeros(1, 1, n)
    weights[..., used] = 1.0 / len(used)
    norm = torch.full((1, 1), norms) if isinstance(norms, float) else norms
    state.observe(n, weights, weights, norm)


def test_mace_idle_rule_prunes_positions_unused_longer_than_w_but_never_sinks() -> None:
    state = HeadPruning(PruningSettings("mace", capacity=1000, window=3, sinks=2), 1, 1)
    n = 10
    for _ in range(5):  # positions 4 and the newest get used; the others idle
        n += 1
        _step(state, n, [4, n - 1])
    kept = state.retained[0, 0, : state.length].nonzero().view(-1).tolist()
    # 0-1 are sinks; 4 is used at every step; 11..14 were last used (as the newest) within W steps.
    assert kept == [0, 1, 4, 11, 12, 13, 14]
    assert state.steps == 5


def test_mace_norm_rule_makes_a_low_norm_head_keep_only_what_it_used() -> None:
    state = HeadPruning(PruningSettings("mace", capacity=1000, norm_threshold=0.5, sinks=1), 1, 2)
    weights = torch.zeros(1, 2, 8)
    weights[:, :, [3, 7]] = 0.5
    state.observe(8, weights, weights, torch.tensor([[0.1, 0.9]]))
    assert state.retained[0, 0, :8].nonzero().view(-1).tolist() == [0, 3, 7]  # below tau
    assert bool(state.retained[0, 1, :8].all())  # above tau: untouched


def test_mace_capacity_follows_output_norms_and_evicts_least_recently_used() -> None:
    state = HeadPruning(PruningSettings("mace", capacity=6, sinks=1), 1, 2)
    # Head 0's output norm is 3x head 1's: C_total = 12 -> C = (9, 3).
    for n in range(12, 20):
        weights = torch.zeros(1, 2, n)
        weights[:, :, 5] = 1.0  # position 5 is used at every step
        state.observe(n, weights, weights, torch.tensor([[3.0, 1.0]]))
    counts = state.retained[0, :, : state.length].sum(-1).tolist()
    assert counts == [9, 3]
    assert state.retained[0, 1, : state.length].nonzero().view(-1).tolist() == [0, 5, 18]
    assert state.kv_bytes(head_dim=8, element_size=4) == 2 * 12 * 8 * 4


def test_window_baseline_keeps_sinks_and_the_most_recent_positions() -> None:
    state = HeadPruning(PruningSettings("window", capacity=5, sinks=2), 1, 1)
    _step(state, 20, [7])
    assert state.retained[0, 0, :20].nonzero().view(-1).tolist() == [0, 1, 17, 18, 19]


def test_pruned_blocks_are_full_blocks_no_head_of_any_layer_keeps() -> None:
    state = HeadPruning(PruningSettings("window", capacity=5, sinks=2), 2, 2)
    weights = torch.zeros(2, 2, 20)
    weights[..., 7] = 1.0
    state.observe(20, weights, weights, torch.ones(2, 2))
    assert state.pruned_blocks(4) == [1, 2, 3]  # 4..15; block 0 holds the sinks, block 4 17..19
    state.retained[1, 0, 9] = True  # one head of one layer still keeps a position of block 2
    assert state.pruned_blocks(4) == [1, 3]
    assert state.pruned_blocks(32) == []  # no full block


def test_h2o_baseline_keeps_the_recent_half_and_the_heaviest_hitters() -> None:
    state = HeadPruning(PruningSettings("h2o", capacity=6, sinks=0), 1, 1)
    weights = torch.zeros(1, 1, 20)
    weights[..., 3], weights[..., 9], weights[..., 12] = 0.5, 0.3, 0.2
    state.observe(20, weights, weights, torch.ones(1, 1))
    assert state.retained[0, 0, :20].nonzero().view(-1).tolist() == [3, 9, 12, 17, 18, 19]


def test_a_step_observed_again_changes_nothing() -> None:
    state = HeadPruning(PruningSettings("window", capacity=4, sinks=1), 1, 1)
    _step(state, 10, [2])
    before = state.retained.clone()
    _step(state, 10, [2])
    assert state.steps == 1 and torch.equal(state.retained, before)


@pytest.mark.parametrize("bad, message", [
    ({"kv_prune_policy": "lru"}, "unknown KV pruning policy"),
    ({"kv_prune_policy": "mace"}, "kv_prune_capacity"),
    ({"kv_prune_policy": "mace", "kv_prune_capacity": 8, "kv_prune_window": -1}, "cannot be negative"),
    ({"kv_prune_policy": "mace", "kv_prune_capacity": 8, "kv_prune_norm_threshold": float("nan")}, "kv_prune_norm_threshold"),
    ({"kv_prune_policy": "mace", "kv_prune_capacity": 8, "kv_prune_use_ratio": 0.0}, "use_ratio"),
    ({"kv_prune_policy": "mace", "kv_prune_capacity": 8, "kv_prune_when": "sometimes"}, "kv_prune_when"),
    ({"kv_prune_when": "sometimes"}, "kv_prune_when"),
])
def test_bad_pruning_settings_are_refused_at_load(model_dir: Path, bad, message) -> None:
    with pytest.raises(ValueError, match=message):
        make_engine(model_dir, **bad)


def test_pruning_is_refused_for_sliding_window_models(tmp_path: Path) -> None:
    swa = make_tiny_model_dir(tmp_path / "swa", model_type="mistral", config={"sliding_window": 8})
    with pytest.raises(ValueError, match="sliding window"):
        make_engine(swa, kv_prune_policy="window", kv_prune_capacity=8)


def test_pruned_engine_keeps_each_head_within_its_capacity(model_dir: Path) -> None:
    engine = make_engine(model_dir, kv_prune_policy="mace", kv_prune_capacity=10, kv_prune_sinks=2)
    from edge_runtime import SamplingParams

    rid = engine.add_request("Tell me about the sea " * 5, SamplingParams(max_tokens=20, ignore_eos=True))
    state = engine.requests[rid].seqs[0].kv_pruning
    while engine.has_unfinished():
        engine.step()
    caps = head_capacities(state.mean_norms(), 10 * state.num_heads)
    counts = state.retained[:, :, : state.length].sum(-1)
    assert bool((counts <= caps.clamp(min=3)).all())
    assert state.retained_entries <= 10 * state.num_heads + state.num_heads
    assert bool(state.retained[:, :, :2].all())  # sinks


@pytest.mark.parametrize("when", ["always", "pressure"])
def test_a_pruning_engine_does_not_claim_deterministic_answers(model_dir: Path, when: str) -> None:
    """torch with engine.deterministic says its rows are invariant; with pruning on, a stream's
    kept keys follow its own attention (and memory pressure), so the engine's stats say false."""
    assert make_engine(model_dir, deterministic=True).stats()["deterministic"] is True
    stats = make_engine(model_dir, deterministic=True, kv_prune_policy="mace", kv_prune_capacity=10,
                        kv_prune_when=when).stats()
    assert stats["deterministic"] is False and "KV pruning is on" in stats["deterministic_reason"]


# -- kv_prune_when = "pressure": pruning turned on per sequence when KV blocks run short ----------

TIGHT_BLOCKS = 16  # blocks of 8 positions: 128, for three streams of 37 + 40 tokens (10 blocks each)


def _tight_engine(model_dir: Path, policy: str):
    probe = make_engine(model_dir)
    per_block = probe.cache.nbytes // probe.pool.num_blocks
    return make_engine(model_dir, kv_prune_policy=policy, kv_prune_capacity=8, kv_prune_sinks=2,
                       kv_prune_when="pressure", kv_cache_bytes=TIGHT_BLOCKS * per_block, policy="mace")


def _three_streams(engine, steps: int = 40) -> list:
    """Three greedy streams of different prompts admitted at once; their sequences, stepped to the end."""
    from edge_runtime import SamplingParams

    seqs = []
    for first in (40, 90, 140):
        rid = engine.add_request("x", SamplingParams(max_tokens=steps, ignore_eos=True))
        seq = engine.requests[rid].seqs[0]
        seq.token_ids = list(range(first, first + len(PROMPT)))
        engine.requests[rid].prompt_ids = list(seq.token_ids)
        seqs.append(seq)
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    return seqs


def test_pressure_pruning_with_room_to_spare_never_starts_and_changes_nothing(model_dir: Path, unpruned) -> None:
    engine = make_engine(model_dir, kv_prune_policy="mace", kv_prune_capacity=4, kv_prune_when="pressure")
    logits, ids = engine_logits_for(engine, PROMPT, STEPS)
    assert torch.equal(logits, unpruned[0]) and ids == unpruned[1]
    assert engine.stats()["kv_prune_turned_on"] == 0


def test_pressure_turns_pruning_on_mid_generation_before_any_preemption(model_dir: Path) -> None:
    engine = _tight_engine(model_dir, "mace")
    sched = engine.scheduler
    turned_on_at_preemption = []
    preempt = sched._preempt

    def spy(seq) -> None:
        turned_on_at_preemption.append(sched.kv_relief.turned_on)
        preempt(seq)

    sched._preempt = spy
    seqs = _three_streams(engine)
    assert all(len(s.token_ids) == len(PROMPT) + 40 and s.finish_reason == "length" for s in seqs)
    pruned = [s for s in seqs if s.kv_pruning is not None]
    assert pruned and engine.stats()["kv_prune_turned_on"] == len(pruned)
    for seq in pruned:
        state = seq.kv_pruning
        # Turned on mid-generation: its statistics cover only the steps since, over a context
        # that already held the prompt and earlier tokens (mask(n) grew to them at once).
        assert 0 < state.steps < 40 and state.length > len(PROMPT)
        assert state.retained_entries < state.num_heads * state.length
    assert all(n >= 1 for n in turned_on_at_preemption)  # pruning came before any preemption (none, compacted)


def test_pressure_pruning_gives_blocks_back_so_no_stream_is_preempted(model_dir: Path) -> None:
    engine = _tight_engine(model_dir, "window")
    held_fewer = []
    step = engine.step

    def observed_step():
        out = step()
        held_fewer.extend(s.seq_id for s in engine.scheduler.running if s.kv_pruning is not None
                          and len(s.block_table) < -(-s.num_computed // engine.pool.block_size))
        return out

    engine.step = observed_step
    _three_streams(engine)
    assert held_fewer  # a pruned sequence held fewer blocks than its context's positions
    assert engine.stats()["preemptions"] == 0
