"""A Q4_K_M GGUF loaded for a GPU keeps its blocks: the engine's model holds `QuantWeight`s (not
the file's in-place bytes, which CPU kernels read) in the device's memory, float tensors in the
model dtype, and no float copy of a matrix. On the CPU the same load in bfloat16 checks every
device-independent part; the GPU case runs where CUDA is."""

from __future__ import annotations

import pytest
import torch

from edge_runtime import Engine, loading
from edge_runtime.config import EngineConfig
from edge_runtime.model.gguf_weight import GgufWeight
from edge_runtime.model.qweights import QuantWeight
from tests.engine.helpers import engine_logits_for
from tests.model.quant_helpers import Q4_K_M_LIKE, private_cache, tiny_quant_gguf  # noqa: F401 (autouse fixture)

NO_CUDA = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    return tiny_quant_gguf(tmp_path_factory.mktemp("q4km"), Q4_K_M_LIKE, tie=True)


def test_a_gguf_for_a_gpu_is_never_read_in_place(q4km, monkeypatch, caplog):
    _, path = q4km
    config = EngineConfig(model=str(path), backend="torch", device="cpu", torch_weights="auto",
                          memory_budget_bytes=1, finetune_memory_bytes=1 << 20)
    assert loading.reads_in_place(config)  # on the CPU a budget this tight takes the file's bytes
    monkeypatch.setattr(loading, "engine_device", lambda _config: torch.device("cuda"))
    assert not loading.reads_in_place(config)
    with caplog.at_level("WARNING", logger="edge_runtime.loading"):
        assert not loading.reads_in_place(config.replace(torch_weights="gguf"))
    assert "CPU only" in caplog.text


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(NO_CUDA, reason="needs CUDA")])])
def test_engine_loads_a_q4_k_m_gguf_as_blocks_in_bfloat16(q4km, device):
    _, path = q4km
    engine = Engine.load(str(path), device=device, dtype="bfloat16", backend="torch", kv_cache_bytes=4 << 20,
                         block_size=4, max_batched_tokens=8, cost_profile="off")
    model = engine.model
    weights = [m for m in model.modules() if isinstance(m, QuantWeight)]
    assert model.dtype == torch.bfloat16 and len(weights) == 1 + 4 * model.cfg.num_layers  # tied head
    assert not any(isinstance(m, GgufWeight) for m in weights)
    assert all(m.device.type == device for m in weights)
    # The blocks as the file holds them (float16 scales stay float16), and no float matrix anywhere.
    assert all(p.scales.dtype == torch.float16 for m in weights for p in m.parts)
    assert all(p.dim() == 1 and p.dtype == torch.bfloat16 for p in model.parameters())
    _, generated = engine_logits_for(engine, [5, 9, 31, 7], steps=4)
    assert len(generated) == 4
