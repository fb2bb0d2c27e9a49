"""Batched multi-LoRA: one batch mixing two users' adapters and base-model rows gives, row by
row, PEFT's own forward with that row's adapter; the engine serves each request its pinned
version and keeps it while decoding."""

from __future__ import annotations

import torch

from edge_runtime.config import EngineConfig
from edge_runtime.engine import Engine
from edge_runtime.lora import AdapterRef, AdapterRegistry, BatchedLoraApplier, LoraSettings
from edge_runtime.lora.adapter import save_snapshot
from edge_runtime.model.dense import dense_logits
from edge_runtime.model.tokenizer import Tokenizer
from edge_runtime.sampling import SamplingParams
from tests.lora.helpers import ALL_LINEAR, hf_model, peft_model, random_adapter

PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 70, 71, 72, 73, 74], [1, 90, 91, 92, 93, 94], [1, 40, 41, 42, 43, 44]]


def _adapters(cfg):
    alice = random_adapter(cfg, LoraSettings(rank=4, alpha=8, target_modules=ALL_LINEAR), seed=1)
    bob = random_adapter(cfg, LoraSettings(rank=2, alpha=4, target_modules=("q_proj", "v_proj")), seed=2)
    return alice, bob


def test_batched_rows_equal_peft_forward_row_by_row(tiny_model, tiny_model_dir, tmp_path):
    alice, bob = _adapters(tiny_model.cfg)
    row_adapters = [alice, None, bob, bob]  # the last row repeats row 0's prompt under another adapter
    length = len(PROMPTS[0])
    applier = BatchedLoraApplier.from_rows([(w, length) for w in row_adapters])
    with torch.no_grad():
        ours = dense_logits(tiny_model, torch.tensor(PROMPTS), lora=applier)

    references = {
        "alice": peft_model(tiny_model_dir, save_snapshot(tmp_path / "alice", alice)),
        "bob": peft_model(tiny_model_dir, save_snapshot(tmp_path / "bob", bob)),
        None: hf_model(tiny_model_dir),
    }
    names = ["alice", None, "bob", "bob"]
    with torch.no_grad():
        for row, name in enumerate(names):
            theirs = references[name](input_ids=torch.tensor([PROMPTS[row]])).logits[0]
            torch.testing.assert_close(ours[row], theirs, rtol=1e-4, atol=1e-4)
    assert (ours[0] - ours[3]).abs().max() > 1e-3  # same tokens, different adapters


def test_base_rows_are_untouched_by_adapters_beside_them(tiny_model):
    alice, bob = _adapters(tiny_model.cfg)
    ids = torch.tensor(PROMPTS[:3])
    n = ids.shape[1]
    with torch.no_grad():
        mixed = dense_logits(tiny_model, ids, lora=BatchedLoraApplier.from_rows([(alice, n), (None, n), (bob, n)]))
        base = dense_logits(tiny_model, ids)
    assert torch.equal(mixed[1], base[1])
    assert BatchedLoraApplier.from_rows([(None, 3), (None, 5)]) is None


def _engine(model_dir, registry=None) -> Engine:
    from edge_runtime.model.weights import load_llama

    model = load_llama(model_dir, dtype=torch.float32)
    config = EngineConfig(kv_cache_bytes=4 << 20, max_context=256, block_size=4)
    return Engine(model, Tokenizer(model_dir), config, name="tiny", adapters=registry)


def test_engine_mixed_batch_matches_peft_greedy_per_request(tiny_model_dir, tmp_path):
    engine = _engine(tiny_model_dir)
    alice, bob = _adapters(engine.model.cfg)
    engine.publish_adapter("alice", alice)
    engine.publish_adapter("bob", bob)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = "The quick brown fox"
    ids = {user: engine.add_request(prompt, params, adapter=user) for user in ("alice", "bob", "carol")}
    base_id = engine.add_request(prompt, params)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out

    prompt_ids = torch.tensor([engine.tokenizer.hf.encode(prompt)])
    references = {
        "alice": peft_model(tiny_model_dir, save_snapshot(tmp_path / "a", alice)),
        "bob": peft_model(tiny_model_dir, save_snapshot(tmp_path / "b", bob)),
    }
    base = hf_model(tiny_model_dir)
    for user, rid in [*ids.items(), (None, base_id)]:
        model = references.get(user, base)  # carol has no adapter yet: base model
        with torch.no_grad():
            want = model.generate(input_ids=prompt_ids, max_new_tokens=6, do_sample=False)[0, prompt_ids.shape[1]:]
        assert outputs[rid].candidates[0].token_ids == want.tolist(), user
    assert outputs[ids["alice"]].adapter == "alice@1"
    assert outputs[ids["carol"]].adapter is None
    assert engine.stats()["adapters_pinned"] == 0


def test_request_keeps_its_version_while_a_new_one_is_published(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    v1, v2 = (random_adapter(engine.model.cfg, LoraSettings(rank=2), seed=s) for s in (5, 6))
    engine.publish_adapter("alice", v1)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = engine.add_request("Hello, how are you", params, adapter="alice")
    for _ in range(3):
        engine.step()
    assert engine.adapters.pinned(AdapterRef("alice", 1)) == 1
    engine.publish_adapter("alice", v2)
    second = engine.add_request("Hello, how are you", params, adapter="alice")
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    assert outputs[first].adapter == "alice@1" and outputs[second].adapter == "alice@2"

    # Each finished request decoded entirely under its own version: replay them alone.
    solo = {}
    for version in (1, 2):
        rid = engine.add_request("Hello, how are you", params, adapter=AdapterRef("alice", version))
        while engine.has_unfinished():
            for out in engine.step():
                solo[version] = out.candidates[0].token_ids
    assert outputs[first].candidates[0].token_ids == solo[1]
    assert outputs[second].candidates[0].token_ids == solo[2]
    assert engine.adapters.pinned(AdapterRef("alice", 1)) == 0
    del rid


def test_prefix_cache_is_not_shared_across_adapter_versions(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    engine.publish_adapter("alice", random_adapter(engine.model.cfg, LoraSettings(rank=2), seed=9))
    prompt = "The user asks and the assistant answers. " * 3
    params = SamplingParams(max_tokens=1, temperature=0.0)
    engine.generate([prompt], params)
    hits_before = engine.pool.stats.hit_blocks
    rid = engine.add_request(prompt, params, adapter="alice")
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.stats.hit_blocks == hits_before  # base-model blocks were not reused
    engine.add_request(prompt, params, adapter="alice")
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.stats.hit_blocks > hits_before  # but the same version's blocks were
    del rid


def test_engine_loads_newest_good_versions_at_start(tiny_model_dir, tmp_path):
    from edge_runtime.model.config import ModelConfig

    cfg = ModelConfig.from_dir(tiny_model_dir)
    registry = AdapterRegistry(tmp_path, cfg)
    registry.publish("alice", random_adapter(cfg, LoraSettings(rank=2), seed=1))
    registry.publish("alice", random_adapter(cfg, LoraSettings(rank=2), seed=2))
    engine = _engine(tiny_model_dir, AdapterRegistry(tmp_path, cfg))
    assert AdapterRef("alice", 2) in engine.adapters.cache
    rid = engine.add_request("Hello", SamplingParams(max_tokens=1), adapter="alice")
    assert engine.requests[rid].adapter_key == "alice@2"
