"""Paths and loaders for the telemetry test fixtures (imported by the tests and conftest)."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
SQUEEZE_TRACE = FIXTURES / "squeeze_thermal_trace.log"


def load_jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines() if line]
