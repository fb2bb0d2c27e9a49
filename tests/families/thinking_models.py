"""Tiny random-weight Qwen3 and SmolLM3 models with their real chat templates (fixtures in
templates/, SOURCES.md says where each came from) and `<think>`/`</think>` as added, non-special
tokens, as in the real tokenizers. Shared by the thinking tests of the engine and the gateway."""

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
