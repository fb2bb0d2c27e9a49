"""GroupQueryAttention's cos/sin tables hold the engine's context, not every position the model
has (131,072 rows at Llama 3.x: 64 MiB at 8B): the row count is part of the graph's key, and a
graph with the short table answers exactly as the whole table's, up to the context's last token
(a row-invariant decode row's pad included) (#28)."""

from __future__ import annotations

import pytest

ort = pytest.importorskip("onnxruntime")

import onnx  # noqa: E402

from edge_runtime import Engine, SamplingParams  # noqa: E402
from edge_runtime.backends import onnx_spec  # noqa: E402
from edge_runtime.backends.onnx_spec import GraphSpec, rope_table_rows  # noqa: E402
from edge_runtime.model.config import ModelConfig  # noqa: E402


def test_the_table_is_the_power_of_two_above_the_context(tiny_model_dir):
    cfg = ModelConfig.from_dir(tiny_model_dir)  # max_position_embeddings 2048
    assert rope_table_rows(cfg, "ort", 0, 0) == 0  # the model's whole context: the whole table
    assert rope_table_rows(cfg, "ort", 0, 1000) == 0  # at least MIN_ROPE_ROWS: past this model's 2048
    assert rope_table_rows(cfg, "standard", 40, 40) == 0  # TensorRT's graph gathers by row as before
    assert rope_table_rows(cfg, "ort", 1024, 1 << 20) == 0  # 2048 rows: the whole table anyway


def test_small_contexts_share_a_table_and_the_key_says_which(tiny_model_dir, monkeypatch):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    monkeypatch.setattr(onnx_spec, "MIN_ROPE_ROWS", 64)
    # The cache's tokens bound a sequence as the configured context does (sizing.max_context),
    # and a budget that moves a little (it follows the memory free) keeps its graph.
    cases = [(40, 0), (0, 40), (64, 1000), (65, 1000), (0, 100)]
    assert [rope_table_rows(cfg, "ort", c, t) for c, t in cases] == [64, 64, 64, 128, 128]
    assert GraphSpec(rope_positions=64).tag.endswith("-rope64") and "rope" not in GraphSpec().tag
    with pytest.raises(ValueError, match="rope_positions"):
        GraphSpec(flavour="standard", rope_positions=64)


def _greedy(model_dir, cache_dir, max_context: int, **extra) -> tuple[list[list[int]], Engine]:
    engine = Engine.load(str(model_dir), backend="onnxruntime", onnx_quantization="none", dtype="float32",
                         device="cpu", kv_cache_bytes=4 << 20, onnx_cache_dir=str(cache_dir), cost_profile="off",
                         speculation="off", max_context=max_context, **extra)
    prompts = [list(range(5, 5 + n)) for n in (7, 30)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_context, ignore_eos=True))
    assert len(outs[1].token_ids) >= max_context - 31  # generated to the context's end
    return [o.token_ids for o in outs], engine


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """One export cache for both cases (each graph is exported once)."""
    return tmp_path_factory.mktemp("rope-graphs")


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_short_table_answers_as_the_whole_one_to_the_contexts_end(tiny_model_dir, graphs, monkeypatch,
                                                                      deterministic):
    tmp_path = graphs
    monkeypatch.setattr(onnx_spec, "MIN_ROPE_ROWS", 1 << 20)
    whole, engine = _greedy(tiny_model_dir, tmp_path, 64, deterministic=deterministic)
    assert engine.backend.spec.rope_positions == 0
    monkeypatch.setattr(onnx_spec, "MIN_ROPE_ROWS", 16)
    short, engine = _greedy(tiny_model_dir, tmp_path, 64, deterministic=deterministic)
    # A 64-token context: the last step's total length is 64, a row-invariant decode's pad included
    # (a table one row shorter than a step's length is refused by GroupQueryAttention, not misread).
    assert engine.backend.spec.rope_positions == 64
    assert short == whole
    graph = onnx.load(str(engine.backend.model_path), load_external_data=False)
    shapes = {t.name: list(t.dims) for t in graph.graph.initializer if t.name.startswith("rope.")}
    assert shapes["rope.cos_half"][0] == 64 and shapes["rope.sin_half"][0] == 64
    assert len(list(tmp_path.glob("*-rope64-*"))) >= 1 and len(list(tmp_path.glob("*-v*"))) >= 2
