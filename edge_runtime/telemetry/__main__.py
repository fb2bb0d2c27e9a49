"""Command line: `parse` turns a tegrastats log into JSON lines; `watch` prints live readings.

    tegrastats --interval 500 | python -m edge_runtime.telemetry parse
    python -m edge_runtime.telemetry parse tegrastats.log > tegrastats.jsonl
    python -m edge_runtime.telemetry watch --source replay --replay trace.log --speed 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from typing import TextIO

from edge_runtime.telemetry.config import SOURCES, TelemetryConfig, select_budgeter, select_source
from edge_runtime.telemetry.sources import TelemetryUnavailable
from edge_runtime.telemetry.tegrastats import parse_line


def parse_lines(lines: Iterable[str]) -> Iterator[str]:
    """One JSON object per non-blank tegrastats line."""
    for line in lines:
        if line.strip():
            yield json.dumps(parse_line(line).to_dict())


def _write(out: TextIO, text: str) -> None:
    out.write(text + "\n")
    out.flush()  # a pipe from a live tegrastats should stream, not arrive in 4 KiB bursts


def cmd_parse(args: argparse.Namespace) -> int:
    if not args.files:
        for record in parse_lines(sys.stdin):
            _write(sys.stdout, record)
        return 0
    for path in args.files:
        with open(path, encoding="utf-8", errors="replace") as f:
            for record in parse_lines(f):
                _write(sys.stdout, record)
    return 0


async def _watch(config: TelemetryConfig, count: int | None) -> None:
    source = select_source(config)
    budgeter = select_budgeter(config)
    seen = 0
    async with contextlib.aclosing(source.readings()) as readings:
        async for reading in readings:
            budget = budgeter.update(reading)
            record = {k: v for k, v in asdict(reading).items() if k != "sample"}
            record["budget"] = budget.describe()
            _write(sys.stdout, json.dumps(record))
            seen += 1
            if count is not None and seen >= count:
                return


def cmd_watch(args: argparse.Namespace) -> int:
    config = TelemetryConfig(
        source=args.source,
        interval_s=args.interval,
        replay_file=args.replay,
        replay_speed=args.speed,
        memory_reserve_mb=args.reserve_mb,
    )
    try:
        asyncio.run(_watch(config, args.count))
    except TelemetryUnavailable as exc:
        print(f"telemetry unavailable: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m edge_runtime.telemetry", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("parse", help="tegrastats lines (stdin or files) -> JSON lines")
    p.add_argument("files", nargs="*", help="tegrastats logs; stdin when none")
    p.set_defaults(func=cmd_parse)
    w = sub.add_parser("watch", help="print readings and the memory budget from a source")
    w.add_argument("--source", choices=SOURCES, default="auto")
    w.add_argument("--interval", type=float, default=1.0, help="seconds between readings")
    w.add_argument("--replay", help="recorded trace for --source replay (or auto)")
    w.add_argument("--speed", type=float, default=1.0, help="replay speed factor; <= 0: no wait")
    w.add_argument("--reserve-mb", type=float, default=2048.0, help="memory kept for others")
    w.add_argument("--count", type=int, help="stop after this many readings")
    w.set_defaults(func=cmd_watch)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `... | head` closed the pipe: not an error for a CLI filter
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
