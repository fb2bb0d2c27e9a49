"""tools/report.py: the two percentile definitions the result files were written with, the
markdown tables and the JSON files every benchmark writes."""

from __future__ import annotations

import json

from tests.tool_modules import load_tool

report = load_tool("report")


def test_rounded_index_and_nearest_rank_percentiles_keep_their_definitions():
    values = [float(v) for v in range(1, 102)]  # 1..101
    assert report.percentile([], 0.5) is None and report.nearest_rank([], 0.5) is None
    assert report.percentile(list(reversed(values)), 0.5) == 51.0
    assert report.percentile(values, 0.99) == 100.0
    four = [4.0, 1.0, 3.0, 2.0]
    assert report.percentile(four, 0.5) == 3.0  # index round(1.5) = 2
    assert report.nearest_rank(four, 0.5) == 2.0  # the ceil(2)-th smallest
    assert report.nearest_rank(four, 0.99) == 4.0 and report.nearest_rank([7.0], 0.01) == 7.0


def test_markdown_table_aligns_the_columns_it_is_told_to():
    assert report.markdown_table(["policy", "SLO %"], [["mace", 97], ["fifo", None]], align="lr") == [
        "| policy | SLO % |", "|---|---:|", "| mace | 97 |", "| fifo | None |"]


def test_write_json_creates_the_folder_and_ends_with_a_newline(tmp_path):
    path = report.write_json(tmp_path / "results" / "x.json", {"a": 1.5, "b": {2}}, default=sorted)
    assert path.read_text().endswith("\n") and json.loads(path.read_text()) == {"a": 1.5, "b": [2]}
    assert len(report.load_average()) == 3
