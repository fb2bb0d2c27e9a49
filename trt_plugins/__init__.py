"""trt_plugins."""
