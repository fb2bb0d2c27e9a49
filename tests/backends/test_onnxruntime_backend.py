"""The ONNX Runtime backend against the torch reference on the tiny model: logits within 1e-3
and identical greedy output for 20 prompts with two adapters (and base rows) in one continuous
batch, for both graph flavours; batch invariance; the export cache; weight-only quantisation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")

from edge_runtime import Engine, SamplingParams  # noqa: E402
from edge_runtime.backends import make_backend  # noqa: E402
from edge_runtime.backends.onnx_export import export_step, read_meta  # noqa: E402
from edge_runtime.backends.onnx_spec import GraphSpec  # noqa: E402
from edge_runtime.backends.onnxruntime_backend import OnnxRuntimeBackend  # noqa: E402
from edge_runtime.backends.step_inputs import (  # noqa: E402
    DecodeInputs,
    StepItem,
    plan_dense_step,
    plan_gqa_step,
    split_groups_gqa,
)
from edge_runtime.config import EngineConfig  # noqa: E402
from edge_runtime.model.config import ModelConfig  # noqa: E402
from tests.backends.helpers import PROMPTS, make_engine, ort_device, run_recording, two_adapters  # noqa: E402

USERS = [("alice", "bob", None)[i % 3] for i in range(len(PROMPTS))]
# Small prefill chunks, so batches mix decode rows with first and continuation chunks.
CONFIG = dict(dtype="float32", kv_cache_bytes=4 << 20, max_batched_tokens=48, device=ort_device())


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    adapters = two_adapters(ModelConfig.from_dir(tiny_model_dir))
    engine = make_engine(tiny_model_dir, "torch", adapters, **CONFIG)
    logits, tokens = run_recording(engine, PROMPTS, USERS, SamplingParams(max_tokens=10, ignore_eos=True))
    return adapters, logits, tokens


@pytest.mark.parametrize("flavour,kv_layout", [("ort", "dense"), ("ort", "paged"), ("standard", "paged")])
def test_logits_within_1e3_and_greedy_identical_with_two_adapters_in_one_batch(
    tiny_model_dir, tmp_path, reference, flavour, kv_layout
):
    adapters, ref_logits, ref_tokens = reference
    engine = make_engine(tiny_model_dir, "torch", adapters, onnx_cache_dir=str(tmp_path), **CONFIG)
    engine.backend = OnnxRuntimeBackend(engine.model, engine.cache, engine.adapters, flavour=flavour,
                                        cache_dir=tmp_path, kv_layout=kv_layout)
    logits, tokens = run_recording(engine, PROMPTS, USERS, SamplingParams(max_tokens=10, ignore_eos=True))
    assert len(logits) == len(ref_logits)
    worst = max((a - b).abs().max().item() for a, b in zip(logits, ref_logits, strict=True))
    assert worst < 1e-3
    assert tokens == ref_tokens
    assert True in engine.backend._sessions  # the adapters' rows ran through the LoRA graph
    assert engine.stats()["backend"] == "onnxruntime"


def test_engine_selects_the_backend_from_config(tiny_model_dir, tmp_path):
    engine = Engine.load(str(tiny_model_dir), backend="onnxruntime", onnx_cache_dir=str(tmp_path), **CONFIG)
    assert isinstance(engine.backend, OnnxRuntimeBackend)
    out = engine.generate("Hello, how are you", SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.candidates[0].token_ids) == 4
    with pytest.raises(ValueError, match="unknown backend"):
        make_backend(EngineConfig(backend="tvm"), engine.model, engine.cache, None)


def test_a_row_decodes_the_same_alone_and_in_a_batch(tiny_model_dir, tmp_path):
    engine = Engine.load(str(tiny_model_dir), **CONFIG)
    backend = OnnxRuntimeBackend(engine.model, engine.cache, None, cache_dir=tmp_path, kv_layout="paged")
    torch.manual_seed(0)
    engine.cache.data.normal_()  # any cached context: the point is that rows never mix
    session = backend._session(lora=False)
    alone = [StepItem([100], 20, [0, 1], True)]
    crowd = alone + [StepItem([50 + i], 10 + i, [2 + i], True) for i in range(5)]
    a = backend._run(session, backend.plan(alone))[0]
    b = backend._run(session, backend.plan(crowd))[0][:1]
    assert torch.equal(a, b)


def test_the_ledger_counts_the_graph_weights_and_dense_rows(tiny_model_dir, tmp_path, reference):
    """An ONNX Runtime graph holds its own weights and the dense layout its own KV rows, beside
    the model and the paged cache: the ledger holds them as weight-like entries (the LoRA
    graph's from its first adapter row on) and the derived budget makes room for both graphs.
    A graph's weights are what opening its session added to resident memory (pre-packed copies
    and the initializers left mapped), not its data file's size (#28)."""
    from edge_runtime.memory import MemoryKind

    adapters = reference[0]
    engine = make_engine(tiny_model_dir, "onnxruntime", adapters, onnx_cache_dir=str(tmp_path), **CONFIG)
    backend = engine.backend
    base = backend._sessions[False].weights_bytes
    limit = backend.dense.limit_bytes
    assert base > 0 and limit > 0
    assert engine.ledger.entries(MemoryKind.WEIGHTS)["backend"] == base + limit
    budget = engine.ledger.budget
    engine.add_request("Hello there", SamplingParams(max_tokens=3, ignore_eos=True), adapter="alice")
    while engine.has_unfinished():
        engine.step()
    lora = backend._sessions[True].weights_bytes
    assert lora > 0  # measured as the session's growth, like the base graph's
    engine.step()  # the next iteration notes what the run opened
    assert engine.ledger.entries(MemoryKind.WEIGHTS)["backend"] == base + lora + limit
    assert engine.ledger.peak_used <= budget == engine.ledger.budget
    assert backend.reserved_bytes == 2 * base + limit


def test_export_is_cached_per_model_and_spec(tiny_model_dir, tmp_path):
    engine = Engine.load(str(tiny_model_dir), **CONFIG)
    path = export_step(engine.model, GraphSpec(), tmp_path)
    stamp = path.stat().st_mtime_ns
    assert export_step(engine.model, GraphSpec(), tmp_path) == path
    assert path.stat().st_mtime_ns == stamp
    int4 = export_step(engine.model, GraphSpec(quantization="int4"), tmp_path)
    assert int4.parent != path.parent
    meta = read_meta(int4)
    assert meta["spec"]["quantization"] == "int4" and len(meta["model_hash"]) == 32


def test_exports_are_shared_across_state_dirs_and_older_ones_still_used(tiny_model_dir, tmp_path, monkeypatch):
    engine = Engine.load(str(tiny_model_dir), **CONFIG)
    monkeypatch.setenv("MACE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MACE_STATE_DIR", str(tmp_path / "state-a"))
    path = export_step(engine.model, GraphSpec())
    assert path.parent.parent == tmp_path / "cache" / "onnx"
    monkeypatch.setenv("MACE_STATE_DIR", str(tmp_path / "state-b"))
    assert export_step(engine.model, GraphSpec()) == path
    # An export an older release made under its state dir is used where the shared one lacks it.
    old = export_step(engine.model, GraphSpec(quantization="int8"), tmp_path / "state-b" / "onnx")
    assert export_step(engine.model, GraphSpec(quantization="int8")) == old
    assert not (tmp_path / "cache" / "onnx" / old.parent.name).exists()


@pytest.mark.parametrize("quantization,tolerance", [("int8", 0.05), ("q4_1", 0.5), ("int4", 0.5), ("int4-compact", 0.5)])
def test_weight_only_quantization_stays_close_to_float(tiny_model_dir, tmp_path, quantization, tolerance):
    engine = Engine.load(str(tiny_model_dir), **CONFIG)
    ids = engine.tokenizer.hf.encode("The quick brown fox jumps over the lazy dog.")
    full = OnnxRuntimeBackend(engine.model, engine.cache, None, cache_dir=tmp_path).score(ids)
    quant = OnnxRuntimeBackend(engine.model, engine.cache, None, quantization=quantization, cache_dir=tmp_path).score(ids)
    error = (full - quant).abs().max().item()
    assert 0 < error < tolerance


def test_weight_format_names_map_to_graph_specs(tiny_model_dir, tmp_path):
    engine = Engine.load(str(tiny_model_dir), **CONFIG)
    compact = OnnxRuntimeBackend(engine.model, engine.cache, None, quantization="int4-compact", cache_dir=tmp_path)
    assert (compact.spec.quantization, compact.spec.symmetric, compact.spec.head_bits) == ("int4", False, 4)
    assert "-int4-head4" in compact.spec.tag  # its own export, never the int4 one
    q4_1 = OnnxRuntimeBackend(engine.model, engine.cache, None, quantization="q4_1", cache_dir=tmp_path)
    assert (q4_1.spec.quantization, q4_1.spec.offsets, q4_1.spec.head_bits) == ("int4", True, 8)
    assert "-int4-off-kv" in q4_1.spec.tag
    with pytest.raises(ValueError, match="int4-compact"):
        OnnxRuntimeBackend(engine.model, engine.cache, None, quantization="int3", cache_dir=tmp_path)


def test_bfloat16_kv_cache_is_bound_as_is(tiny_model_dir, tmp_path):
    engine = Engine.load(str(tiny_model_dir), backend="onnxruntime", onnx_cache_dir=str(tmp_path),
                         **{**CONFIG, "dtype": "bfloat16"})
    assert engine.cache.data.dtype == torch.bfloat16
    out = engine.generate(["Hello", "What is the capital of France?"], SamplingParams(max_tokens=6, ignore_eos=True))
    assert all(len(o.candidates[0].token_ids) == 6 for o in out)
    assert torch.isfinite(engine.cache.data.float()).all()


def test_groups_keep_continuation_chunks_alone():
    # decode rows together; first chunks together; a chunk with a past runs by itself
    groups = split_groups_gqa([1, 1, 8, 6, 5, 1], [9, 4, 0, 0, 3, 7])
    assert groups == [[0, 1, 5], [2, 3], [4]]
    assert np.concatenate(groups).size == 6


def _dense_engine(tiny_model_dir, tmp_path, **backend_options):
    engine = Engine.load(str(tiny_model_dir), **CONFIG)
    engine.backend = OnnxRuntimeBackend(engine.model, engine.cache, engine.adapters, cache_dir=tmp_path,
                                        kv_layout="dense", **backend_options)
    return engine


def test_dense_rows_follow_prefix_hits_and_finished_sequences(tiny_model_dir, tmp_path):
    # A shared 3-block prefix: the second wave hits the prefix cache, so its rows are filled
    # from the paged cache; sequences of different lengths finish apart, so rows are freed and
    # compacted while others decode. Greedy output must match the torch backend throughout.
    prefix = "The user asks and the assistant answers. " * 3
    prompts = [prefix + p for p in PROMPTS[:6]]
    params = [SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True) for i in range(6)]
    torch_engine = Engine.load(str(tiny_model_dir), **CONFIG)
    dense_engine = _dense_engine(tiny_model_dir, tmp_path)
    for engine in (torch_engine, dense_engine):
        engine.generate(prompts[:1], params[0])  # caches the prefix
    want = [torch_engine.generate(p, q)[0].candidates[0].token_ids for p, q in zip(prompts, params, strict=True)]
    ids = [dense_engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    done = {}
    while dense_engine.has_unfinished():
        for out in dense_engine.step():
            done[out.request_id] = out
    assert [done[i].candidates[0].token_ids for i in ids] == want
    assert dense_engine.stats()["prefix_cache_hit_blocks"] > 0
    dense = dense_engine.backend.dense
    dense.release_stale(())  # what the next step does first: finished sequences give their rows back
    assert dense.owners == [] and dense.nbytes > 0  # the buffer stays for the next sequences


def test_dense_runs_past_its_byte_limit_from_a_scratch_buffer(tiny_model_dir, tmp_path, reference):
    adapters, ref_logits, ref_tokens = reference
    engine = make_engine(tiny_model_dir, "torch", adapters, **CONFIG)
    engine.backend = OnnxRuntimeBackend(engine.model, engine.cache, engine.adapters, cache_dir=tmp_path,
                                        kv_layout="dense", dense_kv_bytes=1)
    logits, tokens = run_recording(engine, PROMPTS, USERS, SamplingParams(max_tokens=10, ignore_eos=True))
    assert max((a - b).abs().max().item() for a, b in zip(logits, ref_logits, strict=True)) < 1e-3
    assert tokens == ref_tokens
    assert engine.backend.dense.nbytes == 0  # never allocated: every run used a scratch buffer


def test_dense_score_leaves_the_engine_rows_alone(tiny_model_dir, tmp_path):
    engine = Engine.load(str(tiny_model_dir), **CONFIG)
    ids = engine.tokenizer.hf.encode("The quick brown fox jumps over the lazy dog.")
    paged = OnnxRuntimeBackend(engine.model, engine.cache, None, cache_dir=tmp_path, kv_layout="paged").score(ids)
    dense = OnnxRuntimeBackend(engine.model, engine.cache, None, cache_dir=tmp_path, kv_layout="dense")
    assert (dense.score(ids) - paged).abs().max().item() < 1e-4
    assert dense.dense.owners == [] and dense.dense.nbytes == 0


def test_decode_inputs_equal_the_plan_of_a_decode_step():
    # Three decode rows (one with an adapter), items in another order than their rows: the
    # preallocated inputs hold what the plan builds, and logit_rows lists each item's row.
    by_row = [StepItem([7], 5, [3], True), StepItem([9], 40, [0, 4, 2], True, 0), StepItem([11], 16, [6, 1], True)]
    plan = plan_dense_step(by_row, [False] * 3, 16)
    order = [2, 0, 1]  # item k runs in row order[k]
    items = [by_row[r] for r in order]
    slots = [int(plan.slot_mapping[r]) for r in order]
    inputs = DecodeInputs(8)
    inputs.fill(order, [it.tokens[0] for it in items], [it.start for it in items], slots,
                [it.lora_slot for it in items])
    views = inputs.views(3, lora=True)
    assert views.keys() == plan.inputs.keys()
    for name, array in plan.inputs.items():
        want = array[order] if name == "logit_rows" else array
        assert views[name].dtype == array.dtype and np.array_equal(views[name], want), name
    assert np.array_equal(inputs.positions[:3], plan.real_positions[order])
    assert list(plan.slot_mapping) == [3 * 16 + 5, 2 * 16 + 8, 1 * 16 + 0]
    assert "lora_index" not in inputs.views(3, lora=False)
    with pytest.raises(ValueError, match="9 decode rows"):
        inputs.fill(list(range(9)), [1] * 9, [1] * 9, [1] * 9, None)


def test_steady_decode_steps_match_the_general_dense_path_exactly(tiny_model_dir, tmp_path, reference):
    # The dense layout's decode shortcut (preallocated inputs bound once) against the general
    # planning path: the same logits bit for bit and the same tokens, over a continuous batch
    # with two adapters and base rows where sequences start and finish apart (the shortcut
    # must step aside for the steps that prefill, free or grow rows).
    adapters = reference[0]
    runs = {}
    for shortcut in (True, False):
        engine = make_engine(tiny_model_dir, "torch", adapters, **CONFIG)
        engine.backend = backend = OnnxRuntimeBackend(engine.model, engine.cache, engine.adapters,
                                                      cache_dir=tmp_path, kv_layout="dense")
        taken = []
        decode_step = backend._decode_step

        def counted(items, refs, decode_step=decode_step, shortcut=shortcut, taken=taken):
            out = decode_step(items, refs) if shortcut else None
            taken.append(out is not None)
            return out

        backend._decode_step = counted
        captured, outputs = [], {}
        execute = backend.execute
        backend.execute = lambda batch, execute=execute, captured=captured: captured.append(execute(batch)) or captured[-1]
        ids = [engine.add_request(p, SamplingParams(max_tokens=6 + 5 * i, ignore_eos=True), adapter=u)
               for i, (p, u) in enumerate(zip(PROMPTS[:6], USERS[:6], strict=True))]
        while engine.has_unfinished():
            outputs.update((out.request_id, out.candidates[0].token_ids) for out in engine.step())
        runs[shortcut] = captured, [outputs[i] for i in ids], taken
    (fast, fast_tokens, taken), (slow, slow_tokens, not_taken) = runs[True], runs[False]
    assert len(fast) == len(slow) == len(taken)
    assert all(torch.equal(a, b) for a, b in zip(fast, slow, strict=True))
    assert fast_tokens == slow_tokens
    assert not any(not_taken) and sum(taken) >= len(taken) // 2
    assert not all(taken)  # the general path ran too (prefill, rows freed as sequences finished)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_copy_to_cache_writes_each_token_to_its_slot(tiny_model_dir, monkeypatch, dtype):
    # The per-token NumPy copy (a decode step's few float32 tokens) and the indexed copy (many
    # tokens, or another cache dtype) write the same entries, and nothing else.
    import edge_runtime.backends.dense_kv as dense_kv
    from edge_runtime.kv.cache import KVCache

    cfg = ModelConfig.from_dir(tiny_model_dir)
    torch.manual_seed(0)
    rows, positions, slots = np.array([2, 0, 1]), np.array([5, 0, 63]), np.array([17, 3, 40])
    written = []
    for per_token in (64, 0):
        monkeypatch.setattr(dense_kv, "PER_TOKEN_COPY_MAX", per_token)
        cache = KVCache(cfg, 4, 16, dtype, "cpu")
        dense = dense_kv.DenseKV(cache, None, 64)
        dense.ensure(3, 64)
        dense.buffer.copy_(torch.randn(dense.buffer.shape, generator=torch.Generator().manual_seed(1)))
        dense.copy_to_cache(rows, positions, slots)
        for row, pos, slot in zip(rows, positions, slots, strict=True):
            want = dense.buffer[:, :, row, :, pos].to(dtype)  # [layers, 2, kv_heads, d]
            assert torch.equal(cache.data[:, :, slot], want)
        untouched = torch.ones(cache.data.shape[2], dtype=torch.bool)
        untouched[slots] = False
        assert not cache.data[:, :, untouched].any()
        written.append(cache.data)
    assert torch.equal(written[0], written[1])


def test_dense_rows_grow_to_exactly_what_is_in_use_near_the_byte_limit(tiny_model_dir):
    # Geometric growth leaves spare rows; near the limit a larger capacity must still fit by
    # dropping them, not fall back to a scratch buffer refilled from the paged cache every step.
    from edge_runtime.backends.dense_kv import CAPACITY_STEP, DenseKV
    from edge_runtime.kv.cache import KVCache

    cache = KVCache(ModelConfig.from_dir(tiny_model_dir), 8, 16, torch.float32, "cpu")
    cap = CAPACITY_STEP
    dense = DenseKV(cache, 10 * cap * DenseKV(cache, None, 0).token_bytes, 4096)
    assert dense.ensure(4, cap) and dense.ensure(5, cap)
    assert dense.rows_capacity == 8  # geometric growth: three spare rows
    rows = dense.assign(object() for _ in range(5))
    dense.buffer[:, :, 4].fill_(1.0)
    dense.valid[4] = cap
    assert dense.ensure(5, 2 * cap)  # 8 rows x 2 cap would pass the limit; the 5 in use fit
    assert (dense.rows_capacity, dense.capacity) == (5, 2 * cap) and rows == [0, 1, 2, 3, 4]
    assert bool((dense.buffer[:, :, 4, :, :cap] == 1.0).all())  # the rows' contents moved along
    assert not dense.ensure(5, 3 * cap)  # past the limit even without spare rows


def test_decode_inputs_carry_rotary_rows_as_the_plan_does():
    # A graph that turns q/k by row (LongRoPE, partial rotary) takes each token's rotary table
    # row: its position plus the sequence's offset (here one sequence past a switch of 32).
    by_row = [StepItem([7], 5, [3], True), StepItem([9], 40, [0, 4, 2], True, 0, rope_offset=32)]
    plan = plan_dense_step(by_row, [False] * 2, 16, rope_rows=True)
    assert plan.inputs["positions"].tolist() == [[5], [72]]
    order = [1, 0]
    items = [by_row[r] for r in order]
    inputs = DecodeInputs(4)
    inputs.fill(order, [it.tokens[0] for it in items], [it.start for it in items],
                [int(plan.slot_mapping[r]) for r in order], None, [it.rope_offset for it in items])
    views = inputs.views(2, lora=True, rope_rows=True)
    assert views.keys() == plan.inputs.keys()
    assert np.array_equal(views["positions"], plan.inputs["positions"])
    assert "positions" not in plan_dense_step(by_row, [False] * 2, 16).inputs
    gqa = plan_gqa_step([StepItem([1, 2, 3], 0, [0], True, rope_offset=32)], 16, 2, rope_rows=True)
    assert gqa.inputs["positions"].tolist() == [[32, 33, 34]]


def test_a_large_graph_is_held_once_the_lora_graph_serving_base_rows_too(tiny_model_dir, tmp_path, reference,
                                                                         monkeypatch):
    """Past `ONE_GRAPH_BYTES` the base session is closed when the LoRA graph opens, and that graph
    serves base rows too (the no-adapter stack: their delta is exactly 0), so the weights are
    pre-packed once, not twice (#28). Same tokens as the torch reference with two adapters and
    base rows in one batch; base rows after it score as they did on the base graph."""
    import edge_runtime.backends.ort_graphs as backend_module

    monkeypatch.setattr(backend_module, "ONE_GRAPH_BYTES", 0)
    adapters, ref_logits, ref_tokens = reference
    engine = make_engine(tiny_model_dir, "onnxruntime", adapters, onnx_cache_dir=str(tmp_path), **CONFIG)
    backend = engine.backend
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    on_base_graph = backend.score(ids)
    limit = backend.dense.limit_bytes
    assert backend.reserved_bytes == backend._sessions[False].weights_bytes + limit
    logits, tokens = run_recording(engine, PROMPTS, USERS, SamplingParams(max_tokens=10, ignore_eos=True))
    assert list(backend._sessions) == [True]  # the base session was closed, not kept beside it
    assert tokens == ref_tokens
    assert max((a - b).abs().max().item() for a, b in zip(logits, ref_logits, strict=True)) < 1e-3
    assert torch.equal(backend.score(ids), on_base_graph)
    assert backend.reserved_bytes == backend._sessions[True].weights_bytes + limit
    base = USERS.index(None)  # a base row alone, after the adapters' steps
    out = engine.generate(PROMPTS[base], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert out.candidates[0].token_ids == ref_tokens[base]
