"""Adapter tensors on the wire (fleet.round, fleet.evaluate; docs/protocol.md): a map from PEFT
tensor names to {"dtype": "float32", "shape": [ints], "data": raw little-endian bytes}, to and
from numpy arrays. numpy only (imported when used), so the SDK stays free of torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_DTYPES = {"float32": "<f4"}


def tensors_to_wire(arrays: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """numpy arrays (or anything numpy reads) -> the wire's float32 tensors."""
    import numpy as np

    out = {}
    for name, value in arrays.items():
        array = np.ascontiguousarray(np.asarray(value, dtype=_DTYPES["float32"]))
        out[name] = {"dtype": "float32", "shape": list(array.shape), "data": array.tobytes()}
    return out


def tensors_from_wire(tensors: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The wire's tensors -> numpy arrays (copies, writable)."""
    import numpy as np

    return {name: np.frombuffer(t["data"], dtype=_DTYPES[t["dtype"]]).reshape(t["shape"]).copy()
            for name, t in tensors.items()}
