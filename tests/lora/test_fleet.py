"""The fleet adapter beneath each user's: served per row as one LoRA of the two ranks
concatenated, on torch and on ONNX Runtime, equal to the base weights with both deltas added by
hand; rows without a user adapter get the fleet alone; requests keep the fleet version they were
admitted with; fleet versions are published, guarded and rolled back like a user's."""

from __future__ import annotations

import pytest
import torch

from edge_runtime.config import EngineConfig
from edge_runtime.engine import Engine
from edge_runtime.errors import BadRequest
from edge_runtime.lora import AdapterRef, AdapterRegistry, LoraSettings
from edge_runtime.lora.registry import FLEET, ServedAdapter
from edge_runtime.lora.weights import concat_ranks
from edge_runtime.model.tokenizer import Tokenizer
from edge_runtime.sampling import SamplingParams
from tests.backends.helpers import run_spying
from tests.lora.helpers import ALL_LINEAR, hf_model, random_adapter

PROMPTS = ["The quick brown fox", "Hello, how are you today?", "What is the capital", "Please write"]
# alice and bob have adapters, carol has none yet (fleet alone), the last row is anonymous.
USERS = ["alice", "bob", "carol", None]


def _adapters(cfg):
    # Unequal ranks and targets, so the concatenation has to pad and line up columns.
    fleet = random_adapter(cfg, LoraSettings(rank=4, alpha=8, target_modules=ALL_LINEAR), seed=11)
    alice = random_adapter(cfg, LoraSettings(rank=2, alpha=8, target_modules=("q_proj", "v_proj")), seed=12)
    bob = random_adapter(cfg, LoraSettings(rank=3, alpha=3, target_modules=("o_proj", "down_proj")), seed=13)
    return fleet, alice, bob


def _engine(model_dir, root=None) -> Engine:
    from edge_runtime.model.weights import load_llama

    model = load_llama(model_dir, dtype=torch.float32)
    registry = AdapterRegistry(root, model.cfg, torch.float32, "cpu") if root is not None else None
    config = EngineConfig(kv_cache_bytes=4 << 20, max_context=256, block_size=4)
    return Engine(model, Tokenizer(model_dir), config, name="tiny", adapters=registry)


def _merged_hf(model_dir, *adapters):
    """transformers' model with every adapter's scale * B @ A added into its weights: the
    reference W + dW_fleet + dW_user, computed without any of our LoRA code."""
    model = hf_model(model_dir)
    with torch.no_grad():
        for weights in adapters:
            for (layer, target), a in weights.a.items():
                block = model.model.layers[layer]
                module = getattr(block.self_attn if hasattr(block.self_attn, target) else block.mlp, target)
                module.weight += weights.settings.scale * weights.b[(layer, target)].float() @ a.float()
    return model


def _run_capturing(engine, prompts, users, params):
    """Run the requests in one continuous batch; returns each request's output and, per request,
    (position, logits) of every row that sampled."""
    rows: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def record(batch, out):
        sampled = [item for item in batch.items if item.samples]
        for item, logits in zip(sampled, out, strict=True):
            pos = item.seq.num_computed + item.num_tokens - 1
            rows.setdefault(item.seq.request.request_id, []).append((pos, logits.detach().float().clone()))

    outputs = run_spying(engine, prompts, users, params, record)
    return outputs, [rows[o.request_id] for o in outputs]


@pytest.mark.parametrize("backend", ["torch", "onnxruntime-dense"])
def test_fleet_and_user_rows_equal_base_weights_plus_both_deltas(tiny_model_dir, tmp_path, backend):
    engine = _engine(tiny_model_dir)
    if backend != "torch":
        pytest.importorskip("onnxruntime")
        from edge_runtime.backends.onnxruntime_backend import OnnxRuntimeBackend

        engine.backend = OnnxRuntimeBackend(engine.model, engine.cache, engine.adapters, cache_dir=tmp_path,
                                            kv_layout="dense")
    fleet, alice, bob = _adapters(engine.model.cfg)
    engine.publish_fleet(fleet)
    engine.publish_adapter("alice", alice)
    engine.publish_adapter("bob", bob)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outputs, rows = _run_capturing(engine, PROMPTS, USERS, params)

    references = {"alice": _merged_hf(tiny_model_dir, fleet, alice), "bob": _merged_hf(tiny_model_dir, fleet, bob)}
    fleet_only = _merged_hf(tiny_model_dir, fleet)
    base = hf_model(tiny_model_dir)
    for user, out, captured in zip(USERS, outputs, rows, strict=True):
        ids = torch.tensor([out.prompt_token_ids + out.candidates[0].token_ids])
        with torch.no_grad():
            want = references.get(user, fleet_only)(input_ids=ids).logits[0]
            bare = base(input_ids=ids).logits[0]
        assert len(captured) == params.max_tokens
        for pos, logits in captured:
            torch.testing.assert_close(logits, want[pos], rtol=1e-4, atol=1e-4)
        assert (want - bare).abs().max() > 1e-2  # the fleet changes every row, user or not
        # Greedy: each token is the argmax of the reference at the position before it.
        prompt_len = len(out.prompt_token_ids)
        assert out.candidates[0].token_ids == want[prompt_len - 1 : -1].argmax(-1).tolist()
    if backend != "torch":
        assert True in engine.backend._sessions  # the rows ran through the LoRA graph
    assert engine.adapters.versions(FLEET) == [1]
    assert engine.stats()["adapters_pinned"] == 0


def test_a_batch_of_several_users_shares_one_fleet_version(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    fleet, alice, bob = _adapters(engine.model.cfg)
    engine.publish_fleet(fleet)
    engine.publish_adapter("alice", alice)
    engine.publish_adapter("bob", bob)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params, adapter=u) for p, u in zip(PROMPTS, USERS, strict=True)]
    base_id = engine.add_request(PROMPTS[0], params, fleet=False)
    served = {rid: engine.requests[rid].served for rid in ids}
    fleet_ref = AdapterRef(FLEET, 1)
    assert served == {ids[0]: ServedAdapter(fleet_ref, AdapterRef("alice", 1)),
                      ids[1]: ServedAdapter(fleet_ref, AdapterRef("bob", 1)),
                      ids[2]: ServedAdapter(fleet_ref, None), ids[3]: ServedAdapter(fleet_ref, None)}
    assert engine.requests[base_id].served is None
    assert engine.adapters.pinned(fleet_ref) == 4
    engine.step()
    # The torch path groups rows by what they are served: alice's and bob's compositions are
    # built once each (rank 4 + 2, 4 + 3, scale 1); carol's and the anonymous row share the fleet's.
    composed = engine.adapters.served_weights(served[ids[0]])
    assert composed.settings.rank == 6 and composed.settings.scale == 1.0
    assert served[ids[0]] in engine.adapters.cache and served[ids[1]] in engine.adapters.cache
    while engine.has_unfinished():
        engine.step()
    assert engine.adapters.pinned(fleet_ref) == 0
    stats = engine.stats()  # the fleet is counted apart from the users' versions
    assert (stats["adapter_users"], stats["adapter_versions"], stats["fleet_versions"]) == (2, 2, 1)


def test_concatenated_ranks_give_the_sum_of_the_deltas(tiny_model):
    fleet, alice, _ = _adapters(tiny_model.cfg)
    both = concat_ranks([fleet, alice])
    both.check_shapes(tiny_model.cfg)
    x = torch.randn(5, tiny_model.cfg.hidden_size)
    for layer, target in [(0, "q_proj"), (1, "v_proj"), (0, "gate_proj")]:
        want = fleet.delta(layer, target, x)
        extra = alice.delta(layer, target, x)
        if extra is not None:
            want = want + extra
        torch.testing.assert_close(both.delta(layer, target, x), want, rtol=1e-5, atol=1e-6)


def test_requests_keep_their_fleet_version_while_a_new_one_is_published(tiny_model_dir, tmp_path):
    engine = _engine(tiny_model_dir, root=tmp_path / "adapters")
    v1, v2 = (random_adapter(engine.model.cfg, LoraSettings(rank=2), seed=s) for s in (21, 22))
    engine.publish_fleet(v1)
    engine.publish_adapter("alice", random_adapter(engine.model.cfg, LoraSettings(rank=2), seed=23))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = "Hello, how are you"
    first = engine.add_request(prompt, params, adapter="alice")
    for _ in range(3):
        engine.step()
    engine.publish_fleet(v2)
    assert engine.adapters.pinned(AdapterRef(FLEET, 1)) == 1
    second = engine.add_request(prompt, params, adapter="alice")
    assert engine.requests[second].fleet == AdapterRef(FLEET, 2)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out

    def alone() -> list[int]:
        rid = engine.add_request(prompt, params, adapter="alice")
        while engine.has_unfinished():
            for out in engine.step():
                done = out
        assert done.request_id == rid
        return done.candidates[0].token_ids

    # Each decoded under its own fleet version throughout: replay alone under v2, then roll the
    # fleet back to v1 (new requests get v1 again) and replay.
    assert outputs[second].candidates[0].token_ids == alone()
    assert engine.rollback_fleet(reason="test") == AdapterRef(FLEET, 1)
    assert outputs[first].candidates[0].token_ids == alone()
    assert outputs[first].candidates[0].token_ids != outputs[second].candidates[0].token_ids
    assert engine.adapters.pinned(AdapterRef(FLEET, 1)) == 0

    # Versions, retire markers and events are on disk: a restart serves v1 and still no user is "+fleet".
    registry = AdapterRegistry(tmp_path / "adapters", engine.model.cfg)
    assert registry.versions(FLEET) == [1] and registry.newest(FLEET) == AdapterRef(FLEET, 1)
    assert registry.users() == ["alice"]
    assert [e["kind"] for e in registry.events(FLEET)] == ["published", "published", "rolled_back"]
    assert engine.rollback_fleet(to_version=0) is None  # back to the base model beneath everyone
    with pytest.raises(BadRequest):
        engine.add_request("x", params, adapter=FLEET)  # no user can ask for the fleet as theirs
    with pytest.raises(BadRequest):
        engine.add_request("x", params, adapter=AdapterRef(FLEET, 1))


def test_prefix_cache_is_not_shared_across_fleet_versions(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    prompt = "The user asks and the assistant answers. " * 3
    params = SamplingParams(max_tokens=1, temperature=0.0)
    engine.publish_fleet(random_adapter(engine.model.cfg, LoraSettings(rank=2), seed=31))
    engine.generate([prompt], params)
    hits = engine.pool.stats.hit_blocks
    engine.publish_fleet(random_adapter(engine.model.cfg, LoraSettings(rank=2), seed=32))
    engine.generate([prompt], params)
    assert engine.pool.stats.hit_blocks == hits  # v1's blocks were not reused under v2
    engine.generate([prompt], params)
    assert engine.pool.stats.hit_blocks > hits
