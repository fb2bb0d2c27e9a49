"""TensorRT-only pieces: optimisation profiles for the exported step graph, the engine cache,
the native engine builder and the TensorRT backend. `tensorrt` is imported only inside the
functions that need it, so this package imports (and its pure parts are tested) anywhere.

The step graph's "standard" flavour uses only ai.onnx ops (Gather, ScatterND, MatMul, Softmax,
block-wise DequantizeLinear), all native TensorRT layers: no plugin is needed today. A plugin
(e.g. paged attention) would live here, registered before parsing.
"""
