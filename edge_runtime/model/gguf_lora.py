"""A serving step's LoRA terms for the compiled path (gguf_native_lora.c): the batch's adapter groups
as C terms per layer and stage (q|k|v, o, gate|up, down), which the fused serving layer (gguf_layer.py)
and the decode stack (gguf_stack.py) both run, so an adapter row gets the same bits on either path,
whatever rows share its step. Owns the target -> stage and column mapping of the fused layer's outputs."""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from edge_runtime.model.qkernel import switch_on

ENV = "MACE_GGUF_LORA"  # "off": torch's deltas (the applier's own) on the fused path, and no stack for LoRA rows
MAX_RANK = 512  # gguf_native_lora.c's LORA_MAX_RANK
# The projections whose terms land on each of the fused layer's four outputs, in order.
STAGES = (("qkv_proj", "q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_up_proj", "gate_proj", "up_proj"),
          ("down_proj",))


class Term(ctypes.Structure):
    """gguf_native_lora.c's gg_lora_term."""

    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("rows", ctypes.c_void_p), ("m", ctypes.c_int64),
                ("r", ctypes.c_int64), ("k", ctypes.c_int64), ("n", ctypes.c_int64), ("col", ctypes.c_int64),
                ("scale", ctypes.c_float)]


def column(cfg, target: str) -> int:
    """The first column of `target`'s output in its stage's output (q|k|v, gate|up)."""
    return {"k_proj": cfg.q_size, "v_proj": cfg.q_size + cfg.kv_size, "up_proj": cfg.intermediate_size}.get(target, 0)


def _usable(t: Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad


class LoraPlan:
    """One step's terms: for each layer and stage, a run of `Term`s over the applier's groups that C
    serves; `rest`: an applier of the other groups (torch's deltas: bfloat16 weights, a rank past
    MAX_RANK), or None. Each group's way depends on its adapter alone, never on who shares the step."""

    def __init__(self, terms: list[tuple[int, int, Term]], layers: int, refs: list, rest=None) -> None:
        self.rest = rest
        terms.sort(key=lambda e: (e[0], e[1]))
        self.terms = (Term * max(1, len(terms)))(*(t for _, _, t in terms))
        self.spans = torch.zeros(layers * 4, 2, dtype=torch.int64)  # (first term, count) per layer and stage
        for i, (layer, stage, _) in enumerate(terms):
            span = self.spans[layer * 4 + stage]
            if span[1] == 0:
                span[0] = i
            span[1] += 1
        self._spans = self.spans.tolist()
        self.refs = refs  # the tensors whose addresses the terms hold

    def run(self, lib, layer: int, stage: int, x: Tensor, out: Tensor, threads: int, cfg=None) -> None:
        """out (float32 rows, row-major) += the stage's terms of x (float32 [rows, k], rows contiguous),
        and `rest`'s deltas (with `cfg`, the model's config)."""
        if self.rest is not None:
            add_torch(self.rest, layer, stage, x, out, cfg)
        first, count = self._spans[layer * 4 + stage]
        if count:
            rc = lib.gg_lora(ctypes.byref(self.terms, first * ctypes.sizeof(Term)), count, x.data_ptr(), x.stride(0),
                             out.data_ptr(), out.stride(0), threads)
            if rc != 0:
                raise RuntimeError(f"gg_lora failed ({rc}) on terms its plan checked")


def plan_for(lora, cfg, layers: int) -> LoraPlan | None:
    """The C terms of `lora` (a `BatchedLoraApplier`) for a model of `layers` layers, kept on the
    applier (one a step), or None for another applier (the caller takes its deltas). A group C
    cannot serve (a tensor not float32 contiguous on the CPU, a rank past MAX_RANK, a target outside
    `STAGES`, a layer past the model's) goes to the plan's `rest`. None too under MACE_GGUF_LORA=off."""
    if not switch_on(ENV):
        return None
    cached = getattr(lora, "_c_plan", False)
    if cached is not False:
        return cached
    plan = _build(lora, cfg, layers)
    try:
        lora._c_plan = plan
    except AttributeError:  # an applier with slots: built again next time
        pass
    return plan


def _build(lora, cfg, layers: int) -> LoraPlan | None:
    groups = getattr(lora, "groups", None)
    num_rows = getattr(lora, "num_rows", None)
    if groups is None or num_rows is None:
        return None
    terms: list[tuple[int, int, Term]] = []
    refs: list = []
    rest = []
    for weights, rows in groups:
        if rows is not None:
            rows = rows.contiguous()
        if not _servable(weights, layers) or (rows is not None and (rows.dtype != torch.int64 or rows.is_cuda)):
            rest.append((weights, rows))
            continue
        refs.append(rows)
        for (layer, target), a in weights.a.items():
            b = weights.b[(layer, target)]
            refs += (a, b)
            terms.append((layer, _STAGE_OF[target], Term(
                a.data_ptr(), b.data_ptr(), None if rows is None else rows.data_ptr(),
                num_rows if rows is None else rows.shape[0], a.shape[0], a.shape[1], b.shape[0], column(cfg, target),
                float(weights.settings.scale))))
    applier = type(lora)(rest, num_rows, getattr(lora, "row_invariant", False)) if rest else None
    return LoraPlan(terms, layers, refs, applier)


_STAGE_OF = {target: i for i, names in enumerate(STAGES) for target in names}


def _servable(weights, layers: int) -> bool:
    """Whether every projection of `weights` can go to C: float32 contiguous CPU tensors, a rank of
    1 to MAX_RANK, a stage's target, a layer of the model."""
    for (layer, target), a in weights.a.items():
        b = weights.b[(layer, target)]
        if target not in _STAGE_OF or not 0 <= layer < layers or not (_usable(a) and _usable(b)):
            return False
        if a.dim() != 2 or not 1 <= a.shape[0] <= MAX_RANK or b.dim() != 2 or b.shape[1] != a.shape[0]:
            return False
    return True


def add_torch(lora, layer: int, stage: int, x: Tensor, out: Tensor, cfg) -> None:
    """What `LoraPlan.run` adds, through the applier's own deltas (torch): where no plan serves."""
    for target in STAGES[stage]:
        delta = lora.delta(layer, target, x)
        if delta is not None:
            col = column(cfg, target)
            out[:, col: col + delta.shape[1]] += delta
