"""Parse one line of NVIDIA `tegrastats` output into clean numbers, for every Jetson generation.

All of tegrastats' per-release quirks live here; nothing else in the program looks at raw lines.
Pure functions, no I/O; a token the parser does not know is kept in `extras`, never an error.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

# Sensors that print -256C have no reading on this module (e.g. CV0..CV2 on an AGX Orin
# without the DLA clusters powered, GPU while it is rail-gated).
ABSENT_SENSOR_C = -256.0

# PMIC@100C (TX1/TX2/Nano/AGX Xavier) and PMIC@50C are fixed placeholders printed by the
# BSP, not measurements: they never move, so they must not drive thermal decisions.
PLACEHOLDER_TEMP_SENSORS = frozenset({"PMIC"})

# Rails that report the whole module or board input; when one is present it is the total.
# (VIN on Thor, VDD_IN on TX1/TX2/Xavier NX/Orin NX/Nano, POM_5V_IN on the Nano.)
TOTAL_POWER_RAILS = ("VDD_IN", "POM_5V_IN", "VIN")

# Numbers are bounded in length: a mutated line with thousands of digits must fall through to
# `extras`, not hit Python's int-conversion limit.
_INT = r"\d{1,12}"
_NUM = r"-?\d{1,12}(?:\.\d{1,12})?"

_TIMESTAMP = re.compile(r"(\d{2})-(\d{2})-(\d{4}) (\d{2}):(\d{2}):(\d{2})\b")
_RAM = re.compile(
    rf"RAM ({_INT})/({_INT})MB(?:\s*\(lfb ({_INT})x({_INT})(MB|kB)\))?(?=\s|$)"
)
_SWAP = re.compile(rf"SWAP ({_INT})/({_INT})MB(?:\s*\(cached ({_INT})MB\))?(?=\s|$)")
_IRAM = re.compile(rf"IRAM ({_INT})/({_INT})kB\s*(?:\(lfb ({_INT})kB\))?(?=\s|$)")
# `CPU [1%@102,off,...]` (all releases since L4T 28.2) and the older `cpu [1%,0%,off]@1734`
# (TX1/TX2 on L4T 28.1) where one frequency follows the bracket.
_CPU = re.compile(rf"(?i:CPU) \[([^\]]{{0,2000}})\](?:@({_INT}))?(?=\s|$)")
_CPU_CORE = re.compile(rf"({_INT})%(?:@({_INT}))?")
_MTS = re.compile(rf"MTS fg ({_INT})% bg ({_INT})%(?=\s|$)")
# `CPU@37.5C`, `tj@-256C`, and from L4T R39 on `cpu@50.718C/50.718C` (current/max).
_TEMP = re.compile(rf"([A-Za-z][A-Za-z0-9_]{{0,40}})@({_NUM})C(?:/({_NUM})C)?(?=\s|$)")
# Power rails: `POM_5V_IN 2545/2547` (mW, no unit: L4T 28-32), `VDD_IN 4143mW/4143mW`
# (L4T 34-38) and `VDD_IN 3462mW/3522mW/3582mW` (current/avg/max, L4T R39).
_UNIT = r"(mW|W)?"
_POWER = re.compile(
    rf"([A-Z][A-Z0-9_]{{0,40}}) ({_NUM}){_UNIT}/({_NUM}){_UNIT}(?:/({_NUM}){_UNIT})?(?=\s|$)"
)
# Engines and clocks: `EMC_FREQ 0%`, `GR3D_FREQ 0%@76`, `GR3D_FREQ 0%@[0,0]`,
# `GR3D_FREQ @[314,314,314]` (Thor: no utilisation at all), `NVENC 79%@166`, `NVDEC off`,
# `APE 25` / `NVJPG1 729` (frequency only), `NVENC0_FREQ @1556`.
_ENGINE = re.compile(
    rf"([A-Z][A-Z0-9_]{{0,40}}) (?:(off)|({_INT})%(?:@(?:({_INT})|\[([^\]]{{0,200}})\]))?"
    rf"|@(?:({_INT})|\[([^\]]{{0,200}})\])|({_INT}))(?=\s|$)"
)
_TOKEN = re.compile(r"\S+")
_GPU_ENGINE = re.compile(r"GR3D\d*")


@dataclass
class EngineStat:
    """One hardware engine or clock domain (EMC, GR3D, NVENC, VIC, APE, ...)."""

    util_pct: float | None = None
    freq_mhz: list[int | None] | None = None  # one entry per cluster/GPC; None where "off"
    on: bool = True


@dataclass
class TegrastatsSample:
    """Everything one tegrastats line says, in MB / percent / MHz / degrees C / mW.

    A field is None when the line does not print it; never 0 for "not reported" (Thor prints
    no GPU utilisation, which is `gpu_util_pct=None`, not an idle GPU).
    """

    timestamp: str | None = None  # "MM-DD-YYYY HH:MM:SS" as printed (L4T 35 onwards)
    ram_used_mb: int | None = None
    ram_total_mb: int | None = None
    lfb_blocks: int | None = None  # `lfb NxZMB`: N free blocks of Z MB (largest free block)
    lfb_block_mb: float | None = None
    swap_used_mb: int | None = None
    swap_total_mb: int | None = None
    swap_cached_mb: int | None = None
    iram_used_kb: int | None = None
    iram_total_kb: int | None = None
    iram_lfb_kb: int | None = None
    cpu_util_pct: list[float | None] | None = None  # None for a core that is `off`
    cpu_freq_mhz: list[int | None] | None = None
    emc_util_pct: float | None = None
    emc_freq_mhz: int | None = None
    gpu_util_pct: float | None = None
    gpu_freq_mhz: list[int | None] | None = None  # per GPC where the line lists them
    mts_fg_pct: float | None = None
    mts_bg_pct: float | None = None
    engines: dict[str, EngineStat] = field(default_factory=dict)
    temps_c: dict[str, float] = field(default_factory=dict)  # current value per sensor
    temps_max_c: dict[str, float] = field(default_factory=dict)  # L4T R39 current/max pairs
    absent_temp_sensors: list[str] = field(default_factory=list)  # printed as -256C
    power_mw: dict[str, int] = field(default_factory=dict)  # current value per rail
    power_avg_mw: dict[str, int] = field(default_factory=dict)
    power_max_mw: dict[str, int] = field(default_factory=dict)  # L4T R39 triples
    extras: dict[str, str] = field(default_factory=dict)  # tokens this parser does not know

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; empty collections become None so "absent" reads as null."""
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, (dict, list)) and not value:
                out[key] = None
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TegrastatsSample:
        """Inverse of `to_dict`; unknown keys are ignored so newer files still load."""
        known = set(cls.__dataclass_fields__)
        kwargs = {k: v for k, v in data.items() if k in known}
        for key in ("engines", "temps_c", "temps_max_c", "power_mw", "power_avg_mw",
                    "power_max_mw", "extras"):
            kwargs[key] = dict(kwargs.get(key) or {})
        kwargs["absent_temp_sensors"] = list(kwargs.get("absent_temp_sensors") or [])
        kwargs["engines"] = {
            name: e if isinstance(e, EngineStat) else EngineStat(**e)
            for name, e in kwargs["engines"].items()
        }
        return cls(**kwargs)

    def timestamp_s(self) -> float | None:
        """Seconds since the epoch of the printed wall-clock time (naive local time)."""
        if self.timestamp is None:
            return None
        try:
            return datetime.strptime(self.timestamp, "%m-%d-%Y %H:%M:%S").timestamp()
        except ValueError:
            return None

    def max_temp_c(self) -> float | None:
        """Hottest real sensor, ignoring absent (-256C) and placeholder (PMIC) sensors."""
        real = [t for name, t in self.temps_c.items()
                if name.upper() not in PLACEHOLDER_TEMP_SENSORS]
        return max(real) if real else None

    def total_power_mw(self) -> int | None:
        """Module input power: the board-input rail where printed, else the sum of rails."""
        for rail in TOTAL_POWER_RAILS:
            if rail in self.power_mw:
                return self.power_mw[rail]
        # AGX Orin/Thor/AGX Xavier print no input rail; their rails together feed the module.
        # `NC` rails are unconnected INA3221 channels.
        rails = [mw for name, mw in self.power_mw.items() if not name.startswith("NC")]
        return sum(rails) if rails else None


def parse_line(line: str) -> TegrastatsSample:
    """Parse one tegrastats line. Never raises; unknown tokens land in `sample.extras`."""
    sample = TegrastatsSample()
    text = line.strip()
    pos = 0
    match = _TIMESTAMP.match(text)
    if match:
        sample.timestamp = match.group(0)
        pos = match.end()
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            break
        pos = _parse_field(text, pos, sample)
    _derive_gpu(sample)
    return sample


def _parse_field(text: str, pos: int, s: TegrastatsSample) -> int:
    """Consume one field at `pos` into `s`; returns the position after it."""
    if m := _RAM.match(text, pos):
        s.ram_used_mb, s.ram_total_mb = int(m[1]), int(m[2])
        if m[3] is not None:
            s.lfb_blocks = int(m[3])
            s.lfb_block_mb = int(m[4]) / (1024 if m[5] == "kB" else 1)
        return m.end()
    if m := _SWAP.match(text, pos):
        s.swap_used_mb, s.swap_total_mb = int(m[1]), int(m[2])
        s.swap_cached_mb = int(m[3]) if m[3] is not None else None
        return m.end()
    if m := _IRAM.match(text, pos):
        s.iram_used_kb, s.iram_total_kb = int(m[1]), int(m[2])
        s.iram_lfb_kb = int(m[3]) if m[3] is not None else None
        return m.end()
    if m := _CPU.match(text, pos):
        _parse_cpus(m[1], m[2], s)
        return m.end()
    if m := _MTS.match(text, pos):
        s.mts_fg_pct, s.mts_bg_pct = float(m[1]), float(m[2])
        return m.end()
    if m := _TEMP.match(text, pos):
        _put_temp(m, s)
        return m.end()
    if m := _POWER.match(text, pos):
        _put_power(m, s)
        return m.end()
    if m := _ENGINE.match(text, pos):
        _put_engine(m, s)
        return m.end()
    token = _TOKEN.match(text, pos)
    assert token is not None  # pos sits on a non-space character
    _put_unique(s.extras, token.group(0), "")
    return token.end()


def _parse_cpus(body: str, shared_freq: str | None, s: TegrastatsSample) -> None:
    utils: list[float | None] = []
    freqs: list[int | None] = []
    for item in body.split(","):
        item = item.strip()
        core = _CPU_CORE.fullmatch(item)
        if core is None:  # `off` (core powered down) or something unreadable
            if item != "off":
                _put_unique(s.extras, f"CPU[{item}]", "")
            utils.append(None)
            freqs.append(None)
            continue
        utils.append(float(core[1]))
        freq = core[2] or shared_freq
        freqs.append(int(freq) if freq is not None else None)
    s.cpu_util_pct, s.cpu_freq_mhz = utils, freqs


def _put_temp(m: re.Match[str], s: TegrastatsSample) -> None:
    name, current = m[1], float(m[2])
    if current <= ABSENT_SENSOR_C:
        s.absent_temp_sensors.append(name)
        return
    key = _put_unique(s.temps_c, name, current)
    if m[3] is not None:
        s.temps_max_c[key] = float(m[3])


def _to_mw(value: str, unit: str | None) -> int:
    return round(float(value) * (1000 if unit == "W" else 1))


def _put_power(m: re.Match[str], s: TegrastatsSample) -> None:
    key = _put_unique(s.power_mw, m[1], _to_mw(m[2], m[3]))
    s.power_avg_mw[key] = _to_mw(m[4], m[5])
    if m[6] is not None:  # L4T R39 appends the maximum
        s.power_max_mw[key] = _to_mw(m[6], m[7])


def _freq_list(single: str | None, listed: str | None) -> list[int | None] | None:
    if single is not None:
        return [int(single)]
    if listed is None:
        return None
    out: list[int | None] = []
    for item in listed.split(","):
        item = item.strip()
        out.append(int(item) if item.isdigit() and len(item) <= 12 else None)
    return out


def _put_engine(m: re.Match[str], s: TegrastatsSample) -> None:
    raw_name = m[1]
    name = raw_name[: -len("_FREQ")] if raw_name.endswith("_FREQ") else raw_name
    if m[2] is not None:
        stat = EngineStat(on=False)
    elif m[3] is not None:
        stat = EngineStat(util_pct=float(m[3]), freq_mhz=_freq_list(m[4], m[5]))
    elif m[8] is not None:  # a bare number is a clock in MHz (`APE 25`, `NVDEC 716`)
        stat = EngineStat(freq_mhz=[int(m[8])])
    else:
        stat = EngineStat(freq_mhz=_freq_list(m[6], m[7]))
    if name == "EMC":
        s.emc_util_pct = stat.util_pct
        s.emc_freq_mhz = stat.freq_mhz[0] if stat.freq_mhz else None
    _put_unique(s.engines, name, stat)


def _derive_gpu(s: TegrastatsSample) -> None:
    # The iGPU is GR3D; AGX Orin on L4T 35 prints its second GPC as GR3D2_FREQ. Utilisation is
    # the busiest GPC (tegrastats' own bracket form aggregates GPCs the same way).
    gpcs = [e for name, e in s.engines.items() if _GPU_ENGINE.fullmatch(name)]
    utils = [e.util_pct for e in gpcs if e.util_pct is not None]
    s.gpu_util_pct = max(utils) if utils else None
    freqs = [f for e in gpcs for f in (e.freq_mhz or [])]
    s.gpu_freq_mhz = freqs or None


def _put_unique(target: dict[str, Any], name: str, value: Any) -> str:
    """Insert under `name`, or `name#2`, `name#3`... when the line repeats a name (`NC` rails)."""
    key, n = name, 1
    while key in target:
        n += 1
        key = f"{name}#{n}"
    target[key] = value
    return key
