"""`maced`: parse flags, load the config, set up logging, run the service and server on asyncio,
and handle signals (SIGTERM/SIGINT drain and exit 0, SIGHUP reloads) and systemd notifications.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from daemon.config import DaemonConfig

log = logging.getLogger("maced")

# Flag -> setting; every other setting is reachable with --set section.key=value.
_SHORTCUTS = {
    "model": "engine.model", "ipc": "server.ipc", "tcp": "server.tcp", "state_dir": "daemon.state_dir",
    "log_level": "daemon.log_level", "log_format": "daemon.log_format", "device": "engine.device",
    "dtype": "engine.dtype", "telemetry_replay": "telemetry.replay_file", "http": "http.bind",
}
_SYSLOG_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
                    logging.CRITICAL: 2}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="maced",
        description="MACE-edge daemon: serves an LLM to local apps over ZeroMQ and fine-tunes "
        "per-user adapters from their feedback. Settings: defaults < TOML file < MACE_* env < flags.")
    p.add_argument("--config", metavar="FILE", help="TOML config (default: $MACE_CONFIG, "
                   "$CONFIGURATION_DIRECTORY/maced.toml, /etc/mace-edge/maced.toml)")
    p.add_argument("--print-config", action="store_true",
                   help="print the effective configuration and where each value came from, then exit")
    p.add_argument("--model", help="'default', an HF model directory or a .gguf file")
    p.add_argument("--ipc", metavar="PATH", help="ipc socket path ('auto', or '' for none)")
    p.add_argument("--tcp", metavar="ENDPOINT", help="e.g. tcp://127.0.0.1:5555")
    p.add_argument("--http", metavar="HOST:PORT", help="OpenAI-compatible HTTP gateway (default "
                   "127.0.0.1:8000; '' for none; beyond loopback it needs http.api_keys)")
    p.add_argument("--state-dir", metavar="DIR")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    p.add_argument("--log-format", choices=("auto", "text", "json", "journal"))
    p.add_argument("--device", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", help="auto, float32, bfloat16, float16")
    p.add_argument("--telemetry-replay", metavar="FILE", help="replay a recorded tegrastats trace")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="any setting, e.g. --set server.max_inflight=256 (repeatable)")
    p.add_argument("--version", action="version", version="maced 0.1.0")
    return p


def flags_from(args: argparse.Namespace) -> list[tuple[str, Any, str]]:
    from daemon.config import ConfigError

    flags: list[tuple[str, Any, str]] = []
    for attr, name in _SHORTCUTS.items():
        value = getattr(args, attr)
        if value is not None:
            flags.append((name, value, "--" + attr.replace("_", "-")))
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE")
        flags.append((key.strip(), value, f"--set {key.strip()}"))
    return flags


# -- logging ------------------------------------------------------------------------------------


class _JournalFormatter(logging.Formatter):
    """journald reads a `<N>` syslog priority prefix on each stderr line and adds its own time."""

    def format(self, record: logging.LogRecord) -> str:
        prio = _SYSLOG_PRIORITY.get(record.levelno, 6)
        text = f"<{prio}>{record.name}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info).replace("\n", f"\n<{prio}>")
        return text


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 6), "level": record.levelname.lower(),
                 "logger": record.name, "msg": record.getMessage(), "pid": record.process}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def _under_journal() -> bool:
    stream = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return stream == f"{st.st_dev}:{st.st_ino}"


def setup_logging(config: DaemonConfig) -> None:
    fmt = config.daemon.log_format
    if fmt == "auto":
        fmt = "journal" if _under_journal() else "text"
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "journal":
        handler.setFormatter(_JournalFormatter())
    elif fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(config.daemon.log_level.upper())


# -- running ------------------------------------------------------------------------------------


async def run(config: DaemonConfig, reload_config: Any = None) -> int:
    """The daemon's whole life; returns the exit status."""
    import zmq.asyncio

    from daemon.config import ConfigError, reload_changes
    from daemon.fronts.zmq_server import Server
    from daemon.sdnotify import Notifier, Watchdog, watchdog_interval_s
    from daemon.service import Service

    loop = asyncio.get_running_loop()
    notifier = Notifier()
    watchdog = Watchdog(notifier, watchdog_interval_s())
    context = zmq.asyncio.Context()
    service = Service(config, notifier=notifier, watchdog=watchdog)
    server = Server(config, service, context)
    try:
        endpoints = server.bind()
    except (OSError, ValueError, zmq.ZMQError) as exc:
        log.error("cannot listen: %s", exc)
        notifier.status(f"cannot listen: {exc}")
        context.destroy(linger=0)
        return 1
    gateway = None
    if config.http_address is not None:
        from daemon.fronts.http import HttpGateway

        gateway = HttpGateway(config, service)
        try:
            http_endpoint = gateway.bind()
        except OSError as exc:
            log.error("cannot listen on HTTP %s: %s", config.http.bind, exc)
            notifier.status(f"cannot listen on HTTP {config.http.bind}: {exc}")
            await server.close()
            context.destroy(linger=0)
            return 1
        service.http = gateway
        endpoints.append(http_endpoint + "/v1")
    log.info("listening on %s (protocol v1); loading model %s", ", ".join(endpoints),
             config.engine.model or "default")
    serving = asyncio.create_task(server.serve(), name="server")
    if gateway is not None:
        gateway.start()  # same event loop; uvicorn's own signal handling is off

    stop = asyncio.Event()
    stop_signal: list[str] = []

    def on_stop(name: str) -> None:
        if not stop_signal:
            log.info("%s received: shutting down", name)
        stop_signal.append(name)
        stop.set()

    def on_reload() -> None:
        if reload_config is None:
            return
        try:
            new = reload_config()
        except ConfigError as exc:
            log.error("SIGHUP: config not reloaded: %s", exc)
            return
        notifier.reloading()
        applied, restart = reload_changes(service.config, new)
        service.reload(new)
        server.config = new
        logging.getLogger().setLevel(new.daemon.log_level.upper())
        log.info("SIGHUP: reloaded %s%s", ", ".join(applied) or "nothing changed",
                 f"; needs a restart to change: {', '.join(restart)}" if restart else "")
        notifier.send("READY=1", f"STATUS={service.status_line()}")

    for sig, name in ((signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")):
        loop.add_signal_handler(sig, on_stop, name)
    loop.add_signal_handler(signal.SIGHUP, on_reload)

    started = time.monotonic()
    starting = asyncio.create_task(service.start(), name="start")
    stopping = asyncio.create_task(stop.wait())
    fatal = asyncio.create_task(service.fatal.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if starting.done() and starting.exception() is not None:
        exc = starting.exception()
        what = "the model could not be loaded" if service.state == "failed" else "start-up failed"
        log.error("%s: %s", what, exc)
        notifier.status(f"{what}: {exc}")
        code = 1
    elif starting.done():
        log.info("serving %s on %s (ready in %.1f s)", service.model_name, ", ".join(endpoints),
                 time.monotonic() - started)
        notifier.ready(f"serving {service.model_name} on {', '.join(endpoints)}")
        from edge_runtime.backends import ort_prefetch

        ort_prefetch.stop()  # a session the engine did not ask for is freed
        # The loaded model's millions of objects live as long as the process: out of the cyclic
        # collector's reach, a flood of short-lived connections no longer triggers full
        # collections that scan them all (pauses of ~1 s under tools/attack_idle.py).
        gc.freeze()
        await asyncio.wait({stopping, fatal}, return_when=asyncio.FIRST_COMPLETED)
        if service.fatal.is_set():
            code = 1
    else:
        starting.cancel()
    t0 = time.monotonic()
    await service.shutdown()
    if gateway is not None:
        await gateway.close()
    await server.close()
    serving.cancel()
    for task in (serving, stopping, fatal, starting):
        task.cancel()
    await asyncio.gather(serving, stopping, fatal, starting, return_exceptions=True)
    context.destroy(linger=1000)
    log.info("exited in %.2f s after %s (status %d)", time.monotonic() - t0,
             stop_signal[0] if stop_signal else "engine failure", code)
    notifier.close()
    return code


def import_serving_modules() -> None:
    """Import what serving needs (torch, the config, the service and both fronts) with the cyclic
    collector off, then freeze what the imports made. Those millions of objects live as long as
    the process, and the collector scanned them again at each of its full collections during the
    imports: ~15% of their CPU time (0.7-1.4 s of ~5 at load ~11). What is frozen is never
    scanned again (the engine's load then collects only its own objects)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        import daemon.config  # noqa: F401 - torch, the runtime's config and the fine-tuning terms
        import daemon.fronts.http  # noqa: F401 - the OpenAI gateway (starlette, uvicorn)
        import daemon.fronts.zmq_server  # noqa: F401
        import daemon.service  # noqa: F401 - the engine and everything it loads with
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from edge_runtime.backends import ort_prefetch

    # ONNX Runtime releases the GIL while it opens a session (pre-packing ~2.5 s of CPU at 1B):
    # the last start's session opens on a second core during the imports and the model's load.
    if not args.print_config:
        ort_prefetch.start_early(args.model, args.set, os.environ)
    import_serving_modules()
    from daemon.config import ConfigError, load_config
    from daemon.principals import load_identities
    from daemon.privacy import StartRefused, check_start
    from edge_runtime.paths import make_private

    try:
        flags = flags_from(args)
        config = load_config(args.config, os.environ, flags)
        load_identities(config)  # a bad [[apps]] / [operator] table stops the start here
    except ConfigError as exc:
        print(f"maced: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(config.render())
        return 0
    ort_prefetch.settle(config.engine)
    setup_logging(config)
    try:
        check_start(config)
    except StartRefused as exc:
        print(f"maced: {exc}", file=sys.stderr)
        return 2
    try:
        tightened = make_private(config.state_dir)
    except OSError as exc:
        print(f"maced: cannot make the state directory {config.state_dir} private: {exc}", file=sys.stderr)
        return 1
    if tightened:
        log.info("state directory %s: removed group/other access from %d path(s)", config.state_dir, tightened)
    environ = dict(os.environ)  # as started: SIGHUP re-reads the file against the same env and flags
    # The runtime's own lookups (model cache) must see the state directory this config chose.
    os.environ["MACE_STATE_DIR"] = str(config.state_dir)

    def reload_config() -> DaemonConfig:
        new = load_config(args.config, environ, flags)
        load_identities(new)
        return new

    try:
        code = asyncio.run(run(config, reload_config))
    except KeyboardInterrupt:
        code = 130
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything durable was closed explicitly above. Interpreter teardown with torch loaded
    # spends seconds garbage-collecting on a busy board; skipping it keeps a stop well inside
    # systemd's TimeoutStopSec and the 10 s the SIGTERM contract promises.
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
