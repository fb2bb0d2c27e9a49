"""Exports the step graph once per (model weights, graph spec, graph version) and caches it under
`<cache dir>/onnx/<key>/` (model.onnx + model.onnx.data + meta.json), written atomically and
shared by every state directory (exports an older release left under `<state dir>/onnx/` are
still used).

Owns the cache key and the files; the graph itself comes from `onnx_graph`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import onnx
import torch
from tqdm import tqdm

from edge_runtime import paths
from edge_runtime.backends import weights_memo
from edge_runtime.backends.onnx_external import ExternalData
from edge_runtime.backends.onnx_graph import build_step_graph
from edge_runtime.backends.onnx_spec import GRAPH_VERSION, OPSET, GraphSpec, with_gqa_window
from edge_runtime.durable import TargetExists, publish_directory
from edge_runtime.model.gguf_weight import GgufWeight
from edge_runtime.model.llama import LlamaModel
from edge_runtime.model.mapped_weights import MappedWeights
from edge_runtime.model.qweights import QuantWeight

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
META_FILE = "meta.json"
# Versions of the graph of a model held as quantised blocks, in its key (a float model's key and
# graphs are unchanged): 1 = the q4_1 format written from the blocks as they are (onnx_blocks.py).
BLOCKS_GRAPH = 1


def model_hash(model: LlamaModel) -> str:
    """Digest of the config and every weight's bytes: two models share an export only if their
    numbers are identical (a bf16 copy of a model is a different model here). Remembered by the
    loaded files' identity where the loader said so (weights_memo)."""
    return weights_memo.remembered(model, _hash_weights)


def config_content(hf_config: object) -> str:
    """The config's fields as the digest reads them: what the model is, not where or by which
    library it was read (`_name_or_path` is the folder, so the same model in another cache
    directory re-exported its graph; `transformers_version`; transformers' other private keys)."""
    fields = json.loads(hf_config.to_json_string(use_diff=False))  # type: ignore[attr-defined]
    return json.dumps({k: v for k, v in fields.items() if not k.startswith("_") and k != "transformers_version"},
                      sort_keys=True)


def _hash_weights(model: LlamaModel) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(config_content(model.cfg.hf_config).encode())
    with torch.no_grad():
        for name, param in model.named_parameters():
            h.update(f"{name}:{param.dtype}:{tuple(param.shape)}".encode())
            feed_bytes(h, param)
        blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, QuantWeight)]
        if blocks:  # weights kept as a GGUF's blocks (gguf_load); their q4_1 graph comes from them
            h.update(f"blocks-graph:{BLOCKS_GRAPH}".encode())
        for name, module in blocks:
            if isinstance(module, GgufWeight):
                # The file's own bytes (and the model's row order): their `parts` would re-encode
                # every matrix into blocks just to be hashed (the 8B file: ~2.6 GB at a first start).
                for raw in module.raw_parts:
                    h.update(f"{name}:gguf:{raw.qtype}:{raw.k}".encode())
                    feed_bytes(h, raw.data)
                    if raw.order is not None:
                        feed_bytes(h, raw.order)
                continue
            for part, (zero, bits) in zip(module.parts, module.formats, strict=True):
                h.update(f"{name}:{zero}:{bits}".encode())
                for t in part.tensors():
                    feed_bytes(h, t)
    give_back_mapped(model)
    return h.hexdigest()


def feed_bytes(h: Any, tensor: torch.Tensor, slab_bytes: int = 16 << 20) -> None:
    """`tensor`'s bytes (row-major) into `h`, at most `slab_bytes` of rows copied at a time: the
    same digest as its `tobytes()`, without the whole copy (8B read in place: the head's and the
    embedding's 0.3-0.5 GB, and a reordered q/k view's, made a first start peak ~2.4 GB above
    serving, #28)."""
    t = tensor.detach().cpu()
    if t.numel() == 0:
        return
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: the raw bytes through a same-width integer view
        t = t.view(torch.int16)
    rows = t.reshape(1, -1) if t.dim() < 2 else t
    per_row = max(1, rows[0].numel() * rows.element_size())
    for slab in rows.split(max(1, slab_bytes // per_row)):
        h.update(slab.contiguous().numpy())


def give_back_mapped(model: LlamaModel) -> None:
    """A block cache's pages that the digest or the export read leave resident memory before a
    session packs its own copy of the weights (the 8B start held all 4.7 GB of them beside ONNX
    Runtime's 7.2 GB until the self-check ended); a later read faults them back."""
    mapped = MappedWeights.of(model)
    if mapped is not None:
        mapped.release_all()


def export_key(digest: str, spec: GraphSpec) -> str:
    return f"{digest[:20]}-{spec.tag}-v{GRAPH_VERSION}"


def default_cache_dir() -> Path:
    return paths.cache_dir() / "onnx"


def legacy_cache_dir() -> Path:
    """Where exports lived before the cache was shared."""
    return paths.state_dir() / "onnx"


def export_step(
    model: LlamaModel, spec: GraphSpec, cache_dir: str | Path | None = None, digest: str | None = None
) -> Path:
    """Path of the exported step graph for this model and spec, exporting it on a cache miss."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    spec = with_gqa_window(spec, model)  # a no-op where the backend probed its own providers
    digest = digest or model_hash(model)
    key = export_key(digest, spec)
    target = root / key
    if (target / META_FILE).exists():
        return target / MODEL_FILE
    if not cache_dir and (legacy_cache_dir() / key / META_FILE).exists():
        return legacy_cache_dir() / key / MODEL_FILE
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    log.info("exporting the %s step graph to %s (once per model and format)", spec.tag, target)

    def write(tmp: Path) -> None:
        # Each initializer goes to the data file as the writer makes it (the same bytes and
        # offsets onnx.save_model's external data would give), so the export holds about one
        # weight at a time, and a block cache's pages are given back after each layer. A bar on
        # a terminal; the log lines under a service manager.
        mapped = MappedWeights.of(model)

        def on_layer() -> None:
            bar.update(1)
            if mapped is not None:
                mapped.release_all()

        with ExternalData(tmp / DATA_FILE, DATA_FILE) as sink, \
                tqdm(total=model.cfg.num_layers, desc=f"exporting {spec.quantization} graph", unit="layer",
                     disable=None, leave=False) as bar:
            proto = build_step_graph(model, spec, on_layer=on_layer, sink=sink)
        give_back_mapped(model)  # the embedding and head, written after the last layer
        onnx.save_model(proto, str(tmp / MODEL_FILE))
        meta = {
            "model_hash": digest,
            "spec": spec.__dict__,
            "graph_version": GRAPH_VERSION,
            "opset": OPSET,
            "onnx": onnx.__version__,
            "nodes": len(proto.graph.node),
            "weights_bytes": (tmp / DATA_FILE).stat().st_size if (tmp / DATA_FILE).exists() else 0,
            "export_seconds": round(time.monotonic() - started, 2),
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        log.info("exported %s in %.1f s", key, meta["export_seconds"])

    try:
        publish_directory(target, write, temp_prefix=".export-")
    except TargetExists:
        if not (target / META_FILE).exists():  # not a concurrent exporter that won the race
            raise
    return target / MODEL_FILE


def read_meta(model_path: str | Path) -> dict:
    return json.loads((Path(model_path).parent / META_FILE).read_text())
