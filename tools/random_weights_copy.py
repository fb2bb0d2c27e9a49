#!/usr/bin/env python3
"""Write a random-weight copy of a model folder: the same config.json and tokenizer files, fresh
weights drawn by transformers' own initialiser. Every kernel and byte per token is the original
model's, so throughput measured on the copy is the model's; use it where the real weights cannot
travel (a lent benchmark machine with a small upload limit).

    python tools/random_weights_copy.py SRC_DIR DST_DIR [--seed 0]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(args.src, local_files_only=True)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(args.dst)
    for name in TOKENIZER_FILES:
        if (args.src / name).exists():
            shutil.copy(args.src / name, args.dst / name)
    print(f"wrote {args.dst}: {sum(p.numel() for p in model.parameters()):,} random parameters")


if __name__ == "__main__":
    main()
