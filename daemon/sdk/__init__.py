"""The client SDK of `maced` (the public import path: `from daemon.sdk import Client`): `Client`
(blocking) and `AsyncClient` (asyncio), with token streams, timeouts, reconnects and safe retries.

Torch-free by rule (tests/daemon/test_torch_free.py): zmq, msgpack, the standard library and
`daemon.wire` only, so any app can use it.
"""

from daemon.sdk.async_client import AsyncClient, AsyncTokenStream
from daemon.sdk.client import Client, TokenStream
from daemon.sdk.results import (
           Candidate,
           ClientError,
           DaemonUnavailable,
           GenerateResult,
           RemoteError,
           Token,
)
from daemon.wire.tensors import tensors_from_wire, tensors_to_wire

__all__ = ["AsyncClient", "Candidate", "Client", "ClientError", "DaemonUnavailable",
           "GenerateResult", "RemoteError", "Token", "TokenStream", "AsyncTokenStream", "tensors_from_wire",
           "tensors_to_wire"]
