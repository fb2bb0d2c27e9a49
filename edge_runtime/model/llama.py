"""Our llama-family forward (Llama, Mistral, Qwen2/3, SmolLM, Granite, OLMo 2, Phi-3, Gemma 2/3) over a
flat batch of tokens.

The model owns weights and the per-token math (RMSNorm, RoPE, GQA projections, gated MLP, tied
embeddings, and the family variations `ModelConfig` names: q/k norms, norms after the sublayers,
Granite's multipliers, Gemma's (1 + w) norms, GELU-tanh, soft-caps and per-layer rotary tables). How tokens attend to each other (paged KV cache for serving, dense causal
masks for training) and which LoRA deltas apply per row come from the caller's `ForwardContext`, so the
same layers serve inference and fine-tuning without copying a weight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edge_runtime.kv import attention_kernel
from edge_runtime.model import family, gguf_layer, gguf_stack
from edge_runtime.model.config import ModelConfig
from edge_runtime.model.qweights import QuantWeight, quant_linear

# LoRA target names, as PEFT and Hugging Face name the projections.
ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
# Families with fused projections (ModelConfig.fused_projections) name one module for each group.
FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class LoraApplier(Protocol):
    def delta(self, layer: int, target: str, x: Tensor) -> Tensor | None:
        """The LoRA contribution `scale * B(A(x))` for each row of x, or None if no row has one."""


class ForwardContext(Protocol):
    """What a batch tells the layers: how to attend, and which adapters apply. A context may also
    carry `row_invariant = True` (serving's `PagedContext` with `engine.deterministic`): the
    projections then compute each row independently of the rows beside it (`tiled_linear`)."""

    lora: LoraApplier | None

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [T, heads, d]; k, v: [T, kv_heads, d] (RoPE applied). Returns [T, heads * d]."""


def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    # Normalise in fp32 and cast back before the weight, as the reference implementation does,
    # so our logits match `transformers` to rounding. Gemma's weights are offsets from 1, applied
    # in fp32 before the cast (its own order).
    dtype = x.dtype
    x32 = x.float()
    if x.is_cuda and not x.requires_grad:
        # One fused kernel instead of five on a GPU, where a decode step is bound by its
        # kernel count (issue #33); the same fp32 normalisation.
        x32 = F.rms_norm(x32, x32.shape[-1:], eps=eps)
    else:
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (x32 * (offset + weight.float())).to(dtype)
    return weight * x32.to(dtype)


def softcap(x: Tensor, cap: float | None) -> Tensor:
    """Gemma's soft-capping: tanh(x / cap) * cap, x itself where cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


def window_mask(q_pos: Tensor, k_pos: Tensor, window: int | None) -> Tensor:
    """Causal mask (True = may attend) of queries at q_pos [..., Q, 1] over keys at k_pos
    [..., 1, K], a query seeing `window` keys at most, itself included."""
    mask = k_pos <= q_pos
    return mask if window is None else mask & (k_pos > q_pos - window)


def layer_window(windows: int | None | tuple[int | None, ...], layer: int) -> int | None:
    """Layer `layer`'s window from a context's `sliding_window`: one for every layer, or a tuple
    per layer (`ModelConfig.layer_windows`)."""
    return windows[layer] if isinstance(windows, tuple) else windows


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, cap: float | None) -> Tensor:
    """softmax(q k^T / sqrt(d) (soft-capped), masked) v over [B, heads, L, d] and [B, kv_heads, K, d];
    mask None = causal over L == K. Without a cap, SDPA itself (as every family but Gemma 2 runs);
    with one, written out as transformers' eager attention computes it."""
    if cap is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = softcap(torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5, cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryTable(nn.Module):
    """cos/sin [rows, rotary_dim] for every position up to the model's maximum, built once in fp32.
    Only the first half of each row is kept (`cos_half`, `sin_half`): in the rotate-half layout the
    two halves are the same angles, so `lookup` joins the half to itself (at Llama 3.2's 131,072
    positions the whole tables held 64 MiB, #28).

    The inverse frequencies (including the config's scaling: linear, llama3, yarn, ...) come from
    `transformers`' own RoPE initialisers, so every scaling variant matches the reference.

    LongRoPE (Phi-3.5, Phi-4-mini) has two sets of frequencies, and transformers computes a whole
    forward with one of them, chosen by the forward's length: the short factors while a sequence
    holds at most `switch` (original_max_position_embeddings) tokens, the long ones for every
    position of a longer one. The table then holds the short rows of positions [0, switch) followed
    by the long rows of every position: a token's row is its position plus `offset(n)`, n being
    the length of the sequence it is computed in.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, key: str | None = None) -> None:
        super().__init__()
        hf = cfg.hf_config
        params = family.rope_set(hf, key)  # `key`: Gemma 3's set of one layer type
        rope_type = params.get("rope_type", "default")
        extra = {} if key is None else {"layer_type": key}
        n = max_positions or cfg.max_position_embeddings
        self.rotary_dim = cfg.rotary_dim
        self.switch = cfg.rope_switch
        self.short_rows = 0
        if torch.empty(0).device.type == "meta":
            # A shell built on the meta device (weights read in later, tables rebuilt on the real
            # device): computing rows there runs torch's Python reference kernels, whose first
            # use imports torch._dynamo, ~1-2 s of every daemon start. Same shapes, no numbers.
            self.short_rows = min(self.switch, n) if self.switch is not None else 0
            rows = self.short_rows + n
            self.register_buffer("cos_half", torch.empty(rows, cfg.rotary_dim // 2), persistent=False)
            self.register_buffer("sin_half", torch.empty(rows, cfg.rotary_dim // 2), persistent=False)
            return
        if rope_type == "default":
            base = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
            dim = cfg.rotary_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        else:  # a static type, or LongRoPE's short set (edge_runtime.model.family refused the others)
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, device=None, **extra)
        cos, sin = _rotary_rows(inv_freq, n, scaling)
        if self.switch is not None:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            # The long set, as transformers asks for it once a forward is past the switch; the
            # attention factor does not depend on the length.
            long_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](hf, device=None, seq_len=self.switch + 1)
            long_cos, long_sin = _rotary_rows(long_freq, n, scaling)
            self.short_rows = min(self.switch, n)
            cos, sin = torch.cat([cos[: self.short_rows], long_cos]), torch.cat([sin[: self.short_rows], long_sin])
        self.register_buffer("cos_half", cos, persistent=False)
        self.register_buffer("sin_half", sin, persistent=False)

    @property
    def rows(self) -> int:
        return self.cos_half.shape[0]

    def tables(self) -> tuple[Tensor, Tensor]:
        """The whole cos/sin [rows, rotary_dim] tables (a copy: for a graph's export)."""
        return torch.cat((self.cos_half, self.cos_half), dim=-1), torch.cat((self.sin_half, self.sin_half), dim=-1)

    def offset(self, length: int) -> int:
        """What a token's position is shifted by to find its row, in a sequence of `length` tokens
        (0 but for LongRoPE past its switch)."""
        return self.short_rows if self.switch is not None and length > self.switch else 0

    def lookup(self, rows: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        cos, sin = self.cos_half[rows].to(dtype), self.sin_half[rows].to(dtype)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def rotary_tables(cfg: ModelConfig, max_positions: int | None = None) -> nn.ModuleList:
    """One RotaryTable per entry of `cfg.rope_tables`."""
    return nn.ModuleList(RotaryTable(cfg, max_positions, key) for key in cfg.rope_tables)


def _rotary_rows(inv_freq: Tensor, n: int, scaling: float) -> tuple[Tensor, Tensor]:
    """The first half of cos/sin [n, rotary_dim] in the rotate-half layout (its halves are equal),
    taken from the whole rows as transformers computes them, so the bits are theirs."""
    freqs = torch.arange(n, dtype=torch.float)[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    half = freqs.shape[1]
    return (emb.cos() * scaling)[:, :half].clone(), (emb.sin() * scaling)[:, :half].clone()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, heads, d]; cos, sin: [T, r]. The first r dims of each head turn; the rest (Phi's
    partial rotary, r < d) pass through unscaled, as in transformers. On the CPU in float32 one
    compiled call gives the same bits (edge_runtime.kv.attention_kernel.rope)."""
    turned = attention_kernel.rope(x, cos, sin)
    if turned is not None:
        return turned
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    turned, kept = x[..., :r], x[..., r:]
    return torch.cat([turned * cos + rotate_half(turned) * sin, kept], dim=-1)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class DecoderLayer(nn.Module):
    """One transformer block. q/k/v and gate/up are stored fused: one matmul instead of three
    (two) per step, which matters at small batch sizes where kernel launches dominate."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.index = index
        h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        # Norms before the attention and MLP sublayers, on their outputs (OLMo 2), or both (Gemma).
        pre, post = cfg.norm_before_sublayer, cfg.norm_after_sublayer
        self.input_norm = _param(h) if pre else None
        self.post_norm = _param(h) if pre else None
        self.attn_out_norm = _param(h) if post else None
        self.mlp_out_norm = _param(h) if post else None
        self.qkv_weight = _param(q + 2 * kv, h)
        self.qkv_bias = _param(q + 2 * kv) if cfg.attention_bias else None
        # q/k RMSNorm weights: one head's width, shared by every head (Qwen3), or the whole
        # projection's (OLMo 2).
        per_head = cfg.qk_norm == "head"
        self.q_norm = None if cfg.qk_norm is None else _param(cfg.head_dim if per_head else q)
        self.k_norm = None if cfg.qk_norm is None else _param(cfg.head_dim if per_head else kv)
        self.o_weight = _param(h, q)
        self.o_bias = _param(h) if cfg.attention_out_bias else None
        self.gate_up_weight = _param(2 * inter, h)
        self.down_weight = _param(h, inter)
        self.gate_up_bias = _param(2 * inter) if cfg.mlp_bias else None
        self.down_bias = _param(h) if cfg.mlp_bias else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: ForwardContext) -> Tensor:
        """`cos`, `sin`: rows of this layer's rotary table (`ModelConfig.layer_rope_table`)."""
        group = gguf_layer.plans(self, x, ctx)
        if group is not None:  # a GGUF served in place: four grouped kernel calls (gguf_layer)
            return gguf_layer.forward(self, x, cos, sin, ctx, group, apply_rope)
        cfg = self.cfg
        lora = ctx.lora
        lin = linear_for(ctx)
        residual = x
        hn = self._pre_norm(x, self.input_norm)
        qkv = lin(hn, self.qkv_weight, self.qkv_bias)
        fused = cfg.fused_projections  # Phi-3: one LoRA on qkv_proj (and gate_up_proj), as PEFT has it
        if lora is not None and fused:
            qkv = _add(qkv, lora.delta(self.index, "qkv_proj", hn))
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        qk = None
        if lora is None and cfg.qk_norm is None and qkv.dim() == 2:
            qk = qkv[:, : cfg.q_size + cfg.kv_size].unflatten(-1, (cfg.num_heads + cfg.num_kv_heads, cfg.head_dim))
        if lora is not None and not fused:
            q = _add(q, lora.delta(self.index, "q_proj", hn))
            k = _add(k, lora.delta(self.index, "k_proj", hn))
            v = _add(v, lora.delta(self.index, "v_proj", hn))
        if cfg.qk_norm == "full":
            q, k = self._norm(q, self.q_norm), self._norm(k, self.k_norm)
        t = x.shape[0]
        q = q.reshape(t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm == "head":
            q, k = self._norm(q, self.q_norm), self._norm(k, self.k_norm)
        if cfg.rope_layers[self.index] and qk is not None:
            # q and k still side by side in the fused projection: one rotation over both heads'
            # rows (the same element-wise ops; half the kernels of a decode step's rotary part).
            q, k = apply_rope(qk, cos, sin).split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        elif cfg.rope_layers[self.index]:  # SmolLM3's NoPE layers attend without positions
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cfg.query_scale != 1.0:
            # Granite's and Gemma's attention scale: every context divides q.k by sqrt(head_dim),
            # so q carries the rest (the cached keys stay as transformers has them).
            q = q * cfg.query_scale
        attn = ctx.attention(self.index, q, k, v)
        out = lin(attn, self.o_weight, self.o_bias)
        if lora is not None:
            out = _add(out, lora.delta(self.index, "o_proj", attn))
        x = residual + self._sublayer_out(out, self.attn_out_norm)

        residual = x
        hn = self._pre_norm(x, self.post_norm)
        gate_up = lin(hn, self.gate_up_weight, self.gate_up_bias)
        if lora is not None and fused:
            gate_up = _add(gate_up, lora.delta(self.index, "gate_up_proj", hn))
        gate, up = gate_up.chunk(2, dim=-1)
        if lora is not None and not fused:
            gate = _add(gate, lora.delta(self.index, "gate_proj", hn))
            up = _add(up, lora.delta(self.index, "up_proj", hn))
        act = (F.silu(gate) if cfg.activation == "silu" else F.gelu(gate, approximate="tanh")) * up
        down = lin(act, self.down_weight, self.down_bias)
        if lora is not None:
            down = _add(down, lora.delta(self.index, "down_proj", act))
        return residual + self._sublayer_out(down, self.mlp_out_norm)

    def _norm(self, x: Tensor, weight: Tensor) -> Tensor:
        return rms_norm(x, weight, self.cfg.rms_norm_eps, self.cfg.norm_offset)

    def _pre_norm(self, x: Tensor, weight: Tensor | None) -> Tensor:
        return x if weight is None else self._norm(x, weight)

    def _sublayer_out(self, out: Tensor, norm: Tensor | None) -> Tensor:
        """What a sublayer adds to the residual: its output, normalised (OLMo 2, Gemma) and scaled
        by the residual multiplier (Granite)."""
        if norm is not None:
            out = self._norm(out, norm)
        m = self.cfg.residual_multiplier
        return out if m == 1.0 else out * m


def linear(x: Tensor, weight: Tensor | QuantWeight, bias: Tensor | None = None) -> Tensor:
    """`_float_linear`, over a weight de-quantised for this call where it is kept quantised."""
    if isinstance(weight, QuantWeight):
        return quant_linear(x, weight, bias, _float_linear)
    return _float_linear(x, weight, bias)


# Rows per GEMM tile of `tiled_linear`.
ROW_TILE = 16


def row_invariant_linear(x: Tensor, weight: Tensor | QuantWeight, bias: Tensor | None = None) -> Tensor:
    """`linear` with every row computed the same way whatever other rows share `x` (`tiled_linear`)."""
    if isinstance(weight, QuantWeight):
        return quant_linear(x, weight, bias, tiled_linear)
    return tiled_linear(x, weight, bias)


def tiled_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight^T (+ bias), each row's value a function of that row alone (issue #31).

    A GEMM library picks its kernel, and with it each row's order of summation, by the number of
    rows (measured on torch's CPU float32 GEMM: a row rounds one way alone, another among 2..15
    rows and a third among 16 or more, and K=1536 has a further path for 64..192 rows). Within
    one GEMM of a fixed shape, though, a row's value does not depend on its neighbours or its
    place. So the rows go in tiles of ROW_TILE, the last padded with zeros, through one batched
    GEMM of [tiles, ROW_TILE, K] (one tile or many: the same per-tile kernel, measured), and the
    bias is added after it rather than fused into it.
    """
    if x.dim() != 2:
        return tiled_linear(x.reshape(-1, x.shape[-1]), weight, bias).reshape(*x.shape[:-1], weight.shape[0])
    rows = x.shape[0]
    pad = -rows % ROW_TILE
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    tiles = x.shape[0] // ROW_TILE
    out = torch.bmm(x.reshape(tiles, ROW_TILE, x.shape[1]), weight.t().expand(tiles, -1, -1))
    out = out.view(-1, weight.shape[0])[:rows]
    return out if bias is None else out + bias


# Keys per tile of `key_tiled_attention`'s weighted sum.
KEY_TILE = 64


def key_tiled_attention(weights: Tensor, v: Tensor) -> Tensor:
    """weights @ v over keys in fixed tiles of KEY_TILE, summed tile by tile in order (issue #31).

    A lone GEMM picks its summation by the key count: MKL splits a long reduction into parts by
    the whole length (measured on this float32 GEMM: a row's sum over its 300+ real keys moved
    once zero-weight padding took the call past ~400 keys), so a decode row's output followed
    the longest context among the decode rows beside it. Each tile here is one GEMM of a fixed
    shape, and the tiles past a row's context hold exact zero weights, so their partial sums add
    exact zeros. `weights` [..., rows, keys] and `v` [..., keys, d] with keys a multiple of
    KEY_TILE (the caller pads both)."""
    tiles = weights.shape[-1] // KEY_TILE
    parts = torch.matmul(weights.unflatten(-1, (tiles, KEY_TILE)).movedim(-2, -3),
                         v.unflatten(-2, (tiles, KEY_TILE)))  # [..., tiles, rows, d]
    out = parts[..., 0, :, :]
    for i in range(1, tiles):
        out = out + parts[..., i, :, :]
    return out


def _float_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear that computes every row the same way whatever the batch size.

    oneDNN takes a matrix-vector path for a single row whose rounding differs from its
    matrix-matrix path (measured: bf16 down_proj rows differ between M=1 and M>=2). A lone
    row would then decode differently from the same row in a batch, breaking the invariant
    that greedy output does not depend on what runs beside it; two rows always take the
    matrix path. In float32 neither path is bitwise batch-invariant (M=2 rows differ from the
    same rows in a batch of 16 as well) while the doubled row costs 2x (measured: 139 vs 283 us
    on the fused gate/up projection), so float32 keeps the single-row kernel.
    """
    if x.dim() == 2 and x.shape[0] == 1 and x.dtype != torch.float32 and not x.is_cuda:
        return F.linear(x.expand(2, -1).contiguous(), weight, bias)[:1]
    return F.linear(x, weight, bias)


def linear_for(ctx: ForwardContext | None) -> Callable[..., Tensor]:
    """The linear a forward under `ctx` uses: `row_invariant_linear` where the context asks
    for rows that do not depend on their batch (serving with `deterministic`), else `linear`."""
    return row_invariant_linear if getattr(ctx, "row_invariant", False) else linear


def _add(base: Tensor, delta: Tensor | None) -> Tensor:
    return base if delta is None else base + delta


class LlamaModel(nn.Module):
    """Embeddings, decoder layers, final norm and LM head of a llama-family model. Any of the
    projections, the embedding table and the head may be a `QuantWeight` instead of a float
    parameter (a GGUF's blocks kept as they are: `edge_runtime.model.gguf_load`); the forward
    then de-quantises each one where it is used."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size)
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size)
        self.ropes = rotary_tables(cfg, max_positions)

    @property
    def rope(self) -> RotaryTable:
        """The first rotary table (the only one but for Gemma 3); LongRoPE's offsets live here."""
        return self.ropes[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype  # never quantised, unlike the embedding table

    @property
    def device(self) -> torch.device:
        return self.norm.device

    @property
    def quantized(self) -> bool:
        """Whether any weight is kept as quantised blocks."""
        return any(isinstance(m, QuantWeight) for m in self.modules())

    def lm_head_weight(self) -> Tensor | QuantWeight:
        return self.embed if self.lm_head is None else self.lm_head

    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        if isinstance(self.embed, QuantWeight):
            x = self.embed.embedding(input_ids, self.dtype)
        else:
            x = F.embedding(input_ids, self.embed)
        m = self.cfg.embedding_multiplier  # Granite's, Gemma's sqrt(hidden); 1 elsewhere
        if m == 1.0:
            return x
        if self.cfg.embedding_multiplier_in_dtype:  # Gemma: transformers casts it to the weights' dtype
            return x * torch.tensor(m, dtype=x.dtype, device=x.device)
        return x * m

    def run_layers(
        self, x: Tensor, positions: Tensor, ctx: ForwardContext, start: int = 0, stop: int | None = None
    ) -> Tensor:
        """Layers [start, stop) on hidden states x: [T, hidden]. Staged training calls this per group.
        `positions`: each token's row of the rotary table, its position plus `rope.offset(n)` for
        a sequence of n tokens (the position itself but for LongRoPE)."""
        tables = [rope.lookup(positions, x.dtype) for rope in self.ropes]
        if start == 0 and stop is None:  # a decode step over a GGUF read in place: one call (gguf_stack)
            stacked = gguf_stack.run(self, x, tables, ctx)
            if stacked is not None:
                return stacked
        for layer in self.layers[start:stop]:
            cos, sin = tables[self.cfg.layer_rope_table[layer.index]]
            x = layer(x, cos, sin, ctx)
        return x

    def logits(self, hidden: Tensor, ctx: ForwardContext | None = None) -> Tensor:
        """Final norm and LM head for the rows whose next token is wanted."""
        logits = linear_for(ctx)(self.final_hidden(hidden), self.lm_head_weight())
        scaling = self.cfg.logits_scaling  # Granite divides its logits; 1 elsewhere
        logits = logits if scaling == 1.0 else logits / scaling
        return softcap(logits, self.cfg.final_softcap)  # Gemma's; None elsewhere

    def final_hidden(self, hidden: Tensor) -> Tensor:
        """The last layer's output as the LM head reads it (after the final norm); embeddings
        pool it."""
        return rms_norm(hidden, self.norm, self.cfg.rms_norm_eps, self.cfg.norm_offset)

    def forward(
        self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext, logit_rows: Tensor | None = None
    ) -> Tensor:
        hidden = self.run_layers(self.embed_tokens(input_ids), positions, ctx)
        if logit_rows is not None:
            hidden = hidden.index_select(0, logit_rows)
        return self.logits(hidden, ctx)
