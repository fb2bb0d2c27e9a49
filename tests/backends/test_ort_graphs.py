"""The LoRA graph of a large model opens only after the base session is closed and the C heap
trimmed (`ort_graphs.StepGraphs.session`, #28): the closed session's packed weights and the
export's temporaries go back to the system before the same weights are packed again, and the
base rows then served by the LoRA graph score as they did on the base graph."""

from __future__ import annotations

import torch

from edge_runtime import SamplingParams
from edge_runtime.backends import ort_graphs
from edge_runtime.model.config import ModelConfig
from tests.backends.helpers import make_engine, ort_device, two_adapters


def test_the_heap_is_trimmed_between_closing_the_base_graph_and_packing_the_lora_graph(tiny_model_dir, tmp_path,
                                                                                         monkeypatch):
    monkeypatch.setattr(ort_graphs, "ONE_GRAPH_BYTES", 0)
    adapters = two_adapters(ModelConfig.from_dir(tiny_model_dir))
    engine = make_engine(tiny_model_dir, "onnxruntime", adapters, onnx_cache_dir=str(tmp_path), dtype="float32",
                         kv_cache_bytes=4 << 20, device=ort_device())
    graphs = engine.backend.graphs
    ids = engine.tokenizer.encode("The quick brown fox")
    on_base_graph = engine.backend.score(ids)
    events: list[tuple] = []
    trim, open_session = ort_graphs.give_heap_back, ort_graphs.open_session
    monkeypatch.setattr(ort_graphs, "give_heap_back", lambda: events.append(("trim", sorted(graphs.sessions))) or trim())
    monkeypatch.setattr(ort_graphs, "open_session",
                        lambda *a, **k: events.append(("open", k["has_lora_inputs"])) or open_session(*a, **k))
    engine.add_request("Hello there", SamplingParams(max_tokens=2, ignore_eos=True), adapter="alice")
    while engine.has_unfinished():
        engine.step()
    assert events == [("trim", []), ("open", True)]  # base closed, heap trimmed, then the LoRA graph packed
    assert list(graphs.sessions) == [True]
    assert torch.equal(engine.backend.score(ids), on_base_graph)  # base rows on the LoRA graph: the same logits
