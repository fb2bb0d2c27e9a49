"""The wire format apps and `maced` share: frames, ops, arguments, error codes, tensors, endpoints.

Torch-free by rule (tests/daemon/test_torch_free.py): msgpack, msgspec and the standard library only (numpy
when adapter tensors are converted), never zmq, torch or the engine. The SDK imports nothing else
of the daemon. docs/protocol.md is the prose version of this package.
"""

from daemon.wire.args import (
    AdaptersListArgs,
    CancelArgs,
    ConsentArgs,
    EmbedArgs,
    FeedbackArgs,
    NoArgs,
    RollbackArgs,
    UserArgs,
)
from daemon.wire.errors import ERROR_CODES, ERRORS, HTTP_STATUS, ErrorCode, ProtocolError
from daemon.wire.fields import MAX_EMBED_INPUTS, MAX_ID_CHARS, internal_user, request_id_of
from daemon.wire.fleet import (
    FleetEvaluateArgs,
    FleetLoraConfig,
    FleetPublishArgs,
    FleetRollbackArgs,
    FleetRoundArgs,
    FleetRoundConfig,
    WireTensor,
)
from daemon.wire.frames import (
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    decode,
    encode,
    error_from,
    error_message,
    reply_envelope,
    result_message,
    split_envelope,
    token_message,
)
from daemon.wire.ops import IDEMPOTENT_OPS, OPS, TENSOR_OPS, Request, parse_request
from daemon.wire.schema import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKENS_CAP,
    GenerateArgs,
)
from daemon.wire.tensors import tensors_from_wire, tensors_to_wire

__all__ = [
    "ERROR_CODES", "ERRORS", "HTTP_STATUS", "IDEMPOTENT_OPS", "MAX_EMBED_INPUTS", "MAX_ID_CHARS", "MAX_LOGIT_BIAS", "MAX_LOGPROBS",
    "MAX_N", "MAX_STOP_CHARS", "MAX_STOP_STRINGS", "MAX_STOP_TOKEN_IDS", "MAX_TOKENS_CAP", "OPS",
    "PROTOCOL_VERSION", "SUPPORTED_VERSIONS", "TENSOR_OPS", "AdaptersListArgs", "CancelArgs", "ConsentArgs",
    "EmbedArgs", "ErrorCode", "FeedbackArgs", "FleetEvaluateArgs", "FleetLoraConfig", "FleetPublishArgs",
    "FleetRollbackArgs", "FleetRoundArgs", "FleetRoundConfig", "GenerateArgs", "NoArgs", "ProtocolError",
    "Request", "RollbackArgs", "UserArgs", "WireTensor", "decode", "encode", "error_from", "error_message",
    "internal_user", "parse_request", "reply_envelope", "request_id_of", "result_message", "split_envelope",
    "tensors_from_wire", "tensors_to_wire", "token_message",
]
