"""A model shell built on the meta device (what every loader and the size check build before the
weights are read): its rotary tables have the shapes the real ones have, and building it does not
import torch._dynamo (computing rows on the meta device would, ~1-2 s of every daemon start)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edge_runtime.model.config import ModelConfig
from edge_runtime.model.llama import LlamaModel, RotaryTable
from edge_runtime.model.testing import make_tiny_model_dir
from tests.families.test_families import FAMILIES

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_meta_shell_tables_have_the_real_tables_shapes(name, tmp_path):
    folder = make_tiny_model_dir(tmp_path / name, **FAMILIES[name])
    cfg = ModelConfig.from_dir(folder)
    # Past Phi-3's switch (16 in the family matrix): its table holds short rows, then long ones.
    for positions in (8, 40):
        real = LlamaModel(cfg, max_positions=positions)
        with torch.device("meta"):
            shell = LlamaModel(cfg, max_positions=positions)
        want = {n: (tuple(b.shape), b.dtype) for n, b in real.named_buffers()}
        got = {n: (tuple(b.shape), b.dtype) for n, b in shell.named_buffers()}
        assert got == want
        assert [r.short_rows for r in shell.ropes] == [r.short_rows for r in real.ropes]
        assert all(b.device.type == "meta" for b in shell.buffers())


def test_a_meta_table_keeps_the_offsets_of_a_real_one(tmp_path):
    cfg = ModelConfig.from_dir(make_tiny_model_dir(tmp_path / "phi3", **FAMILIES["phi3"]))
    real = RotaryTable(cfg, max_positions=40)
    with torch.device("meta"):
        shell = RotaryTable(cfg, max_positions=40)
    assert [shell.offset(n) for n in (1, 16, 17, 40)] == [real.offset(n) for n in (1, 16, 17, 40)]


def test_building_a_meta_shell_does_not_import_torch_dynamo(tmp_path):
    folder = make_tiny_model_dir(tmp_path / "llama3", rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    code = ("import sys, torch\n"
            "from edge_runtime.model.config import ModelConfig\n"
            "from edge_runtime.model.llama import LlamaModel\n"
            f"cfg = ModelConfig.from_dir({str(folder)!r})\n"
            "with torch.device('meta'):\n"
            "    LlamaModel(cfg)\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_table_keeps_half_of_each_row_and_looks_up_the_whole_rows_bit_for_bit(name, tmp_path):
    from edge_runtime.model import family

    cfg = ModelConfig.from_dir(make_tiny_model_dir(tmp_path / name, **FAMILIES[name]))
    for key, table in zip(cfg.rope_tables, LlamaModel(cfg, max_positions=40).ropes, strict=True):
        assert table.cos_half.shape[1] * 2 == cfg.rotary_dim  # half the bytes of the whole rows (#28)
        params = family.rope_set(cfg.hf_config, key)
        rope_type = params.get("rope_type", "default")
        if rope_type != "default" or table.switch is not None:
            continue  # scaled or LongRoPE rows: the family tests hold them against transformers
        dim = cfg.rotary_dim
        base = params.get("rope_theta", getattr(cfg.hf_config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        emb = torch.arange(40, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((emb, emb), dim=-1)
        rows = torch.tensor([0, 3, 17, 39])
        cos, sin = table.lookup(rows, torch.float32)
        assert torch.equal(cos, emb.cos()[rows]) and torch.equal(sin, emb.sin()[rows])
