#!/usr/bin/env python3
"""Random-weight GGUF files at real shapes (Llama-3.2-1B/3B, Llama-3.1-8B, SmolLM2-135M, a tiny one) in
llama.cpp's quantisation mixes, written as well-formed quantised blocks, tensor by tensor, in
bounded memory (no float model is ever built). Owns the shape table the scale benchmarks share.

    python tools/make_gguf.py [--shapes llama-3.2-1b,llama-3.1-8b] [--mixes q4_k_m,q8_0] [--out DIR]

Metadata as llama.cpp's converter writes it for `llama`, less one thing: Llama 3.1+'s `llama3`
RoPE scaling is a `rope_freqs` tensor in a real file, and this project's loader refuses files that
carry it (transformers' GGUF loader would drop it), so these files have plain RoPE at the real base.
The tokenizer is the tiny test model's byte-level BPE (ChatML specials) padded to the shape's
vocabulary with `<fill_N>` tokens, so every id a random model emits decodes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 1 << 20

# -- the shapes ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A published model's architecture (its config.json numbers), without its weights."""

    name: str
    model_type: str  # transformers' config class picks the checkpoint's tensor names
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_parameters: dict[str, Any]
    rms_norm_eps: float
    tie_word_embeddings: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def scaled(self, **overrides: Any) -> Shape:
        """The same architecture with some numbers changed (fewer layers for development, a tiny
        everything for tests)."""
        values = {k: getattr(self, k) for k in self.__dataclass_fields__}
        values.update(overrides)
        return Shape(**values)


def _llama3_rope(factor: float) -> dict[str, Any]:
    return {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


_LLAMA = {"attention_bias": False, "mlp_bias": False}
SHAPES = {
    # meta-llama/Llama-3.2-1B config.json
    "llama-3.2-1b": Shape(
        "llama-3.2-1b", "llama", hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
        intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072,
        rope_parameters=_llama3_rope(32.0), rms_norm_eps=1e-5, extra=_LLAMA),
    # meta-llama/Llama-3.2-3B config.json
    "llama-3.2-3b": Shape(
        "llama-3.2-3b", "llama", hidden_size=3072, num_layers=28, num_heads=24, num_kv_heads=8, head_dim=128,
        intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072,
        rope_parameters=_llama3_rope(32.0), rms_norm_eps=1e-5, extra=_LLAMA),
    # meta-llama/Llama-3.1-8B config.json (an untied output head)
    "llama-3.1-8b": Shape(
        "llama-3.1-8b", "llama", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
        rope_parameters=_llama3_rope(8.0), rms_norm_eps=1e-5, tie_word_embeddings=False, extra=_LLAMA),
    # Qwen/Qwen3-1.7B config.json (per-head RMSNorm on q and k: q_norm / k_norm tensors); safetensors only
    "qwen3-1.7b": Shape(
        "qwen3-1.7b", "qwen3", hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
        intermediate_size=6144, vocab_size=151936, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6, extra={"attention_bias": False, "use_sliding_window": False, "sliding_window": None}),
    # HuggingFaceTB/SmolLM2-135M-Instruct config.json (the default model; 576-wide rows are not a
    # multiple of 256, so the k-quant mixes fall back to 32-wide types on them, as llama.cpp does)
    "smollm2-135m": Shape(
        "smollm2-135m", "llama", hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
        intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, rms_norm_eps=1e-5, extra=_LLAMA),
    # For tests: every row a multiple of 256 so the k-quant mixes keep their types (as at real sizes).
    "tiny": Shape(
        "tiny", "llama", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
        intermediate_size=512, vocab_size=512, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rms_norm_eps=1e-5, extra=_LLAMA),
}
GGUF_SHAPES = ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "smollm2-135m", "tiny")


def padded_tokenizer(vocab_size: int) -> Any:
    """The tiny test model's byte-level BPE (ChatML specials, every byte, a few merges), with
    filler tokens `<fill_N>` up to `vocab_size`: a random model emits any id, and each decodes."""
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    from edge_runtime.model.testing import _build_tokenizer

    small = _build_tokenizer(0)
    data = json.loads(small.backend_tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    if vocab_size < len(vocab):
        raise ValueError(f"a vocabulary of {vocab_size} cannot hold the tokenizer's {len(vocab)} base tokens")
    for i in range(len(vocab), vocab_size):
        vocab[f"<fill_{i}>"] = i
    return PreTrainedTokenizerFast(
        tokenizer_object=RawTokenizer.from_str(json.dumps(data)),
        bos_token=small.bos_token, eos_token=small.eos_token, pad_token=small.pad_token,
        unk_token=small.unk_token, chat_template=small.chat_template, clean_up_tokenization_spaces=False,
    )


# -- the mixes: which type each tensor gets -----------------------------------------------------

# Imported lazily through these names so `--help` does not need gguf.
def _gguf() -> Any:
    import gguf

    return gguf


@dataclass(frozen=True)
class Mix:
    """A llama.cpp file type: its `general.file_type` and the type of an ordinary matrix."""

    name: str
    file_type: str  # gguf.LlamaFileType member name
    base: str  # gguf.GGMLQuantizationType member name


MIXES = {
    "q4_k_m": Mix("q4_k_m", "MOSTLY_Q4_K_M", "Q4_K"),
    "q5_k_m": Mix("q5_k_m", "MOSTLY_Q5_K_M", "Q5_K"),
    "q8_0": Mix("q8_0", "MOSTLY_Q8_0", "Q8_0"),
    "q4_0": Mix("q4_0", "MOSTLY_Q4_0", "Q4_0"),
    "q4_1": Mix("q4_1", "MOSTLY_Q4_1", "Q4_1"),
}
# A 256-wide super-block type on a row that is not a multiple of 256 becomes a 32-wide one
# (llama.cpp's quantiser does the same, with a warning).
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v / ffn_down get more bits in the _M mixes: the
    first and last eighth of the stack, and every third layer between."""
    eighth = n_layers // 8
    return i_layer < eighth or i_layer >= 7 * n_layers // 8 or (i_layer - eighth) % 3 == 2


def tensor_type(mix: Mix, role: str, i_layer: int, n_layers: int, ncols: int, tied: bool) -> str:
    """The GGML type llama.cpp's quantiser gives a llama tensor of `role` (token_embd, output,
    attn_q/k/v/output, ffn_gate/up/down) in layer `i_layer` for `mix`, as a type name."""
    new = mix.base
    if role == "output" or (tied and role == "token_embd"):
        # The head (or the embedding that doubles as it) keeps 6 bits unless the mix is Q8_0.
        if ncols % 256 != 0:
            return "Q8_0"
        return new if new == "Q8_0" else "Q6_K"
    if role == "attn_v" and mix.name in ("q4_k_m", "q5_k_m") and use_more_bits(i_layer, n_layers):
        new = "Q6_K"
    elif role == "ffn_down" and mix.name in ("q4_k_m", "q5_k_m") and use_more_bits(i_layer, n_layers):
        new = "Q6_K"
    if new in _FALLBACK and ncols % 256 != 0:
        new = _FALLBACK[new]
    return new


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dims: tuple[int, ...]  # numpy order: (rows, columns) for a matrix
    qtype: str  # GGMLQuantizationType member name


def tensor_plan(shape: Shape, mix: Mix) -> list[PlannedTensor]:
    """Every tensor of a llama GGUF of `shape` in file order, with its type in `mix`."""
    if shape.model_type != "llama":
        raise ValueError(f"{shape.name}: only llama shapes are written as GGUF (got {shape.model_type})")
    h, q_rows, kv_rows = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    n, tied = shape.num_layers, shape.tie_word_embeddings

    def matrix(name: str, role: str, rows: int, cols: int, layer: int = 0) -> PlannedTensor:
        return PlannedTensor(name, (rows, cols), tensor_type(mix, role, layer, n, cols, tied))

    plan = [matrix("token_embd.weight", "token_embd", shape.vocab_size, h)]
    for i in range(n):
        plan += [
            PlannedTensor(f"blk.{i}.attn_norm.weight", (h,), "F32"),
            matrix(f"blk.{i}.attn_q.weight", "attn_q", q_rows, h, i),
            matrix(f"blk.{i}.attn_k.weight", "attn_k", kv_rows, h, i),
            matrix(f"blk.{i}.attn_v.weight", "attn_v", kv_rows, h, i),
            matrix(f"blk.{i}.attn_output.weight", "attn_output", h, q_rows, i),
            PlannedTensor(f"blk.{i}.ffn_norm.weight", (h,), "F32"),
            matrix(f"blk.{i}.ffn_gate.weight", "ffn_gate", shape.intermediate_size, h, i),
            matrix(f"blk.{i}.ffn_up.weight", "ffn_up", shape.intermediate_size, h, i),
            matrix(f"blk.{i}.ffn_down.weight", "ffn_down", h, shape.intermediate_size, i),
        ]
    plan.append(PlannedTensor("output_norm.weight", (h,), "F32"))
    if not tied:
        plan.append(matrix("output.weight", "output", shape.vocab_size, h))
    return plan


# -- random, well-formed blocks -----------------------------------------------------------------

# Standard deviation of the integer part of each format when its codes are uniform: a 4-bit code
# 0..15 has std 4.61 (mean 7.5), 5-bit 9.23 (15.5), 6-bit 18.47 (31.5), int8 in -127..127 73.6.
_CODE_STD = {4: 4.610, 5: 9.233, 6: 18.473, 8: 73.61}


def _f16(values: np.ndarray) -> np.ndarray:
    """float -> the two bytes of an IEEE half each, shape (n, 2)."""
    return values.astype("<f2").view(np.uint8).reshape(-1, 2)


def _jitter(rng: np.random.Generator, n: int) -> np.ndarray:
    """Per-block spread of the scale: real blocks differ by their largest weight."""
    return rng.uniform(0.75, 1.25, n)


def _random_bytes(rng: np.random.Generator, n: int, width: int) -> np.ndarray:
    return np.frombuffer(rng.bytes(n * width), np.uint8).reshape(n, width)


def _k_scales(rng: np.random.Generator, n: int, mean_code: float, min_ratio: float) -> tuple[np.ndarray, ...]:
    """Eight 6-bit sub-block scales per super-block (32..63) and their 6-bit minimums, each chosen
    near scale * mean_code / min_ratio (+-2), so a sub-block's weights centre near zero as a
    quantiser's would; packed into the 12 bytes Q4_K and Q5_K share. Returns (packed, scales)."""
    sc = rng.integers(32, 64, (n, 8)).astype(np.uint8)
    m = np.clip(np.rint(sc * (mean_code / min_ratio)) + rng.integers(-2, 3, (n, 8)), 0, 63).astype(np.uint8)
    packed = np.empty((n, 12), np.uint8)
    # Sub-blocks 0-3 keep their 6 bits in bytes 0-7; 4-7 split low nibbles (bytes 8-11) and the
    # top two bits, parked in the free high bits of bytes 0-7.
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return packed, sc


def random_blocks(qtype: str, n: int, rng: np.random.Generator, std: float) -> np.ndarray:
    """`n` random blocks of `qtype` as bytes (n, block bytes) whose de-quantised weights have
    standard deviation about `std` and mean about zero: the scales set the spread, the codes are
    uniform random."""
    j = _jitter(rng, n)
    if qtype == "Q8_0":
        codes = rng.integers(-127, 128, (n, 32), dtype=np.int8).view(np.uint8)
        return np.hstack([_f16(j * std / _CODE_STD[8]), codes])
    if qtype in ("Q4_0", "Q5_0"):
        bits = 4 if qtype == "Q4_0" else 5
        # Codes run -8..7 (-16..15): a quantiser's scale takes the sign of the block's largest
        # weight, which also keeps the half-step bias from adding up along a row.
        sign = rng.choice(np.array([-1.0, 1.0]), n)
        parts = [_f16(sign * j * std / _CODE_STD[bits])]
        if bits == 5:
            parts.append(_random_bytes(rng, n, 4))  # the fifth bit of each of the 32 codes
        return np.hstack(parts + [_random_bytes(rng, n, 16)])
    if qtype in ("Q4_1", "Q5_1"):
        bits = 4 if qtype == "Q4_1" else 5
        d = j * std / _CODE_STD[bits]
        mean_code = (2**bits - 1) / 2
        parts = [_f16(d), _f16(-mean_code * d)]
        if bits == 5:
            parts.append(_random_bytes(rng, n, 4))
        return np.hstack(parts + [_random_bytes(rng, n, 16)])
    if qtype in ("Q4_K", "Q5_K"):
        bits = 4 if qtype == "Q4_K" else 5
        mean_code = (2**bits - 1) / 2
        min_ratio = 2 ** (bits - 1) * 1.0  # dmin / d: keeps every minimum code under 64
        packed, sc = _k_scales(rng, n, mean_code, min_ratio)
        rms_sc = np.sqrt((sc.astype(np.float64) ** 2).mean(axis=1))
        d = j * std / (_CODE_STD[bits] * rms_sc)
        parts = [_f16(d), _f16(d * min_ratio), packed]
        if bits == 5:
            parts.append(_random_bytes(rng, n, 32))
        return np.hstack(parts + [_random_bytes(rng, n, 128)])
    if qtype == "Q6_K":
        # 16 signed 8-bit sub-scales of magnitude 32..127; codes q - 32 with q uniform 0..63.
        sc = rng.integers(32, 128, (n, 16)) * rng.choice(np.array([-1, 1]), (n, 16))
        rms_sc = np.sqrt((sc.astype(np.float64) ** 2).mean(axis=1))
        d = j * std / (_CODE_STD[6] * rms_sc)
        return np.hstack([_random_bytes(rng, n, 128 + 64), sc.astype(np.int8).view(np.uint8), _f16(d)])
    raise ValueError(f"no random block writer for {qtype}")


def tensor_chunks(t: PlannedTensor, rng: np.random.Generator, std: float, chunk_bytes: int) -> Iterator[bytes]:
    """The bytes of tensor `t`, in pieces of about `chunk_bytes` (norm weights are ones, as a
    freshly initialised model's and close to a trained one's)."""
    gguf = _gguf()
    if t.qtype == "F32":
        yield np.ones(t.dims, np.float32).tobytes()
        return
    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.qtype]]
    total = int(np.prod(t.dims)) // block
    step = max(1, chunk_bytes // type_size)
    for start in range(0, total, step):
        yield random_blocks(t.qtype, min(step, total - start), rng, std).tobytes()


# -- the file -----------------------------------------------------------------------------------


def tensor_nbytes(t: PlannedTensor) -> int:
    gguf = _gguf()
    if t.qtype == "F32":
        return 4 * int(np.prod(t.dims))
    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.qtype]]
    return int(np.prod(t.dims)) // block * type_size


def _write_metadata(writer: Any, shape: Shape, mix: Mix) -> None:
    """The keys llama.cpp's converter and quantiser write for a llama model (general.*, llama.*,
    tokenizer.*), with the tokenizer as GGUF "gpt2" (byte-level BPE)."""
    gguf = _gguf()
    writer.add_type("model")
    writer.add_name(f"{shape.name} random weights ({mix.name})")
    writer.add_file_type(int(gguf.LlamaFileType[mix.file_type]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(shape.vocab_size)
    writer.add_context_length(shape.max_position_embeddings)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)

    tokenizer = padded_tokenizer(shape.vocab_size)
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = dict(data["model"]["vocab"])
    special = {t["content"]: t["id"] for t in data["added_tokens"]}
    vocab.update(special)
    tokens = sorted(vocab, key=vocab.__getitem__)
    if [vocab[t] for t in tokens] != list(range(shape.vocab_size)):
        raise ValueError("the padded tokenizer's ids are not 0..vocab_size-1")
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)


def write_gguf(shape: Shape, mix: Mix, path: Path, *, seed: int = 0, std: float = 0.02,
               chunk_bytes: int = 16 * MiB) -> Path:
    """Write `shape` in `mix` with random weights to `path`: header, metadata and tensor index
    through gguf-py's GGUFWriter, then each tensor's bytes streamed in chunks, so memory stays
    at about `chunk_bytes` whatever the model's size."""
    gguf = _gguf()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    plan = tensor_plan(shape, mix)
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(partial, "llama")
    _write_metadata(writer, shape, mix)
    for t in plan:
        dtype = gguf.GGMLQuantizationType[t.qtype]
        writer.add_tensor_info(t.name, t.dims, np.dtype(np.float32), tensor_nbytes(t),
                               raw_dtype=None if t.qtype == "F32" else dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    align = writer.data_alignment
    rng = np.random.default_rng(seed)
    with open(partial, "ab") as out:
        # The tensor index gives each tensor's offset from the aligned start of the data section,
        # each one padded to the alignment: the same layout, written a chunk at a time.
        out.write(b"\0" * (-out.tell() % align))
        for t in plan:
            written = 0
            for chunk in tensor_chunks(t, rng, std, chunk_bytes):
                out.write(chunk)
                written += len(chunk)
            if written != tensor_nbytes(t):
                raise RuntimeError(f"{t.name}: wrote {written} bytes, its index says {tensor_nbytes(t)}")
            out.write(b"\0" * (-written % align))
    os.replace(partial, path)
    return path


def file_name(shape: Shape, mix: Mix) -> str:
    return f"{shape.name}-random-{mix.name}.gguf"


def default_out_dir() -> Path:
    """$MACE_CACHE_DIR/random-gguf, else /tmp/mace-random-gguf: never inside the repository."""
    base = os.environ.get("MACE_CACHE_DIR")
    return Path(base) / "random-gguf" if base else Path("/tmp/mace-random-gguf")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="llama-3.2-1b", help=f"any of {', '.join(GGUF_SHAPES)}")
    ap.add_argument("--mixes", default="q4_k_m,q8_0", help=f"any of {', '.join(MIXES)}")
    ap.add_argument("--out", default="", help=f"folder for the files (default {default_out_dir()})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02, help="standard deviation of the de-quantised weights")
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the real shape (development only)")
    ap.add_argument("--force", action="store_true", help="rewrite files that already exist")
    args = ap.parse_args(argv)
    out = Path(args.out) if args.out else default_out_dir()
    for shape_name in args.shapes.split(","):
        if shape_name not in GGUF_SHAPES:
            ap.error(f"unknown shape {shape_name!r}: any of {', '.join(GGUF_SHAPES)}")
        shape = SHAPES[shape_name]
        if args.layers:
            shape = shape.scaled(name=f"{shape.name}-{args.layers}l", num_layers=args.layers)
        for mix_name in args.mixes.split(","):
            if mix_name not in MIXES:
                ap.error(f"unknown mix {mix_name!r}: any of {', '.join(MIXES)}")
            mix = MIXES[mix_name]
            path = out / file_name(shape, mix)
            if path.exists() and not args.force:
                print(f"{path}: exists ({path.stat().st_size / MiB:.0f} MiB), kept", flush=True)
                continue
            t0 = time.perf_counter()
            write_gguf(shape, mix, path, seed=args.seed, std=args.std)
            tensors = sum(tensor_nbytes(t) for t in tensor_plan(shape, mix))
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            print(f"{path}: {path.stat().st_size / MiB:.0f} MiB ({tensors / MiB:.0f} MiB of tensors) in "
                  f"{time.perf_counter() - t0:.1f} s; this tool's peak RSS so far {peak / MiB:.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
