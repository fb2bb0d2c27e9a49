"""TensorRT-only pieces: the engine cache, the native engine builder and the TensorRT backend
(the step graph's shape profiles are ONNX code: edge_runtime/backends/shape_profiles.py). `tensorrt` is imported only inside the
functions that need it, so this package imports (and its pure parts are tested) anywhere.

The step graph's "standard" flavour uses only ai.onnx ops (Gather, ScatterND, MatMul, Softmax,
block-wise DequantizeLinear), all native TensorRT layers: no plugin is needed today. A plugin
(e.g. paged attention) would live here, registered before parsing.
"""
