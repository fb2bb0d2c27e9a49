"""Decode steps through the CUDA-graph path's static buffers (edge_runtime.backends.cuda_graphs).

On the CPU the same forward over the same static buffers runs eagerly (no capture), so these
tests check what a graph computes: padded batches, padded key widths, block tables turned into
slots inside the step, sliding windows, and which steps are refused. On a GPU (`-m gpu`) the
real graphs are captured and replayed against the eager decode.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edge_runtime import Engine, SamplingParams
from edge_runtime.backends.cuda_graphs import DecodeGraphs, padded_batch, padded_width
from edge_runtime.backends.torch_backend import TorchBackend
from edge_runtime.model.testing import make_tiny_model_dir

PROMPTS = ["The sea is", "Once upon a time there was a robot who", "1, 2, 3,", "A long list: " + "x " * 70,
           "Hello", "What is the capital", "ab", "The quick brown fox jumps over the lazy dog and"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("llama"), num_layers=3, random_norms=True)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("mistral"), model_type="mistral", config={"sliding_window": 8})


def with_graphs(engine: Engine) -> DecodeGraphs:
    """Swap in a torch backend whose decode steps go through the graph path (on the CPU: the
    static forward, eagerly). The scratch block is taken from the pool, as on a GPU it lies
    past the pool's blocks."""
    if engine.cache.scratch_block is None:
        engine.cache.scratch_block = engine.pool.allocate()
    graphs = DecodeGraphs(engine.model, engine.cache, max_batch=16, max_context=engine.max_context)
    engine.backend = TorchBackend(engine.model, engine.cache, engine.adapters, graphs=graphs)
    return graphs


@pytest.mark.parametrize("model", ["llama_dir", "mistral_dir"])
def test_graph_path_decodes_as_the_eager_path(model: str, request: pytest.FixtureRequest) -> None:
    """Greedy tokens equal and every step's logits within float32 rounding, over batches that
    shrink as requests finish (padded to 8, 4, 2, 1 rows) and contexts that cross a width."""
    path = request.getfixturevalue(model)
    eager = Engine.load(str(path), backend="torch", dtype="float32", block_size=16)
    graphed = Engine.load(str(path), backend="torch", dtype="float32", block_size=16)
    graphs = with_graphs(graphed)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (90, 5, 40, 12, 70, 3, 20, 60)]

    def run(engine: Engine) -> tuple[list[list[int]], list[torch.Tensor]]:
        steps: list[torch.Tensor] = []
        execute = engine.backend.execute

        def spy(batch, lora=None):
            out = execute(batch, lora)
            steps.append(out.detach().float().cpu().clone())
            return out

        engine.backend.execute = spy
        ids = [engine.add_request(p, q) for p, q in zip(PROMPTS, params, strict=True)]
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                done[out.request_id] = out
        engine.backend.execute = execute
        return [done[i].candidates[0].token_ids for i in ids], steps

    want_tokens, want_steps = run(eager)
    got_tokens, got_steps = run(graphed)
    assert got_tokens == want_tokens
    assert len(got_steps) == len(want_steps)
    for got, want in zip(got_steps, want_steps, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    stats = graphed.stats()["cuda_graphs"]
    assert stats["replayed"] > 50
    assert stats["eager"].get("prefill or draft rows", 0) > 0
    # 8 rows down to 1, and a context past 128 keys (the 70-token prompt decodes 90 tokens).
    assert {b for b, _ in graphs.graphs} >= {1, 2, 4, 8}
    assert {w for _, w in graphs.graphs} >= {128, 256}


def test_padding_rows_touch_only_the_scratch_block(llama_dir: Path) -> None:
    """A step of 3 rows replays the 4-row graph: the fourth row writes the scratch block alone,
    and no block a sequence owns changes beyond the rows' own new slots."""
    engine = Engine.load(str(llama_dir), backend="torch", dtype="float32", block_size=16)
    graphs = with_graphs(engine)
    for p in PROMPTS[:3]:
        engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()  # the prefills, eagerly
    before = engine.cache.data.clone()
    engine.step()  # one decode step of three rows
    assert graphs.replayed == 1 and (4, 128) in graphs.graphs
    changed = (engine.cache.data != before).any(dim=(0, 1, 3, 4)).nonzero().flatten().tolist()
    block = engine.cache.block_size
    owned = {blk for seq in engine.scheduler.running for blk in seq.block_table}
    scratch = engine.cache.scratch_block
    assert {s // block for s in changed} <= owned | {scratch}
    assert any(s // block == scratch for s in changed)
    assert len([s for s in changed if s // block != scratch]) == 3


def test_steps_a_graph_cannot_express_run_eagerly_and_say_why(llama_dir: Path) -> None:
    from edge_runtime.lora import LoraSettings
    from tests.backends.helpers import random_adapter

    engine = Engine.load(str(llama_dir), backend="torch", dtype="float32", block_size=16)
    graphs = with_graphs(engine)
    engine.publish_adapter("alice", random_adapter(engine.model.cfg, LoraSettings(rank=2, alpha=4), seed=3))
    engine.add_request("Hello there", SamplingParams(max_tokens=4, ignore_eos=True), adapter="alice")
    while engine.has_unfinished():
        engine.step()
    assert graphs.replayed == 0
    assert graphs.eager["LoRA rows"] >= 3
    engine.generate(["Hello there"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert graphs.replayed == 3


def test_padded_sizes() -> None:
    assert [padded_batch(n, 16) for n in (1, 2, 3, 5, 9, 16, 17)] == [1, 2, 4, 8, 16, 16, None]
    assert padded_batch(20, 32) == 24
    assert [padded_width(c, 16, 2048) for c in (1, 128, 129, 600, 2048, 5000)] == [128, 128, 256, 1024, 2048, 2048]
    assert padded_width(100, 16, 40) == 48  # a cap rounded up to whole blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_replayed_graphs_decode_as_eager_on_the_gpu(llama_dir: Path, dtype: str) -> None:
    eager = Engine.load(str(llama_dir), backend="torch", device="cuda", dtype=dtype, cuda_graphs=False)
    graphed = Engine.load(str(llama_dir), backend="torch", device="cuda", dtype=dtype)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want = [o.candidates[0].token_ids for o in eager.generate(PROMPTS, params)]
    got = [o.candidates[0].token_ids for o in graphed.generate(PROMPTS, params)]
    assert got == want
    stats = graphed.stats()["cuda_graphs"]
    assert stats["broken"] is None and stats["replayed"] > 0, stats


@pytest.mark.gpu
@pytest.mark.slow  # compiling takes minutes: tools/gpu_check.py runs `gpu and not slow`
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (on the CPU Inductor's C++ build of the step "
                    "takes ~90 s; it gave the eager tokens when tried)")
def test_compiled_step_decodes_as_the_eager_path(llama_dir: Path) -> None:
    """`engine.cuda_graphs_compile`: the same static step through torch.compile, then captured,
    gives the eager tokens."""
    eager = Engine.load(str(llama_dir), backend="torch", device="cuda", dtype="float32", cuda_graphs=False)
    compiled = Engine.load(str(llama_dir), backend="torch", device="cuda", dtype="float32", cuda_graphs_compile=True,
                           max_num_seqs=4)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.candidates[0].token_ids for o in eager.generate(PROMPTS[:3], params)]
    got = [o.candidates[0].token_ids for o in compiled.generate(PROMPTS[:3], params)]
    assert got == want
    stats = compiled.stats()["cuda_graphs"]
    assert stats["broken"] is None and stats["replayed"] > 0, stats
