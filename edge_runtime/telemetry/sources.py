"""Telemetry sources behind one interface: async iteration of `TelemetryReading`s.

tegrastats subprocess (restarted when it dies), jtop (optional), psutil (+ NVML when present)
and a replay of a recorded file. None of them imports torch.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import psutil

from edge_runtime.telemetry.reading import TelemetryReading, reading_from_sample
from edge_runtime.telemetry.tegrastats import TegrastatsSample, parse_line

log = logging.getLogger(__name__)

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


class TelemetryUnavailable(RuntimeError):
    """The chosen source cannot run here (binary missing, module not installed, no service)."""


class TelemetrySource(abc.ABC):
    """Yields readings forever (or until a replay ends); `async for r in source: ...`."""

    name: str = "abstract"

    @abc.abstractmethod
    def readings(self) -> AsyncIterator[TelemetryReading]:
        """An async generator of readings; closing it releases the source's resources."""

    def __aiter__(self) -> AsyncIterator[TelemetryReading]:
        return self.readings()


def is_jetson() -> bool:
    """True on an NVIDIA Jetson (L4T), where CPU and GPU share one DRAM."""
    return Path("/etc/nv_tegra_release").exists() or Path("/sys/module/tegra_fuse").exists()


class TegrastatsSource(TelemetrySource):
    """Runs `tegrastats --interval N` as a child process and parses each line it prints.

    When tegrastats exits (killed, crashed, BSP update) it is started again after a backoff
    that doubles while it keeps dying without printing and resets once it prints a line.
    """

    name = "tegrastats"

    def __init__(
        self,
        interval_s: float = 1.0,
        executable: str = "tegrastats",
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.executable = executable
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.clock = clock
        self.starts = 0  # processes started so far; > 1 means it was restarted

    async def readings(self) -> AsyncIterator[TelemetryReading]:
        backoff = self.backoff_s
        while True:
            proc = await self._spawn()
            printed = False
            try:
                assert proc.stdout is not None
                async for raw in proc.stdout:
                    line = raw.decode("utf-8", errors="replace").strip()
                    if not line:
                        continue
                    printed = True
                    yield reading_from_sample(parse_line(line), self.clock(), self.name)
                code = await proc.wait()
            finally:
                await _stop(proc)
            backoff = self.backoff_s if printed else min(backoff * 2, self.max_backoff_s)
            log.warning("tegrastats exited with status %s; restarting in %.2f s", code, backoff)
            await asyncio.sleep(backoff)

    async def _spawn(self) -> asyncio.subprocess.Process:
        interval_ms = str(max(1, round(self.interval_s * 1000)))
        try:
            proc = await asyncio.create_subprocess_exec(
                self.executable,
                "--interval",
                interval_ms,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
            )
        except FileNotFoundError as exc:
            raise TelemetryUnavailable(
                f"'{self.executable}' not found on PATH; is this a Jetson? "
                "Set telemetry source to 'psutil' elsewhere."
            ) from exc
        self.starts += 1
        return proc


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), timeout=2.0)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()


class ReplaySource(TelemetrySource):
    """Plays a recorded file at real or accelerated speed (tests, demos, `--telemetry-replay`).

    The file holds raw tegrastats lines, JSON lines from `python -m edge_runtime.telemetry
    parse`, or fixture records with a `line` key. Blank lines and `#` comments are skipped.
    Gaps follow the printed timestamps where present, else `interval_s`; `speed` divides them
    and `speed <= 0` plays without waiting.
    """

    name = "replay"

    def __init__(
        self,
        path: str | Path,
        speed: float = 1.0,
        interval_s: float = 1.0,
        loop: bool = False,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.path = Path(path)
        self.speed = speed
        self.interval_s = interval_s
        self.loop = loop
        self.clock = clock
        self.sleep = sleep

    async def readings(self) -> AsyncIterator[TelemetryReading]:
        samples = load_trace(self.path)
        if not samples:
            raise TelemetryUnavailable(f"{self.path} holds no tegrastats samples")
        previous: TegrastatsSample | None = None
        while True:
            for sample in samples:
                if previous is not None and self.speed > 0:
                    await self.sleep(self._gap_s(previous, sample) / self.speed)
                previous = sample
                yield reading_from_sample(sample, self.clock(), self.name)
            if not self.loop:
                return

    def _gap_s(self, before: TegrastatsSample, after: TegrastatsSample) -> float:
        t0, t1 = before.timestamp_s(), after.timestamp_s()
        if t0 is None or t1 is None:
            return self.interval_s
        # Timestamps have 1 s resolution and may jump (clock set, log concatenation).
        return min(max(t1 - t0, 0.0), 60.0) or self.interval_s


def load_trace(path: str | Path) -> list[TegrastatsSample]:
    """Read a recorded trace (raw lines, our JSON output, or fixture records)."""
    samples = []
    for text in Path(path).read_text().splitlines():
        text = text.strip()
        if not text or text.startswith("#"):
            continue
        if text.startswith("{"):
            record = json.loads(text)
            if "line" in record:
                samples.append(parse_line(record["line"]))
            else:
                samples.append(TegrastatsSample.from_dict(record))
        else:
            samples.append(parse_line(text))
    return samples


class PsutilSource(TelemetrySource):
    """Laptops, servers and discrete-GPU boxes: psutil for the host, NVML when importable."""

    name = "psutil"

    def __init__(
        self,
        interval_s: float = 1.0,
        use_nvml: bool = True,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.sleep = sleep
        self.unified = is_jetson()
        self.nvml = _Nvml.open() if use_nvml else None

    async def readings(self) -> AsyncIterator[TelemetryReading]:
        psutil.cpu_percent(percpu=True)  # first call primes the counters and returns zeros
        while True:
            yield self.read_once()
            await self.sleep(self.interval_s)

    def read_once(self) -> TelemetryReading:
        vm = psutil.virtual_memory()
        swap = psutil.swap_memory()
        temps = _psutil_temps()
        gpu: dict[str, Any] = self.nvml.read() if self.nvml is not None else {}
        if "temp_c" in gpu:
            temps["nvml_gpu"] = gpu["temp_c"]
        power = {"nvml_gpu": gpu["power_mw"]} if "power_mw" in gpu else {}
        discrete = not self.unified  # NVML's memory numbers mean nothing on unified memory
        return TelemetryReading(
            t=self.clock(),
            source=self.name,
            unified_memory=self.unified,
            ram_used_mb=(vm.total - vm.available) / 2**20,
            ram_total_mb=vm.total / 2**20,
            mem_available_mb=vm.available / 2**20,
            swap_used_mb=swap.used / 2**20,
            swap_total_mb=swap.total / 2**20,
            gpu_util_pct=gpu.get("util_pct"),
            gpu_mem_free_mb=gpu.get("mem_free_mb") if discrete else None,
            gpu_mem_total_mb=gpu.get("mem_total_mb") if discrete else None,
            max_temp_c=max(temps.values()) if temps else None,
            temps_c=temps,
            total_power_mw=power.get("nvml_gpu"),
            power_limit_mw=gpu.get("power_limit_mw"),
            power_mw=power,
        )


def _psutil_temps() -> dict[str, float]:
    read = getattr(psutil, "sensors_temperatures", None)  # absent on macOS/Windows
    if read is None:
        return {}
    temps: dict[str, float] = {}
    for chip, entries in read().items():
        for i, entry in enumerate(entries):
            if entry.current is None or entry.current <= -256:
                continue
            temps[f"{chip}/{entry.label or i}"] = float(entry.current)
    return temps


class _Nvml:
    """The first NVIDIA GPU via pynvml, if pynvml and a driver are present."""

    def __init__(self, pynvml: Any, handle: Any) -> None:
        self.pynvml = pynvml
        self.handle = handle

    @classmethod
    def open(cls) -> _Nvml | None:
        try:
            import pynvml  # optional: nvidia-ml-py
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            if pynvml.nvmlDeviceGetCount() < 1:
                return None
            return cls(pynvml, pynvml.nvmlDeviceGetHandleByIndex(0))
        except pynvml.NVMLError as exc:
            log.info("NVML present but unusable (%s); GPU figures unavailable", exc)
            return None

    def read(self) -> dict[str, float]:
        out: dict[str, float] = {}
        nv = self.pynvml
        # Each query may be unsupported on a given GPU/driver; keep the ones that answer.
        for key, query in (
            ("util_pct", lambda: nv.nvmlDeviceGetUtilizationRates(self.handle).gpu),
            ("mem_free_mb", lambda: nv.nvmlDeviceGetMemoryInfo(self.handle).free / 2**20),
            ("mem_total_mb", lambda: nv.nvmlDeviceGetMemoryInfo(self.handle).total / 2**20),
            ("temp_c", lambda: nv.nvmlDeviceGetTemperature(self.handle, nv.NVML_TEMPERATURE_GPU)),
            ("power_mw", lambda: nv.nvmlDeviceGetPowerUsage(self.handle)),
            ("power_limit_mw", lambda: nv.nvmlDeviceGetEnforcedPowerLimit(self.handle)),
        ):
            try:
                out[key] = float(query())
            except nv.NVMLError as exc:
                log.debug("NVML %s unavailable: %s", key, exc)
        return out


class JtopSource(TelemetrySource):
    """jetson-stats' jtop client (needs the root `jtop.service` and the same version)."""

    name = "jtop"

    def __init__(self, interval_s: float = 1.0, clock: Clock = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock

    async def readings(self) -> AsyncIterator[TelemetryReading]:
        try:
            from jtop import jtop  # optional: jetson-stats
        except ImportError as exc:
            raise TelemetryUnavailable("jtop (jetson-stats) is not installed") from exc
        loop = asyncio.get_running_loop()
        client = jtop(interval=self.interval_s)
        # jtop talks to its service over a socket from its own thread; its calls block.
        await loop.run_in_executor(None, client.start)
        try:
            while await loop.run_in_executor(None, client.ok):
                yield reading_from_jtop(client, self.clock())
        finally:
            await loop.run_in_executor(None, client.close)
        raise TelemetryUnavailable("jtop service stopped answering")


def reading_from_jtop(client: Any, t: float) -> TelemetryReading:
    """Map jtop 4.x properties (memory in kB, power in mW, temps in C) onto a reading."""
    memory = client.memory
    ram = memory.get("RAM", {})
    swap = memory.get("SWAP", {})
    emc = memory.get("EMC", {})
    loads = [g.get("status", {}).get("load") for g in client.gpu.values()]
    loads = [float(x) for x in loads if x is not None]
    temps = {
        name: float(v["temp"])
        for name, v in client.temperature.items()
        if v.get("online", True) and v.get("temp", -256) > -256 and name.upper() != "PMIC"
    }
    power = client.power
    rails = {name: float(v["power"]) for name, v in power.get("rail", {}).items() if "power" in v}
    total = power.get("tot", {}).get("power")
    used, tot = ram.get("used"), ram.get("tot")
    return TelemetryReading(
        t=t,
        source="jtop",
        unified_memory=True,
        ram_used_mb=used / 1024 if used is not None else None,
        ram_total_mb=tot / 1024 if tot is not None else None,
        mem_available_mb=(tot - used) / 1024 if used is not None and tot is not None else None,
        swap_used_mb=swap["used"] / 1024 if "used" in swap else None,
        swap_total_mb=swap["tot"] / 1024 if "tot" in swap else None,
        gpu_util_pct=max(loads) if loads else None,
        emc_util_pct=float(emc["val"]) if "val" in emc else None,
        max_temp_c=max(temps.values()) if temps else None,
        temps_c=temps,
        total_power_mw=float(total) if total is not None else None,
        power_mw=rails,
    )


def jtop_available() -> bool:
    """jtop importable and its service socket present (else it would fail on connect)."""
    try:
        import jtop  # noqa: F401
    except ImportError:
        return False
    return Path("/run/jtop.sock").exists()


def auto_source_name(replay_file: str | None = None) -> str:
    """Which source `auto` picks here: replay if asked, else jtop, tegrastats, psutil."""
    if replay_file:
        return "replay"
    if is_jetson() or shutil.which("tegrastats"):
        return "jtop" if jtop_available() else "tegrastats"
    return "psutil"

