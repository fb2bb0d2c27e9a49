"""The fleet ops' arguments (fleet.publish, fleet.rollback, fleet.round, fleet.evaluate): adapter
tensors as they travel, the LoRA shape, a round's settings, and their validation.

Pure standard library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from daemon.wire.errors import ProtocolError
from daemon.wire.fields import ABSOLUTE_PATH, Fields


@dataclass(frozen=True)
class FleetPublishArgs:
    path: str  # an absolute path, on the daemon's machine, of a PEFT LoRA adapter folder
    operator_key: str | None = None  # publishing is the operator's (docs/fleet.md)
    run_id: str | None = None  # the aggregator's run and round it signed: a replay is refused
    round: int | None = None


@dataclass(frozen=True)
class FleetRollbackArgs:
    version: int | None = None  # serve this version again (0: no fleet adapter); None: drop the newest
    operator_key: str | None = None


def fleet_publish(f: Fields) -> FleetPublishArgs:
    path = f.text("path", max_chars=4096, required=True, pattern=ABSOLUTE_PATH,
                  what="the absolute path of a PEFT LoRA adapter folder on the daemon's machine")
    assert path is not None
    run_id = f.text("run_id", max_chars=128)
    round_number = f.integer("round", lo=0, hi=2**31 - 1, required=run_id is not None)
    return FleetPublishArgs(path, f.text("operator_key", max_chars=256), run_id, round_number)


def fleet_rollback(f: Fields) -> FleetRollbackArgs:
    return FleetRollbackArgs(f.integer("version", lo=0, hi=2**31 - 1), f.text("operator_key", max_chars=256))


# Adapter tensors on the wire: name -> {"dtype": "float32", "shape": [..], "data": raw
# little-endian bytes (msgpack bin)}; names are PEFT state-dict keys.
MAX_TENSORS = 4096
MAX_TENSOR_NAME_CHARS = 256
TENSOR_DTYPES = {"float32": 4}


@dataclass(frozen=True)
class WireTensor:
    dtype: str
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True)
class FleetLoraConfig:
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]


@dataclass(frozen=True)
class FleetRoundConfig:
    steps: int = 1  # optimizer steps, each over all of the round's training examples
    lr: float = 5e-4
    beta: float = 0.1
    clip: float = 1.0  # L2 bound C of the whole delta
    noise_multiplier: float = 0.0  # sigma: the noise's std is sigma * C
    seed: int = 0  # the order examples are drawn in (never the noise: the server knows it)
    max_pairs: int = 64  # training examples per round at most
    heldout_fraction: float = 0.2  # share of the train split kept for evaluation, by example id


@dataclass(frozen=True)
class FleetRoundArgs:
    round: int
    adapter: dict[str, WireTensor]
    lora_config: FleetLoraConfig
    config: FleetRoundConfig


@dataclass(frozen=True)
class FleetEvaluateArgs:
    adapter: dict[str, WireTensor]
    lora_config: FleetLoraConfig
    heldout_fraction: float | None = None  # None: the daemon's fleet.heldout_fraction
    max_pairs: int | None = None


def _parse_tensors(f: Fields, name: str) -> dict[str, WireTensor]:
    value = f.values.get(name)
    want = (f"a map of at most {MAX_TENSORS} PEFT tensor names to {{'dtype': 'float32', 'shape': [ints], "
            "'data': raw little-endian bytes (msgpack bin) of that shape}")
    if not isinstance(value, dict) or not 0 < len(value) <= MAX_TENSORS:
        raise f._fail(name, want)
    out: dict[str, WireTensor] = {}
    for key, spec in value.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_TENSOR_NAME_CHARS or not isinstance(spec, dict) \
                or set(spec) != {"dtype", "shape", "data"}:
            raise f._fail(name, want)
        dtype, shape, data = spec["dtype"], spec["shape"], spec["data"]
        if (dtype not in TENSOR_DTYPES or not isinstance(shape, list) or not 1 <= len(shape) <= 4
                or any(not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < 2**31 for n in shape)
                or not isinstance(data, bytes)):
            raise ProtocolError("bad_request", f"{f.op}: tensor {key[:80]!r} must be {{'dtype': 'float32', "
                                "'shape': [1-4 ints], 'data': bytes}", param=f"{name}.{key[:80]}")
        count = math.prod(shape)
        if len(data) != count * TENSOR_DTYPES[dtype]:
            raise ProtocolError("bad_request", f"{f.op}: tensor {key[:80]!r} has {len(data)} bytes of data; shape "
                                f"{shape} in {dtype} needs {count * TENSOR_DTYPES[dtype]}", param=f"{name}.{key[:80]}")
        out[key] = WireTensor(dtype, tuple(shape), data)
    return out


def _parse_lora_config(f: Fields) -> FleetLoraConfig:
    value = f.values.get("lora_config")
    want = "{'r': int >= 1, 'lora_alpha': number > 0, 'target_modules': [projection names]}"
    if not isinstance(value, dict) or not {"r", "lora_alpha", "target_modules"} <= set(value) or len(value) > 8:
        raise f._fail("lora_config", want)
    rank, alpha, targets = value["r"], value["lora_alpha"], value["target_modules"]
    ok = (isinstance(rank, int) and not isinstance(rank, bool) and 1 <= rank <= 4096
          and isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and math.isfinite(alpha) and alpha > 0
          and isinstance(targets, list) and 0 < len(targets) <= 16
          and all(isinstance(t, str) and 0 < len(t) <= 64 for t in targets))
    if not ok:
        raise f._fail("lora_config", want)
    return FleetLoraConfig(rank, float(alpha), tuple(targets))


def fleet_round(f: Fields) -> FleetRoundArgs:
    value = f.values.get("config") or {}
    if not isinstance(value, dict):
        raise f._fail("config", "a map of round settings (steps, lr, beta, clip, noise_multiplier, seed, "
                      "max_pairs, heldout_fraction)")
    unknown = sorted(str(k)[:64] for k in value if k not in _ROUND_CONFIG_FIELDS)
    if unknown:
        raise ProtocolError("bad_request", f"fleet.round: 'config' has no field(s) {', '.join(unknown)}; allowed: "
                            f"{', '.join(sorted(_ROUND_CONFIG_FIELDS))}", param="config")
    c = Fields("fleet.round config", value)
    d = FleetRoundConfig()
    try:
        config = _round_config(c, d)
    except ProtocolError as exc:
        raise ProtocolError("bad_request", exc.message, param=f"config.{exc.param}") from None
    round_number = f.integer("round", lo=0, hi=2**31 - 1, required=True)
    assert round_number is not None
    return FleetRoundArgs(round_number, _parse_tensors(f, "adapter"), _parse_lora_config(f), config)


def _round_config(c: Fields, d: FleetRoundConfig) -> FleetRoundConfig:
    return FleetRoundConfig(
        steps=c.integer("steps", lo=1, hi=10_000, default=d.steps),
        lr=c.number("lr", lo=0.0, hi=1.0, default=d.lr, lo_open=True),
        beta=c.number("beta", lo=0.0, hi=100.0, default=d.beta, lo_open=True),
        clip=c.number("clip", lo=0.0, hi=1e6, default=d.clip, lo_open=True),
        noise_multiplier=c.number("noise_multiplier", lo=0.0, hi=1e6, default=d.noise_multiplier),
        seed=c.integer("seed", lo=0, hi=2**63 - 1, default=d.seed),
        max_pairs=c.integer("max_pairs", lo=1, hi=1_000_000, default=d.max_pairs),
        heldout_fraction=c.number("heldout_fraction", lo=0.0, hi=0.95, default=d.heldout_fraction),
    )


def fleet_evaluate(f: Fields) -> FleetEvaluateArgs:
    value = f.values.get("config") or {}
    if not isinstance(value, dict) or not set(value) <= {"heldout_fraction", "max_pairs"}:
        raise f._fail("config", "a map with 'heldout_fraction' and/or 'max_pairs'")
    c = Fields("fleet.evaluate config", value)
    return FleetEvaluateArgs(_parse_tensors(f, "adapter"), _parse_lora_config(f),
                             c.number("heldout_fraction", lo=0.0, hi=0.95),
                             c.integer("max_pairs", lo=1, hi=1_000_000))


_ROUND_CONFIG_FIELDS = frozenset(f.name for f in fields(FleetRoundConfig))

