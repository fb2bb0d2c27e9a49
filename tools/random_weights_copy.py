#!/usr/bin/env python3
"""Write a random-weight copy of a model folder: the same config.json and tokenizer files, fresh
weights drawn by transformers' own initialiser. Every kernel and byte per token is the original
model's, so throughput measured on the copy is the model's; use it where the real weights cannot
travel (a lent benchmark machine with a small upload limit).

    python tools/random_weights_copy.py SRC_DIR DST_DIR [--seed 0] [--dtype bfloat16]

SRC_DIR may hold `tokenizer.json.gz` instead of `tokenizer.json` (tools/data/smollm2-135m: the
default model's config and tokenizer, small enough to travel with the repository).
"""

from __future__ import annotations

import argparse
import gzip
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")


def write_copy(src: Path, dst: Path, *, seed: int = 0, dtype: str = "float32", device: str = "cpu") -> int:
    """Write the random copy of `src` into `dst` (weights in `dtype`, drawn on `device`: a GPU
    initialises a 1B model in a moment where one CPU core takes a minute); returns its
    parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    src, dst = Path(src), Path(dst)
    cfg = AutoConfig.from_pretrained(src, local_files_only=True)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.to("cpu").save_pretrained(dst)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
        elif (src / f"{name}.gz").exists():
            with gzip.open(src / f"{name}.gz", "rb") as packed, open(dst / name, "wb") as out:
                shutil.copyfileobj(packed, out)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--device", default="cpu", help="where the weights are drawn (cuda: much faster at 1B)")
    args = ap.parse_args()
    n = write_copy(args.src, args.dst, seed=args.seed, dtype=args.dtype, device=args.device)
    print(f"wrote {args.dst}: {n:,} random parameters")


if __name__ == "__main__":
    main()
