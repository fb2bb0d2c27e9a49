"""Sequence log-probs of preference pairs under the policy (an adapter) or the reference (the
base model with the adapter off), plus the cache of reference log-probs: the base is frozen, so a
pair's reference values never change and are computed once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

import torch
from torch import Tensor

from edge_runtime.model.dense import dense_logits
from edge_runtime.model.llama import LlamaModel, LoraApplier, linear, softcap
from edge_runtime.model.mapped_weights import give_back_after_use
from edge_runtime.model.qweights import float_row_chunks
from edge_runtime.train.pairs import PairTokens
from edge_runtime.train.windows import PairKV, pair_rope_offsets, plan_windows


def token_logps(model: LlamaModel, hidden: Tensor, targets: Tensor) -> Tensor:
    """log p(target | row) for hidden rows [n, hidden] -> [n], in float32: `model.logits` read a
    piece of the vocabulary at a time (`_TargetLogps`), so the [n, vocab] logits, their
    exponentials and their gradient never exist whole (at a 128k vocabulary each is 0.5 MiB a
    row in float32)."""
    return _TargetLogps.apply(model.final_hidden(hidden), targets, model)


def _head_pieces(model: LlamaModel, final: Tensor) -> Iterator[tuple[int, Tensor, Tensor]]:
    """(first vocabulary id, head rows [piece, hidden], the piece's logits before `_post`) of
    final-norm rows, one head piece at a time. The head rows may be this thread's de-quantisation
    workspace (valid until the next piece; possibly made in inference mode, so autograd must
    never save it: the backward multiplies by it outside autograd)."""
    # Where the engine serves from its own graph, a piece's block pages go once used: the tied
    # table's 206 MiB at 1B had stayed resident until the iteration's stages ended.
    for lo, weight in float_row_chunks(model.lm_head_weight(), final.dtype,
                                       lambda tensors: give_back_after_use(model, tensors)):
        yield lo, weight, linear(final, weight)


def _plain(model: LlamaModel) -> bool:
    """Whether the logits are the head's product as it is (no scaling, no soft-cap)."""
    return model.cfg.logits_scaling == 1.0 and model.cfg.final_softcap is None


def _post(model: LlamaModel, y: Tensor) -> Tensor:
    """What `model.logits` does after the head's matmul (Granite's scaling, Gemma's soft-cap), in float32."""
    scaling = model.cfg.logits_scaling
    y = y if scaling == 1.0 else y / scaling
    return softcap(y, model.cfg.final_softcap).float()


class _TargetLogps(torch.autograd.Function):
    """log softmax(logits)[target] over the head's pieces: the forward keeps a running max and
    sum of exponentials per row (an online logsumexp); what is saved is the rows, their targets
    and their logsumexp. Where the rows need a gradient and the logits are the head's plain
    product (no scaling or soft-cap: Llama, Qwen), the same single pass also accumulates each
    row's softmax-weighted head rows, rescaled as the running max moves, so the gradient
    d logp / d row = W[target] - softmax @ W is ready when the head has been read once (the
    staged forward differentiates right after: reading a 4-bit head, which is de-quantised on
    every read, twice cost a second de-quantisation and a third GEMM). Otherwise the backward
    computes each piece's logits again and adds its share, (onehot - softmax) * grad."""

    @staticmethod
    def forward(ctx, final: Tensor, targets: Tensor, model: LlamaModel) -> Tensor:  # noqa: ANN001
        n = final.shape[0]
        top = torch.full((n,), -torch.inf, dtype=torch.float32, device=final.device)
        total = torch.zeros(n, dtype=torch.float32, device=final.device)
        picked = torch.zeros(n, dtype=torch.float32, device=final.device)
        fused = ctx.needs_input_grad[0] and _plain(model)
        softmax_w = torch.zeros(final.shape, dtype=torch.float32, device=final.device) if fused else None
        target_w = torch.zeros(final.shape, dtype=torch.float32, device=final.device) if fused else None
        for lo, weight, y in _head_pieces(model, final):
            z = _post(model, y)
            here = (targets >= lo) & (targets < lo + z.shape[1])
            picked[here] = z[here, targets[here] - lo]
            new_top = torch.maximum(top, z.amax(dim=1))
            rescale = torch.exp(top - new_top)
            e = torch.exp(z - new_top[:, None])
            total = total * rescale + e.sum(dim=1)
            top = new_top
            if fused:
                softmax_w.mul_(rescale[:, None]).add_((e.to(weight.dtype) @ weight).float())
                target_w[here] = weight[targets[here] - lo].float()
        lse = top + torch.log(total)
        ctx.model, ctx.dtype = model, final.dtype
        if fused:
            ctx.fused = True
            ctx.save_for_backward(target_w.sub_(softmax_w.div_(total[:, None])))
        else:
            ctx.fused = False
            ctx.save_for_backward(final, targets, lse)
        return picked - lse

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # noqa: ANN001
        if ctx.fused:
            (d_row,) = ctx.saved_tensors
            return (grad.float()[:, None] * d_row).to(ctx.dtype), None, None
        final, targets, lse = ctx.saved_tensors
        model = ctx.model
        grad = grad.float()
        grad_final = torch.zeros_like(final)
        plain = _plain(model)
        for lo, weight, y in _head_pieces(model, final.detach()):
            z = y.float() if plain else None
            if not plain:  # only the elementwise post-processing goes through autograd
                y = y.detach().requires_grad_(True)
                with torch.enable_grad():
                    z = _post(model, y)
            seed = torch.exp(z.detach() - lse[:, None]).mul_(-grad[:, None])  # -softmax * grad
            here = ((targets >= lo) & (targets < lo + z.shape[1])).nonzero().squeeze(-1)
            seed[here, targets[here] - lo] += grad[here]
            grad_y = seed if plain else torch.autograd.grad(z, y, seed)[0]
            grad_final += grad_y.to(weight.dtype) @ weight
        return grad_final, None, None


@torch.no_grad()
def pair_logps(
    model: LlamaModel, tokens: PairTokens, lora: LoraApplier | None, window_tokens: int | None = None
) -> tuple[float, float]:
    """(log pi(chosen|prompt), log pi(rejected|prompt)) in one pass that runs the prompt once.
    Every window's rows in one call of the layers (`WindowsContext`: a later window attends to
    the keys and values the earlier ones left in the same layer, as window by window), so a
    quantised weight is de-quantised once for all the windows, a row chunk at a time, with no
    float copy of a layer held (#28); and the scored rows of every window go through the LM head
    together: the head is read once, not per window."""
    kv = PairKV(model.cfg.num_layers, model.cfg.layer_windows, model.cfg.attn_softcap)
    device = model.device
    windows = plan_windows(tokens, window_tokens, rope_offsets=pair_rope_offsets(model, tokens))
    hidden = model.embed_tokens(torch.cat([win.input_ids for win in windows]).to(device))
    positions = torch.cat([win.positions for win in windows]).to(device)
    hidden = list(model.run_layers(hidden, positions, kv.contexts(windows, lora)).split([w.num_rows for w in windows]))
    sums = torch.zeros(2, dtype=torch.float64)
    scored = [j for j, win in enumerate(windows) if win.score_rows.numel()]
    if scored:
        rows = torch.cat([hidden[j].index_select(0, windows[j].score_rows.to(device)) for j in scored])
        logp = token_logps(model, rows, torch.cat([windows[j].targets for j in scored]).to(device))
        sums.index_add_(0, torch.cat([windows[j].owners for j in scored]), logp.double().cpu())
    return float(sums[0]), float(sums[1])


def pair_logps_dense(model: LlamaModel, tokens: PairTokens, lora: LoraApplier | None) -> Tensor:
    """The same two sums from one padded [2, P + C] full-sequence forward (autograd flows): the
    plain reference that the staged task's gradients are checked against."""
    p, c = len(tokens.prompt), tokens.completion_length
    rows = []
    for comp in (tokens.chosen, tokens.rejected):
        rows.append(list(tokens.prompt) + list(comp) + [0] * (c - len(comp)))
    ids = torch.tensor(rows, dtype=torch.long, device=model.device)
    mask = torch.zeros_like(ids)
    mask[0, : p + len(tokens.chosen)] = 1
    mask[1, : p + len(tokens.rejected)] = 1
    logits = dense_logits(model, ids, mask, lora).float()
    sums = []
    for row, comp in enumerate((tokens.chosen, tokens.rejected)):
        pred = logits[row, p - 1 : p - 1 + len(comp)]  # position t predicts token t + 1
        target = torch.tensor(comp, dtype=torch.long, device=model.device)
        sums.append((pred.gather(-1, target[:, None]).squeeze(-1) - torch.logsumexp(pred, -1)).sum())
    return torch.stack(sums)


class ReferenceCache:
    """pair key -> (ref chosen, ref rejected) log-probs, least recently used dropped first."""

    def __init__(self, max_entries: int = 8192) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, tuple[float, float]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tokens: PairTokens) -> bool:
        return self.has(tokens)

    def has(self, tokens: PairTokens, beneath: str = "") -> bool:
        return _key(tokens, beneath) in self._entries

    def get(self, tokens: PairTokens, beneath: str = "") -> tuple[float, float] | None:
        """`beneath`: the fleet version the reference includes ("" for the base alone)."""
        key = _key(tokens, beneath)
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return value

    def put(self, tokens: PairTokens, value: tuple[float, float], beneath: str = "") -> None:
        key = _key(tokens, beneath)
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


def _key(tokens: PairTokens, beneath: str) -> bytes:
    # A reference with the fleet beneath depends on the fleet's version; '\0' cannot occur in
    # an owner@version key.
    return tokens.key if not beneath else beneath.encode() + b"\0" + tokens.key
