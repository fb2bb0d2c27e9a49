"""Shape ranges (min, opt, max) for every dynamic input of the exported step graph, from the
engine's limits: max batch (sequences per step), max tokens per step, max context, LoRA columns.

Pure Python over the ONNX file's symbolic dimensions; used by the native TensorRT builder and
for ONNX Runtime's TensorRT EP profile options.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx


@dataclass(frozen=True)
class StepLimits:
    max_batch: int = 32  # sequences in one step (config.max_num_seqs)
    max_tokens: int = 256  # tokens in one step (config.max_batched_tokens)
    max_context: int = 2048  # tokens per sequence (config.max_context or the model's)
    max_lora_rank: int = 64  # summed ranks of the distinct adapters in one step
    cache_rows: int = 0  # slots * kv_heads of the bound KV cache (fixed per engine)

    def key(self) -> str:
        return f"b{self.max_batch}-t{self.max_tokens}-c{self.max_context}-r{self.max_lora_rank}-s{self.cache_rows}"


def dim_ranges(limits: StepLimits, group: int, kv_heads: int) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) of each symbolic dimension name the step graph uses."""
    b, t, c, r = limits.max_batch, max(limits.max_tokens, limits.max_batch), limits.max_context, limits.max_lora_rank
    opt_b = min(16, b)  # decode at 16 streams is the case we tune for
    ranges = {
        # flat ("standard") graph
        "tokens": (1, opt_b, t),
        "seqs": (1, opt_b, b),
        "group_queries": (group, group, group * limits.max_tokens),
        "keys": (1, 256, c),
        "new_kv_rows": (kv_heads, kv_heads * opt_b, kv_heads * t),
        "logit_rows": (1, opt_b, b),
        "lora_rank": (1, 8, r),
        # row ("ort") graph, for ONNX Runtime's TensorRT EP
        "rows": (1, opt_b, b),
        "row_tokens": (1, 1, limits.max_tokens),
        "past": (1, 256, c),
        "cache_rows": (limits.cache_rows, limits.cache_rows, limits.cache_rows),
    }
    for site, k in (("qkv", 3), ("o", 1), ("gate_up", 2), ("down", 1)):
        ranges[f"lora_{site}_columns_x{k}"] = (k, 8 * k, r * k)
    return ranges


def input_shapes(onnx_path: str | Path, limits: StepLimits) -> dict[str, tuple[list[int], list[int], list[int]]]:
    """Per graph input: (min, opt, max) shapes with every symbolic dimension resolved."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    group, kv_heads = int(meta["group"]), int(meta["kv_heads"])
    ranges = dim_ranges(limits, group, kv_heads)
    shapes = {}
    for value in model.graph.input:
        lo, opt, hi = [], [], []
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                if dim.dim_param not in ranges:
                    raise KeyError(f"no range for dimension {dim.dim_param!r} of input {value.name}")
                a, o, z = ranges[dim.dim_param]
            else:
                a = o = z = dim.dim_value
            lo.append(a)
            opt.append(o)
            hi.append(z)
        shapes[value.name] = (lo, opt, hi)
    return shapes


def ort_trt_profile_options(onnx_path: str | Path, limits: StepLimits) -> dict[str, str]:
    """ONNX Runtime TensorRT EP options declaring one explicit profile (no rebuilds at run time)."""
    shapes = input_shapes(onnx_path, limits)

    def fmt(i: int) -> str:
        return ",".join(f"{name}:{'x'.join(str(d) for d in s[i])}" for name, s in shapes.items() if s[i])

    return {"trt_profile_min_shapes": fmt(0), "trt_profile_opt_shapes": fmt(1), "trt_profile_max_shapes": fmt(2)}
