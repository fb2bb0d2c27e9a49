"""Text embeddings from the served model: the final hidden states (after the final norm, as the
LM head reads them) mean-pooled over the input's tokens and scaled to unit length.

A decoder's pooled states are not a trained sentence embedding; they serve retrieval over the
model's own view of text and OpenAI-client compatibility (`/v1/embeddings`). Runs the dense
forward without a KV cache, one input at a time, on the base model (no adapter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edge_runtime.model.dense import DenseCausalContext
from edge_runtime.model.llama import LlamaModel

MAX_INPUTS = 256


@torch.no_grad()
def embed_ids(model: LlamaModel, ids: list[int]) -> list[float]:
    """The unit-length mean of `ids`' final hidden states, in float32."""
    tokens = torch.tensor(ids, dtype=torch.long, device=model.device)
    positions = torch.arange(len(ids), device=model.device)
    ctx = DenseCausalContext(1, len(ids), None, None, model.cfg.layer_windows, model.cfg.attn_softcap)
    hidden = model.final_hidden(model.run_layers(model.embed_tokens(tokens), positions, ctx))
    return F.normalize(hidden.float().mean(dim=0), dim=0).cpu().tolist()
