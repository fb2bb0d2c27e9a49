"""Writes our llama step (prefill chunks or decode rows over the paged KV cache, per-row LoRA)
as one ONNX graph, straight from `LlamaModel`'s fused weights.

Two flavours of the same computation, each with its own writer over the shared layer loop
(onnx_step.py): "ort" (onnx_ort.py: ONNX Runtime's fused contrib ops) and "standard"
(onnx_standard.py: ai.onnx ops only, what TensorRT parses). What an export is: onnx_spec.py. The
inputs, outputs and shapes are documented in docs/onnx.md; `StepInputs` (step_inputs.py) builds
the index tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

from edge_runtime.backends.onnx_external import ExternalData
from edge_runtime.backends.onnx_ort import OrtStepWriter
from edge_runtime.backends.onnx_spec import GraphSpec
from edge_runtime.backends.onnx_standard import StandardStepWriter
from edge_runtime.backends.onnx_step import StepWriter
from edge_runtime.model.llama import LlamaModel

WRITERS: dict[str, type[StepWriter]] = {"ort": OrtStepWriter, "standard": StandardStepWriter}


def step_writer(model: LlamaModel, spec: GraphSpec, on_layer: Callable[[], None] | None = None,
                sink: ExternalData | None = None) -> StepWriter:
    """The writer of `spec`'s flavour (tests drive its parts, e.g. one linear)."""
    return WRITERS[spec.flavour](model, spec, on_layer, sink)


def build_step_graph(model: LlamaModel, spec: GraphSpec, on_layer: Callable[[], None] | None = None,
                     sink: ExternalData | None = None) -> onnx.ModelProto:
    """The whole step (embedding to logits and new K/V) as an ONNX model: weights inline, or with
    a `sink`, in its external data file, each written as it is made (onnx_external.py);
    `on_layer` is called after each decoder layer (quantising the layers is most of the time)."""
    return step_writer(model, spec, on_layer, sink).build()
