"""Tiny random-weight Qwen3, SmolLM3 and Granite 3.3 models with their real chat templates
(fixtures in templates/, SOURCES.md says where each came from) and `<think>`/`</think>` as added,
non-special tokens, as in the real tokenizers. Shared by the thinking tests of the engine and the
gateway. Granite's `<response>`/`</response>` are left as plain text (several tokens each), so
its tests cover tags split across tokens."""

from __future__ import annotations

from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"
THINK_TAGS = ("<think>", "</think>")
FAMILIES = {
    "qwen3": {"model_type": "qwen3", "config": {"head_dim": 16}},
    "smollm3": {"model_type": "smollm3", "num_layers": 4, "config": {"no_rope_layers": [1, 0, 1, 0]}},
}


def template(family: str) -> str:
    return (TEMPLATES / f"{family}.jinja").read_text()


def make_thinking_model(root: Path, family: str) -> Path:
    """The tiny `family` model in root/family (its name is the model name maced serves)."""
    from edge_runtime.model.testing import make_tiny_model_dir

    return make_tiny_model_dir(root / family, chat_template=template(family), added_tokens=THINK_TAGS,
                               **FAMILIES[family])


# Granite's own multipliers, each away from 1 (as tests/families/test_families.py builds it);
# the model's name is what maced serves. Not in FAMILIES: its switch and replies differ.
GRANITE_FAMILY = {"model_type": "granite", "config": {"embedding_multiplier": 12.0, "attention_multiplier": 0.1,
                                                      "residual_multiplier": 0.22, "logits_scaling": 8.0}}


def make_granite_model(root: Path) -> Path:
    """The tiny Granite 3.3 model in root/granite3."""
    from edge_runtime.model.testing import make_tiny_model_dir

    return make_tiny_model_dir(root / "granite3", chat_template=template("granite3"), added_tokens=THINK_TAGS,
                               **GRANITE_FAMILY)
