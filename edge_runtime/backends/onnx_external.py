"""The export's external data file, written as the graph is built: each initializer's bytes are
appended the moment the writer makes it and dropped from the proto, so exporting a model holds
about one weight at a time instead of the whole graph (issue #28 item 3).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import BinaryIO

import numpy as np
from onnx import TensorProto, helper
from onnx.external_data_helper import set_external_data

# What onnx.save_model(save_as_external_data=True) moves out by default: its test is on
# sys.getsizeof of the raw bytes (length plus the bytes object's header), kept the same here so
# an export's files stay byte for byte what they were when the whole graph was saved at the end.
SIZE_THRESHOLD = 1024
_BYTES_HEADER = sys.getsizeof(b"")
# dtypes whose raw bytes numpy_helper.from_array stores as they are in memory (little-endian)
_DIRECT = {np.dtype(t) for t in (np.float32, np.float64, np.float16, np.int8, np.uint8, np.int32, np.int64)}


class ExternalData:
    """Appends tensors' raw bytes to `path` (named `location` in the graph), in the order given,
    at the offsets onnx's own saver gives them; the file is created on the first tensor."""

    def __init__(self, path: Path, location: str) -> None:
        self.path = path
        self.location = location
        self._file: BinaryIO | None = None
        self.bytes_written = 0

    def _open(self) -> BinaryIO:
        if self._file is None:  # owner-only, as onnx's own saver creates it
            self._file = os.fdopen(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")
        return self._file

    def array(self, name: str, array: np.ndarray) -> TensorProto | None:
        """`array` written straight to the file and its tensor (what numpy_helper.from_array and
        `take` would give, without the two copies of its bytes they make), or None where `take`
        must decide (small, or a dtype numpy_helper converts)."""
        if array.dtype not in _DIRECT or sys.byteorder != "little" or array.nbytes + _BYTES_HEADER < SIZE_THRESHOLD:
            return None
        file = self._open()
        offset = file.tell()
        file.write(memoryview(np.ascontiguousarray(array)).cast("B"))
        tensor = TensorProto()
        tensor.dims.extend(array.shape)
        tensor.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        tensor.name = name
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", offset), ("length", array.nbytes)):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)
        self.bytes_written += array.nbytes
        return tensor

    def take(self, tensor: TensorProto) -> None:
        """Moves `tensor`'s bytes to the file if onnx would (raw bytes over the threshold)."""
        if not tensor.HasField("raw_data") or sys.getsizeof(tensor.raw_data) < SIZE_THRESHOLD:
            return
        file = self._open()
        offset, length = file.tell(), len(tensor.raw_data)
        file.write(tensor.raw_data)
        set_external_data(tensor, self.location, offset, length)
        tensor.ClearField("raw_data")
        self.bytes_written += length

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> ExternalData:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
