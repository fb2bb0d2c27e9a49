"""The model cache of a GGUF kept as its quantised blocks: config.json, generation_config.json,
the tokenizer files and `model.blocks.safetensors` (levels, scales, offsets and their steps as
`Blocks` holds them, float norms; which weights are blocks, and their formats, in its metadata), written a
tensor at a time from the model `gguf_load` builds. What is cached is what is served: no float
copy of a quantised weight exists on disk or in memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edge_runtime.errors import ModelNotAvailable
from edge_runtime.model import gguf_config, gguf_load
from edge_runtime.model.config import ModelConfig
from edge_runtime.model.llama import LlamaModel, rotary_tables
from edge_runtime.model.qweights import TENSOR_FIELDS, Blocks, QuantWeight

logger = logging.getLogger(__name__)

BLOCKS_FILE = "model.blocks.safetensors"
FORMAT = "mace-blocks-3"  # 2: factored K-quant scales, float16 scales; 3: 5/6-bit levels packed
_DTYPES = {torch.uint8: "U8", torch.int8: "I8", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
# GGUF special-token ids (llama.cpp's `tokenizer.ggml.*`) and the tokenizer's attribute names.
_SPECIAL_TOKENS = (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                   ("pad", "padding_token_id"))
_SAMPLE_TEXT = "Hello! Summarise: the quick brown fox jumps over the lazy dog. 😀 你好"


def is_block_cache(path: str | Path) -> bool:
    return (Path(path) / BLOCKS_FILE).is_file()


def write_block_cache(gguf_path: Path, out_dir: Path, header: gguf_config.GgufHeader | None = None,
                      blocks: bool = True) -> dict[str, str]:
    """Read a llama GGUF as blocks (`gguf_load`) and write it into `out_dir` as above. Returns
    the sha256 of the files it hashed as it wrote them (the blocks file), by name. `blocks`
    False: the config and the tokenizer only (the weights are read in place from the GGUF)."""
    from transformers import AutoTokenizer, GenerationConfig

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    header = header or gguf_config.read_header(gguf_path)
    config = gguf_load.hf_config(gguf_path, header)
    if blocks:
        logger.info("reading %s as quantised blocks (no float copy)", gguf_path.name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelNotAvailable(f"transformers cannot read the tokenizer of {gguf_path}: {exc}") from exc
    for name, key in _SPECIAL_TOKENS:  # the file's own ids, whatever transformers' release maps
        token_id = header.metadata.get(f"tokenizer.ggml.{key}")
        if token_id is None:
            continue
        if not 0 <= int(token_id) < len(tokenizer):
            raise ModelNotAvailable(f"{gguf_path.name}: tokenizer.ggml.{key} = {token_id} is outside the vocabulary")
        setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(int(token_id)))
    written = {}
    if blocks:
        model = gguf_load.load_llama_gguf(gguf_path, config=config, header=header)
        written[BLOCKS_FILE] = save_blocks(model, out_dir / BLOCKS_FILE)
        del model
    settings = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k != "quantization_config"}
    settings["architectures"] = ["LlamaForCausalLM"]
    (out_dir / "config.json").write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    reloaded = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    if reloaded.encode(_SAMPLE_TEXT) != tokenizer.encode(_SAMPLE_TEXT):
        raise ModelNotAvailable(f"the tokenizer saved in {out_dir} tokenizes differently from the GGUF's")
    return written


def save_blocks(model: LlamaModel, path: Path) -> str:
    """safetensors of the model's persistent tensors, streamed one tensor at a time (the format:
    an 8-byte little-endian header length, the JSON header, then each tensor's bytes). Returns
    the file's sha256, taken as it is written (the cache's manifest lists it: no second read)."""
    state = model.state_dict()
    quant = {name: [list(f) for f in module.formats]
             for name, module in model.named_modules() if isinstance(module, QuantWeight)}
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT, "quant": json.dumps(quant)}}
    offset = 0
    for name, t in state.items():
        if t.dtype not in _DTYPES:
            raise ValueError(f"cannot store {name} of dtype {t.dtype}")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as fh:
        for chunk in (struct.pack("<Q", len(text)), text):
            fh.write(chunk)
            digest.update(chunk)
        for t in state.values():
            data = t.detach().contiguous().cpu()
            chunk = memoryview(data.view(torch.uint8).numpy() if data.numel() else b"")
            fh.write(chunk)
            digest.update(chunk)
    return digest.hexdigest()


def load_block_cache(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    max_positions: int | None = None,
) -> LlamaModel:
    """The model a block cache holds: its blocks as they are, float tensors in `dtype`."""
    from safetensors import safe_open

    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions=None)
    with safe_open(str(path / BLOCKS_FILE), framework="pt", device="cpu") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ModelNotAvailable(f"{path / BLOCKS_FILE} is not a block cache of format {FORMAT}")
        names = set(f.keys())
        used: set[str] = set()

        def get(name: str) -> torch.Tensor:
            used.add(name)
            return f.get_tensor(name)

        for module_name, formats in json.loads(meta["quant"]).items():
            parts = []
            for i, (zero, bits) in enumerate(formats):
                keys = {field: f"{module_name}.{field}_{i}" for field in TENSOR_FIELDS}
                parts.append(Blocks(**{field: get(key) if key in names else None for field, key in keys.items()},
                                    zero=zero, bits=bits))
            parent, attr = _parent(model, module_name)
            delattr(parent, attr)
            setattr(parent, attr, QuantWeight(parts).to(device))
        for name, param in list(model.named_parameters()):
            if name not in names:
                raise ModelNotAvailable(f"{path / BLOCKS_FILE} lacks {name}")
            parent, attr = _parent(model, name)
            value = get(name)
            if tuple(value.shape) != tuple(param.shape):
                raise ModelNotAvailable(f"{name} has shape {tuple(value.shape)} in {path}, expected {tuple(param.shape)}")
            setattr(parent, attr, nn.Parameter(value.to(device=device, dtype=dtype), requires_grad=False))
    if names - used:
        raise ModelNotAvailable(f"{path / BLOCKS_FILE} holds tensors the model does not use: {sorted(names - used)[:3]}")
    model.ropes = rotary_tables(cfg, max_positions).to(device)
    model.eval()
    return model


def load_in_place(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    max_positions: int | None = None,
) -> LlamaModel | None:
    """The model of a cache that reads its GGUF in place (model_cache.IN_PLACE_FORMAT): every
    matrix a view of the file's map (`gguf_weight`); None for any other cache."""
    from transformers import AutoConfig

    from edge_runtime.model.model_cache import in_place_source

    source = in_place_source(Path(path))
    if source is None:
        return None
    if not source.is_file():
        raise ModelNotAvailable(f"{path} serves {source} in place, and that file is gone")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    return gguf_load.load_llama_gguf(source, dtype=dtype, device=device, max_positions=max_positions,
                                     config=config, in_place=True)


def _parent(model: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    owner, _, attr = dotted.rpartition(".")
    return (model.get_submodule(owner) if owner else model), attr
