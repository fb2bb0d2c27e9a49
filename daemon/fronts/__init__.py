"""The daemon's fronts: how requests reach the `Service`. `zmq_server` (the SDK's ZeroMQ protocol)
and `http` (the OpenAI-compatible gateway) both build `daemon.wire` arguments and call the same
Service methods; neither touches the engine.
"""
