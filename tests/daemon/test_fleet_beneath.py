"""The daemon's fine-tuner trains each user's adapter on top of the fleet version served to new
requests, and follows a newly published or rolled-back fleet version between batches."""

from __future__ import annotations

import torch

from daemon.config import FineTuneSettings
from daemon.finetune.engine_tuner import EngineFineTuner
from edge_runtime.config import EngineConfig
from edge_runtime.engine import Engine
from edge_runtime.lora import LoraSettings, LoraWeights
from edge_runtime.model.tokenizer import Tokenizer
from edge_runtime.model.weights import load_llama
from edge_runtime.train.costs import StageCostModel


def test_user_trainers_follow_the_served_fleet_version(tiny_model_dir):
    model = load_llama(tiny_model_dir, dtype=torch.float32)
    engine = Engine(model, Tokenizer(tiny_model_dir), EngineConfig(kv_cache_bytes=4 << 20, max_context=256),
                    name="tiny")
    tuner = EngineFineTuner(None, None, FineTuneSettings())  # type: ignore[arg-type]
    tuner._stage_costs = StageCostModel.nominal(model)  # no profiling in a unit test
    assert tuner._trainer(engine, "alice").fleet is None
    v1, v2 = (LoraWeights.init(model.cfg, LoraSettings(rank=2), seed=s) for s in (1, 2))
    engine.publish_fleet(v1)
    trainer = tuner._trainer(engine, "alice")
    assert trainer.fleet_key == "+fleet@1"
    torch.testing.assert_close(trainer.fleet.a[(0, "q_proj")], v1.a[(0, "q_proj")])
    engine.publish_fleet(v2)
    assert tuner._trainer(engine, "alice").fleet_key == "+fleet@2"
    engine.rollback_fleet(to_version=0)
    assert tuner._trainer(engine, "alice").fleet is None and trainer.fleet_key == ""
