"""The fleet ops' arguments (fleet.publish, fleet.rollback, fleet.round, fleet.evaluate): adapter
tensors as they travel, the LoRA shape, a round's settings, declared as msgspec `Struct`s with
their bounds and checked once by `fields.convert`; the tensors' bytes are checked against their
shapes after.

msgspec and the standard library.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from daemon.wire.errors import ProtocolError
from daemon.wire.fields import ABSOLUTE_PATH, anchored, bounds_want, convert, refusal

Uint31 = Annotated[int, Meta(ge=0, le=2**31 - 1)]
OperatorKey = Annotated[str, Meta(max_length=256)]


class FleetPublishArgs(Struct, frozen=True):
    # An absolute path, on the daemon's machine, of a PEFT LoRA adapter folder.
    path: Annotated[str, Meta(max_length=4096, pattern=anchored(ABSOLUTE_PATH))]
    operator_key: OperatorKey | None = None  # publishing is the operator's (docs/fleet.md)
    run_id: Annotated[str, Meta(max_length=128)] | None = None  # the aggregator's run and round it
    round: Uint31 | None = None  # signed: a replay is refused


class FleetRollbackArgs(Struct, frozen=True):
    version: Uint31 | None = None  # serve this version again (0: no fleet adapter); None: drop the newest
    operator_key: OperatorKey | None = None


WANT = {"path": "the absolute path of a PEFT LoRA adapter folder on the daemon's machine"}


def fleet_publish(op: str, values: dict[str, Any]) -> FleetPublishArgs:
    args = convert(op, values, FleetPublishArgs, WANT)
    if args.run_id is not None and args.round is None:  # a signed publish names its round
        raise refusal(op, values, "round", bounds_want(FleetPublishArgs, "round"))
    return args


def fleet_rollback(op: str, values: dict[str, Any]) -> FleetRollbackArgs:
    return convert(op, values, FleetRollbackArgs, WANT)


# Adapter tensors on the wire: name -> {"dtype": "float32", "shape": [..], "data": raw
# little-endian bytes (msgpack bin)}; names are PEFT state-dict keys.
MAX_TENSORS = 4096
MAX_TENSOR_NAME_CHARS = 256
TENSOR_DTYPES = {"float32": 4}
TensorName = Annotated[str, Meta(min_length=1, max_length=MAX_TENSOR_NAME_CHARS)]


class WireTensor(Struct, frozen=True, forbid_unknown_fields=True):
    dtype: Literal["float32"]
    shape: Annotated[tuple[Annotated[int, Meta(ge=0, lt=2**31)], ...], Meta(min_length=1, max_length=4)]
    data: bytes


class FleetLoraConfig(Struct, frozen=True):
    r: Annotated[int, Meta(ge=1, le=4096)]
    lora_alpha: Annotated[float, Meta(gt=0.0, le=1.7976931348623157e308)]  # finite
    target_modules: Annotated[tuple[Annotated[str, Meta(min_length=1, max_length=64)], ...],
                              Meta(min_length=1, max_length=16)]


class FleetRoundConfig(Struct, frozen=True):
    steps: Annotated[int, Meta(ge=1, le=10_000)] = 1  # optimizer steps, each over all of the round's examples
    lr: Annotated[float, Meta(gt=0.0, le=1.0)] = 5e-4
    beta: Annotated[float, Meta(gt=0.0, le=100.0)] = 0.1
    clip: Annotated[float, Meta(gt=0.0, le=1e6)] = 1.0  # L2 bound C of the whole delta
    noise_multiplier: Annotated[float, Meta(ge=0.0, le=1e6)] = 0.0  # sigma: the noise's std is sigma * C
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] = 0  # the order examples are drawn in (never the noise)
    max_pairs: Annotated[int, Meta(ge=1, le=1_000_000)] = 64  # training examples per round at most
    heldout_fraction: Annotated[float, Meta(ge=0.0, le=0.95)] = 0.2  # of the train split, by example id


class _EvaluateConfig(Struct, frozen=True):
    heldout_fraction: Annotated[float, Meta(ge=0.0, le=0.95)] | None = None  # None: the daemon's setting
    max_pairs: Annotated[int, Meta(ge=1, le=1_000_000)] | None = None


Tensors = Annotated[dict[Any, Any], Meta(min_length=1, max_length=MAX_TENSORS)]  # each checked by _tensors


class FleetRoundArgs(Struct, frozen=True):
    round: Uint31
    adapter: Tensors
    lora_config: FleetLoraConfig
    config: FleetRoundConfig = FleetRoundConfig()


class FleetEvaluateArgs(Struct, frozen=True):
    adapter: Tensors
    lora_config: FleetLoraConfig
    heldout_fraction: float | None = None  # None: the daemon's fleet.heldout_fraction
    max_pairs: int | None = None


ROUND_WANT = {
    "adapter": (f"a map of at most {MAX_TENSORS} PEFT tensor names to {{'dtype': 'float32', 'shape': [ints], "
                "'data': raw little-endian bytes (msgpack bin) of that shape}"),
    "lora_config": "{'r': int >= 1, 'lora_alpha': number > 0, 'target_modules': [projection names]}",
}
_ROUND_CONFIG_FIELDS = frozenset(FleetRoundConfig.__struct_fields__)


def _tensors(op: str, values: dict[str, Any]) -> dict[str, WireTensor]:
    out: dict[str, WireTensor] = {}
    for key, spec in values["adapter"].items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_TENSOR_NAME_CHARS or not isinstance(spec, dict) \
                or set(spec) != {"dtype", "shape", "data"}:
            raise refusal(op, values, "adapter", ROUND_WANT["adapter"])
        param = f"adapter.{key[:80]}"
        try:
            tensor = msgspec.convert(spec, WireTensor, builtin_types=(bytes,))  # no base64 text for bytes
        except msgspec.ValidationError:
            raise ProtocolError("bad_request", f"{op}: tensor {key[:80]!r} must be {{'dtype': 'float32', "
                                "'shape': [1-4 ints], 'data': bytes}", param=param) from None
        count, width = math.prod(tensor.shape), TENSOR_DTYPES[tensor.dtype]
        if len(tensor.data) != count * width:
            raise ProtocolError("bad_request", f"{op}: tensor {key[:80]!r} has {len(tensor.data)} bytes of data; shape "
                                f"{list(tensor.shape)} in {tensor.dtype} needs {count * width}", param=param)
        out[key] = tensor
    return out


def _lora_config(op: str, values: dict[str, Any]) -> None:
    """The LoRA shape may carry a few more of PEFT's keys (ignored), not many."""
    if len(values["lora_config"]) > 8:
        raise refusal(op, values, "lora_config", ROUND_WANT["lora_config"])


def _without_config(values: dict[str, Any]) -> dict[str, Any]:
    """The op's fields but `config`, which is checked first, as its own map."""
    return {k: v for k, v in values.items() if k != "config"}


def fleet_round(op: str, values: dict[str, Any]) -> FleetRoundArgs:
    value = values.get("config") or {}
    if not isinstance(value, dict):
        raise refusal(op, values, "config", "a map of round settings (steps, lr, beta, clip, noise_multiplier, "
                      "seed, max_pairs, heldout_fraction)")
    unknown = sorted(str(k)[:64] for k in value if k not in _ROUND_CONFIG_FIELDS)
    if unknown:
        raise ProtocolError("bad_request", f"fleet.round: 'config' has no field(s) {', '.join(unknown)}; allowed: "
                            f"{', '.join(sorted(_ROUND_CONFIG_FIELDS))}", param="config")
    try:
        config = convert("fleet.round config", value, FleetRoundConfig, {})
    except ProtocolError as exc:
        raise ProtocolError("bad_request", exc.message, param=f"config.{exc.param}") from None
    args = convert(op, _without_config(values), FleetRoundArgs, ROUND_WANT)
    _lora_config(op, values)
    return msgspec.structs.replace(args, adapter=_tensors(op, values), config=config)


def fleet_evaluate(op: str, values: dict[str, Any]) -> FleetEvaluateArgs:
    value = values.get("config") or {}
    if not isinstance(value, dict) or not set(value) <= {"heldout_fraction", "max_pairs"}:
        raise refusal(op, values, "config", "a map with 'heldout_fraction' and/or 'max_pairs'")
    config = convert("fleet.evaluate config", value, _EvaluateConfig, {})
    args = convert(op, _without_config(values), FleetEvaluateArgs, ROUND_WANT)
    _lora_config(op, values)
    return msgspec.structs.replace(args, adapter=_tensors(op, values), heldout_fraction=config.heldout_fraction, max_pairs=config.max_pairs)
