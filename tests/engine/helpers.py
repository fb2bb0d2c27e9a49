"""Test helpers: observe the logits our paged engine path produces, and the reference's."""

from __future__ import annotations

import torch

from edge_runtime import Engine, SamplingParams


def make_engine(model_dir, **overrides) -> Engine:
    """The tiny model's engine as the engine tests use it: float32, 8 MiB of KV, blocks of 8."""
    settings = {"dtype": "float32", "kv_cache_bytes": 8 << 20, "block_size": 8}
    settings.update(overrides)
    return Engine.load(str(model_dir), **settings)


def engine_logits_for(engine: Engine, prompt_ids: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """Greedy-decode `steps` tokens from raw prompt ids through the engine (paged KV, chunked
    prefill as configured); returns the logits of every sampling step [steps, vocab] and the
    generated ids."""
    captured: list[torch.Tensor] = []
    execute = engine.backend.execute

    def spy(batch, lora=None):  # the real path, observed
        out = execute(batch, lora) if lora is not None else execute(batch)
        captured.append(out.clone())
        return out

    engine.backend.execute = spy
    try:
        text = engine.tokenizer.hf.decode(prompt_ids)
        rid = engine.add_request(text, SamplingParams(max_tokens=steps, ignore_eos=True))
        request = engine.requests[rid]
        # Feed the exact ids (decode+encode need not round-trip for random ids).
        request.prompt_ids = list(prompt_ids)
        for seq in request.seqs:
            seq.token_ids = list(prompt_ids)
        out = None
        while engine.has_unfinished():
            done = engine.step()
            if done:
                out = done[0]
    finally:
        engine.backend.execute = execute
    rows = [c[0] for c in captured if c.shape[0] > 0]
    return torch.stack(rows), out.token_ids


def reference_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()
