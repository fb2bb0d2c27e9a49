"""tools/bench_scale.py's model builder, at a tiny scale: the folder it writes (config from
transformers' own class, bf16 shards, padded tokenizer) is one `Engine.load` accepts."""

from __future__ import annotations

import json
from pathlib import Path

from edge_runtime import Engine, SamplingParams
from tests.tool_modules import load_tool


def test_tiny_llama3_shape_builds_a_folder_the_engine_loads(tmp_path: Path) -> None:
    tool = load_tool("bench_scale")
    real = tool.SHAPES["llama-3.2-1b"]
    shape = real.scaled(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                        vocab_size=600, max_position_embeddings=1024,
                        rope_parameters={**real.rope_parameters, "original_max_position_embeddings": 256})
    folder = tool.build_model_dir(shape, tmp_path / "m", shard_bytes=64 << 10)
    assert tool.check_supported(folder) is None
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and "lm_head.weight" not in index["weight_map"]  # tied
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "llama3" and config["tie_word_embeddings"] is True

    engine = Engine.load(folder, dtype="float32", kv_cache_bytes=1 << 20, cost_profile="off")
    assert engine.model.cfg.vocab_size == len(engine.tokenizer) == 600  # every id the model emits decodes
    out = engine.generate("the user asks", SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.text
