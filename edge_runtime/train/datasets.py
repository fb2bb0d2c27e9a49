"""Loaders for preference data a user has locally: Anthropic HH-RLHF and Stanford SHP JSONL files
(plain or .gz), and the explicit {"prompt", "chosen", "rejected"} form. Each line becomes a
`PreferenceRecord` with chat-message prompts; lines that do not parse are counted, not hidden.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_runtime.train.pairs import PreferenceRecord

_TURN = re.compile(r"\n\n(Human|Assistant):")
_ASSISTANT = "\n\nAssistant:"
FORMATS = ("hh", "shp", "explicit")


class FilteredOut(Exception):
    """A well-formed row that a filter (e.g. SHP's score ratio) leaves out."""


@dataclass
class PreferenceFile:
    records: list[PreferenceRecord]
    skipped: Counter = field(default_factory=Counter)  # reason -> lines skipped
    format: str = ""


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield number, line


def hh_transcript_to_messages(text: str) -> list[dict[str, str]]:
    """"\\n\\nHuman: a\\n\\nAssistant: b..." -> [{"role": "user", "content": "a"}, ...]."""
    parts = _TURN.split(text)
    messages = []
    # split() gives [preamble, role, content, role, content, ...]
    for role, content in zip(parts[1::2], parts[2::2], strict=True):
        messages.append({"role": "user" if role == "Human" else "assistant", "content": content.strip()})
    return messages


def parse_hh(row: dict[str, Any]) -> PreferenceRecord:
    """HH-RLHF rows hold two whole transcripts that differ only in the final assistant turn."""
    chosen, rejected = row["chosen"], row["rejected"]
    cut = chosen.rfind(_ASSISTANT)
    if cut < 0 or not rejected.startswith(chosen[: cut + len(_ASSISTANT)]):
        # Rare rows differ earlier; use the longest shared prefix that ends at an assistant turn.
        common = 0
        while common < min(len(chosen), len(rejected)) and chosen[common] == rejected[common]:
            common += 1
        cut = chosen.rfind(_ASSISTANT, 0, common - len(_ASSISTANT) + 1)
        if cut < 0:
            raise ValueError("chosen and rejected transcripts share no prompt")
    prompt = hh_transcript_to_messages(chosen[:cut])
    if not prompt or prompt[-1]["role"] != "user":
        raise ValueError("transcript prompt does not end with a human turn")
    start = cut + len(_ASSISTANT)
    return PreferenceRecord(tuple(prompt), chosen[start:].strip(), rejected[start:].strip())


def parse_shp(row: dict[str, Any], min_score_ratio: float | None = None) -> PreferenceRecord:
    """SHP rows: a post (`history`), two comments, `labels` = 1 when A is preferred."""
    if min_score_ratio is not None and float(row.get("score_ratio", 0.0)) < min_score_ratio:
        raise FilteredOut("below score ratio")
    a, b = row["human_ref_A"], row["human_ref_B"]
    chosen, rejected = (a, b) if int(row["labels"]) == 1 else (b, a)
    prompt = ({"role": "user", "content": row["history"].strip()},)
    return PreferenceRecord(prompt, chosen.strip(), rejected.strip(), row.get("post_id"))


def parse_explicit(row: dict[str, Any]) -> PreferenceRecord:
    prompt = row["prompt"]
    if isinstance(prompt, str):
        prompt = ({"role": "user", "content": prompt},)
    else:
        prompt = tuple(prompt)
    return PreferenceRecord(prompt, row["chosen"], row["rejected"], row.get("id"))


def detect_format(row: dict[str, Any]) -> str:
    if "human_ref_A" in row and "labels" in row:
        return "shp"
    if "prompt" in row and "chosen" in row:
        return "explicit"
    if "chosen" in row and "rejected" in row:
        return "hh"
    raise ValueError(f"unrecognised preference row with keys {sorted(row)}")


def load_preferences(
    path: str | Path, fmt: str = "auto", limit: int | None = None, min_score_ratio: float | None = None
) -> PreferenceFile:
    """Read up to `limit` pairs. `fmt`: "auto" (from the first row), "hh", "shp" or "explicit".
    `min_score_ratio` filters SHP (its authors suggest 2 for a clear preference)."""
    path = Path(path)
    if fmt != "auto" and fmt not in FORMATS:
        raise ValueError(f"unknown preference format {fmt!r}; use auto, {', '.join(FORMATS)}")
    out = PreferenceFile([], Counter(), fmt)
    for number, line in _lines(path):
        if limit is not None and len(out.records) >= limit:
            break
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            out.skipped["invalid JSON"] += 1
            continue
        if not isinstance(row, dict):
            out.skipped["not an object"] += 1
            continue
        if out.format == "auto":
            out.format = detect_format(row)
        try:
            if out.format == "hh":
                record = parse_hh(row)
            elif out.format == "shp":
                record = parse_shp(row, min_score_ratio)
            else:
                record = parse_explicit(row)
        except FilteredOut as why:
            out.skipped[str(why)] += 1
            continue
        except (KeyError, TypeError, ValueError) as exc:
            out.skipped[f"malformed ({type(exc).__name__})"] += 1
            continue
        if record.chosen == record.rejected or not record.chosen or not record.rejected:
            out.skipped["empty or identical answers"] += 1
            continue
        if record.pair_id is None:
            record = PreferenceRecord(record.prompt, record.chosen, record.rejected, f"{path.name}:{number}")
        out.records.append(record)
    return out
