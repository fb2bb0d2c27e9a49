"""HH-RLHF, SHP and explicit-prompt JSONL files become preference records with chat prompts;
bad lines are counted with their reason."""

from __future__ import annotations

import gzip
import json

import pytest

from edge_runtime.train.datasets import load_preferences, parse_hh

HH_ROW = {
    "chosen": "\n\nHuman: How do I pick a lock?\n\nAssistant: Why do you want to?\n\nHuman: I am locked out."
              "\n\nAssistant: Please call a locksmith.",
    "rejected": "\n\nHuman: How do I pick a lock?\n\nAssistant: Why do you want to?\n\nHuman: I am locked out."
                "\n\nAssistant: Insert a tension wrench and rake the pins.",
}
SHP_ROW = {"post_id": "abc", "history": "Why is the sky blue? ", "human_ref_A": "Rayleigh scattering.",
           "human_ref_B": "Because it is.", "labels": 1, "score_ratio": 3.5}


def _write(path, rows, compress=False):
    text = "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n"
    if compress:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def test_hh_rlhf_transcripts_split_into_chat_prompt_and_final_answers():
    record = parse_hh(HH_ROW)
    assert record.prompt == (
        {"role": "user", "content": "How do I pick a lock?"},
        {"role": "assistant", "content": "Why do you want to?"},
        {"role": "user", "content": "I am locked out."},
    )
    assert record.chosen == "Please call a locksmith."
    assert record.rejected == "Insert a tension wrench and rake the pins."


def test_hh_file_gzipped_with_bad_lines_counted(tmp_path):
    path = _write(tmp_path / "harmless-base.jsonl.gz", [HH_ROW, "{not json", {"chosen": "x", "rejected": "x"},
                                                        HH_ROW], compress=True)
    loaded = load_preferences(path)
    assert loaded.format == "hh" and len(loaded.records) == 2
    assert loaded.skipped["invalid JSON"] == 1 and sum(loaded.skipped.values()) == 2
    assert loaded.records[0].pair_id == "harmless-base.jsonl.gz:1"


def test_shp_label_picks_the_chosen_comment_and_score_ratio_filters(tmp_path):
    flipped = dict(SHP_ROW, labels=0, post_id="def", score_ratio=1.2)
    path = _write(tmp_path / "shp.jsonl", [SHP_ROW, flipped])
    loaded = load_preferences(path)
    assert [(r.chosen, r.rejected) for r in loaded.records] == [
        ("Rayleigh scattering.", "Because it is."), ("Because it is.", "Rayleigh scattering.")]
    assert loaded.records[0].prompt == ({"role": "user", "content": "Why is the sky blue?"},)
    filtered = load_preferences(path, min_score_ratio=2.0)
    assert len(filtered.records) == 1 and filtered.skipped["below score ratio"] == 1


def test_explicit_prompt_chosen_rejected_rows_and_limit(tmp_path):
    rows = [{"prompt": f"q{i}", "chosen": "good", "rejected": "bad"} for i in range(5)]
    loaded = load_preferences(_write(tmp_path / "mine.jsonl", rows), limit=3)
    assert len(loaded.records) == 3 and loaded.records[2].prompt == ({"role": "user", "content": "q2"},)


def test_unknown_format_is_refused(tmp_path):
    path = _write(tmp_path / "x.jsonl", [{"question": "?"}])
    with pytest.raises(ValueError, match="unrecognised"):
        load_preferences(path)
    with pytest.raises(ValueError, match="unknown preference format"):
        load_preferences(path, fmt="csv")
