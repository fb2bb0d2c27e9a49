"""Test helpers: observe the logits our paged engine path produces, and the reference's."""

from __future__ import annotations

import torch

from edge_runtime import Engine, SamplingParams


def make_engine(model_dir, **overrides) -> Engine:
    """The tiny model's engine as the engine tests use it: float32, 8 MiB of KV, blocks of 8."""
    settings = {"dtype": "float32", "kv_cache_bytes": 8 << 20, "block_size": 8}
    settings.update(overrides)
    return Engine.load(str(model_dir), **settings)


def engine_logits_for(
    engine: Engine, prompt_ids: list[int], steps: int, adapter: str | None = None
) -> tuple[torch.Tensor, list[int]]:
    """Greedy-decode `steps` tokens from raw prompt ids through the engine (paged KV, chunked
    prefill as configured), under user `adapter`'s newest adapter if given; returns the logits of
    every sampling step [steps, vocab] and the generated ids."""
    captured: list[torch.Tensor] = []
    execute = engine.backend.execute

    def spy(batch, lora=None):  # the real path, observed
        out = execute(batch, lora) if lora is not None else execute(batch)
        captured.append(out.detach().cpu().clone())
        return out

    engine.backend.execute = spy
    try:
        text = engine.tokenizer.hf.decode(prompt_ids)
        rid = engine.add_request(text, SamplingParams(max_tokens=steps, ignore_eos=True), adapter=adapter)
        _set_prompt_ids(engine, rid, prompt_ids)
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


def engine_greedy_batch(engine: Engine, prompts: list[list[int]], steps: int,
                        adapters: list[str | None] | None = None) -> list[list[int]]:
    """Greedy-decode `steps` tokens for every prompt, all admitted at once so they share
    iterations (decode rows beside prefill chunks), each with its user's adapter where `adapters`
    names one; returns each prompt's generated ids."""
    ids = []
    for i, prompt_ids in enumerate(prompts):
        rid = engine.add_request(engine.tokenizer.hf.decode(prompt_ids), SamplingParams(max_tokens=steps, ignore_eos=True),
                                 adapter=None if adapters is None else adapters[i])
        _set_prompt_ids(engine, rid, prompt_ids)
        ids.append(rid)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    return [outputs[rid].token_ids for rid in ids]


def _set_prompt_ids(engine: Engine, request_id: str, prompt_ids: list[int]) -> None:
    # Feed the exact ids (decode+encode need not round-trip for random ids).
    request = engine.requests[request_id]
    request.prompt_ids = list(prompt_ids)
    for seq in request.seqs:
        seq.token_ids = list(prompt_ids)
