"""How this onnxruntime build's GroupQueryAttention counts `local_window_size`, found by running it.

Current builds attend to `local_window_size` keys, the query's own included; older ones (an
onnxruntime-gpu wheel on a Jetson may be one) to that many before it plus itself. A version
string cannot say which kernel a wheel carries, so a one-node graph is run once per process and
provider list, and the answer cached. Knows nothing about our models or sessions.
"""

from __future__ import annotations

from functools import cache

import numpy as np

# Probe shape: 8 keys (value of key j = unit vector e_j), a window of 4, zero queries so every
# key inside the window gets the same weight. head_dim 16 is the smallest the CPU kernel takes.
_KEYS, _WINDOW, _HEAD_DIM = 8, 4, 16


def keys_attended(local_window_size: int, providers: tuple[str, ...] = ("CPUExecutionProvider",),
                  past: bool = False) -> int:
    """How many keys the last of `_KEYS` queries attends to under `local_window_size`: as one
    prompt (`past=False`) or as one decode token over a past of `_KEYS - 1` keys (`past=True`)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    n, d = _KEYS, _HEAD_DIM
    s = 1 if past else n
    vi = helper.make_tensor_value_info
    f = TensorProto.FLOAT
    node = helper.make_node(
        "GroupQueryAttention", ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total"], ["out", "present_k",
                                                                                           "present_v"],
        domain="com.microsoft", num_heads=1, kv_num_heads=1, local_window_size=local_window_size, scale=1.0,
    )
    graph = helper.make_graph(
        [node], "gqa_window_probe",
        [vi("q", f, [1, "s", d]), vi("k", f, [1, "s", d]), vi("v", f, [1, "s", d]),
         vi("past_k", f, [1, 1, "p", d]), vi("past_v", f, [1, 1, "p", d]),
         vi("seqlens_k", TensorProto.INT32, [1]), vi("total", TensorProto.INT32, [])],
        [vi("out", f, [1, "s", d]), vi("present_k", f, None), vi("present_v", f, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(), providers=list(providers))
    values = np.eye(d, dtype=np.float32)[:n]
    past_v = np.zeros((1, 1, n - s if past else 0, d), np.float32)
    if past:
        past_v[0, 0] = values[: n - 1]
    out = session.run(["out"], {
        "q": np.zeros((1, s, d), np.float32), "k": np.zeros((1, s, d), np.float32), "v": values[None, n - s:],
        "past_k": np.zeros_like(past_v), "past_v": past_v,
        "seqlens_k": np.array([n - 1], np.int32), "total": np.array(n, np.int32),
    })[0]
    return int(np.count_nonzero(out[0, -1] > 1e-6))


@cache
def window_counts_current_token(providers: tuple[str, ...] = ("CPUExecutionProvider",)) -> bool:
    """True where `local_window_size = w` attends to w keys (the query's own included), False
    where it attends to w + 1. Raises RuntimeError for any other answer, or where prompt and
    decode disagree: then no attribute value gives a sliding window right."""
    counts = {keys_attended(_WINDOW, providers, past) for past in (False, True)}
    if counts == {_WINDOW}:
        return True
    if counts == {_WINDOW + 1}:
        return False
    raise RuntimeError(
        f"this onnxruntime's GroupQueryAttention attends to {sorted(counts)} keys (prompt, decode) with "
        f"local_window_size={_WINDOW}; a sliding-window model cannot run on its 'ort' graph (use the torch backend)"
    )


def local_window_size(sliding_window: int | None, providers: tuple[str, ...] = ("CPUExecutionProvider",)) -> int:
    """GroupQueryAttention's `local_window_size` for a model whose queries see `sliding_window`
    keys, themselves included (transformers' meaning); -1 = no window."""
    if sliding_window is None:
        return -1
    return sliding_window if window_counts_current_token(providers) else sliding_window - 1
