"""The stage-cost profile reads the LM head as the stages do (a piece of the vocabulary at a
time, each piece's mapped block pages given back where another backend serves): through
`model.logits` it had kept the whole head's pages resident, the first pair's peak at 1B (#28)."""

from __future__ import annotations

from edge_runtime.lora import LoraSettings
from edge_runtime.model import mapped_weights, source
from edge_runtime.model.block_cache import BLOCKS_FILE
from edge_runtime.model.mapped_weights import read_per_layer
from edge_runtime.model.weights import load_llama
from edge_runtime.train import costs as costs_module
from edge_runtime.train.costs import StageCostModel
from tests.engine.test_mapped_weights import mapped_rss
from tests.model.quant_helpers import Q4_K_M_LIKE, private_cache, tiny_quant_gguf  # noqa: F401 (autouse fixture)


def test_the_profile_gives_the_heads_pages_back_as_it_reads_them(tmp_path, monkeypatch) -> None:
    _, path = tiny_quant_gguf(tmp_path, Q4_K_M_LIKE, num_layers=2)
    cached = source.resolve_model(path, cache_dir=tmp_path / "cache", progress=False).path
    model = load_llama(cached)
    per_layer = read_per_layer(model)  # as the engine does where a graph serves
    assert per_layer is not None
    mapped, hooks = per_layer
    head = model.lm_head_weight()
    head_bytes = sum(t.numel() * t.element_size() for t in head.buffers())
    looked_up: list[int] = []
    embed = model.embed_tokens
    monkeypatch.setattr(model, "embed_tokens", lambda ids: looked_up.append(ids.numel()) or embed(ids))
    try:
        calls: dict[str, int] = {}
        StageCostModel.profile(model, LoraSettings(rank=4, alpha=8), rows=16, small_rows=4, layers=2,
                               repeats=1, long_call_s=0.0, calls=calls)
        assert calls["head_backwards"] > 0 and looked_up
        # The layers went back after each pass (hooks); the embedding's looked-up rows may stay;
        # of the head at most the pages around the last piece's give-back (fault-around).
        rest = sum(hi - lo for lo, hi in mapped.rest)
        assert mapped_rss(cached / BLOCKS_FILE) <= rest - head_bytes // 2
    finally:
        for hook in hooks:
            hook.remove()
        mapped_weights._GIVEN_BACK.pop(model, None)


def test_the_profiles_head_is_the_stages_log_probs(tiny4, monkeypatch) -> None:
    used: list[bool] = []
    real = costs_module.token_logps
    monkeypatch.setattr(costs_module, "token_logps", lambda m, h, t: used.append(h.requires_grad) or real(m, h, t))
    monkeypatch.setattr(type(tiny4), "logits", lambda *a, **k: (_ for _ in ()).throw(AssertionError("whole logits")))
    StageCostModel.profile(tiny4, LoraSettings(rank=4, alpha=8), rows=16, small_rows=4, layers=2, repeats=1,
                           long_call_s=0.0)
    assert True in used and False in used  # the head with its backward, and without
