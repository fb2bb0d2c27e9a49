"""Sampling on a GPU (edge_runtime.device_sampling, issue #33 item 2), where one is present: the
same tokens as the same pass on the CPU for the same logits, and whole requests through a CUDA
engine whose plain rows never fell back to the host. Skipped without CUDA."""

from __future__ import annotations

import time

import pytest
import torch

from edge_runtime import Engine, SamplingParams
from edge_runtime.constraints import Constraint
from edge_runtime.device_sampling import RowChoice, choose_rows
from edge_runtime.sampling import choose

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def _rows(n: int) -> list[RowChoice]:
    kinds = [SamplingParams(), SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.0, top_k=40),
             SamplingParams(temperature=0.7, top_p=0.9, logprobs=3),
             SamplingParams(temperature=1.1, top_k=20, top_p=0.8, logit_bias={5: 2.0}, presence_penalty=0.4),
             SamplingParams(logprobs=5, frequency_penalty=0.3), SamplingParams(temperature=5e-324),
             SamplingParams(temperature=1.0, top_p=5e-324)]
    return [RowChoice(i, kinds[i % len(kinds)], {3: 2, 9: 1}, key=1000 + i, step=i) for i in range(n)]


@pytest.mark.parametrize("vocab", [49152, 128256])
def test_the_gpu_draws_the_tokens_the_cpu_draws(vocab):
    logits = torch.randn(16, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
    rows = _rows(16)
    on_cpu = choose_rows(logits, rows)
    on_gpu = choose_rows(logits.cuda(), rows)
    assert [c.token for c in on_gpu] == [c.token for c in on_cpu]
    for a, b in zip(on_gpu, on_cpu, strict=True):
        assert a.error is None and b.error is None
        if b.logprobs is not None:
            assert abs(a.logprobs[0] - b.logprobs[0]) < 1e-5
            assert [t for t, _ in a.logprobs[1]] == [t for t, _ in b.logprobs[1]]


def test_a_step_of_16_rows_on_the_gpu_against_the_host_path(capsys):
    """Not a bar, a figure: the device pass against `.cpu()` plus the host's per-row choice."""
    for vocab in (49152, 128256):
        logits = torch.randn(16, vocab, device="cuda")
        for name, params in (("greedy", SamplingParams()), ("top-p", SamplingParams(temperature=0.8, top_p=0.9))):
            rows = [RowChoice(i, params, {}, key=i, step=0) for i in range(16)]
            choose_rows(logits, rows)
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(20):
                choose_rows(logits, rows)
            device_ms = (time.perf_counter() - started) / 20 * 1e3
            gen = torch.Generator().manual_seed(0)
            started = time.perf_counter()
            for _ in range(3):
                host = logits.cpu()
                for i in range(16):
                    choose(host[i], params, gen)
            host_ms = (time.perf_counter() - started) / 3 * 1e3
            with capsys.disabled():
                print(f"\ndevice_sampling {torch.cuda.get_device_name()} 16x{vocab} {name}: "
                      f"device {device_ms:.2f} ms/step, host {host_ms:.2f} ms/step")


PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "Hello there", "abc abc abc"]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    def engine(mode: str) -> Engine:
        return Engine.load(str(tiny_model_dir), device="cuda", dtype="float32", kv_cache_bytes=8 << 20,
                           block_size=8, backend="torch", cost_profile="off", device_sampling=mode)

    return engine("auto"), engine("off")


def outs(e: Engine, params: SamplingParams):
    return [[(c.token_ids, c.finish_reason) for c in o.candidates] for o in e.generate(PROMPTS, params)]


def test_a_cuda_engine_chooses_plain_rows_on_the_gpu(engines):
    on, off = engines
    greedy = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    assert outs(on, greedy) == outs(off, greedy)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=4, n=2, ignore_eos=True)
    assert outs(on, seeded) == outs(on, seeded)
    stats = on.committer.sampling_stats
    assert stats["device_rows"] > 0
    assert stats["device_failures"] == 0, stats["last_device_failure"]


def test_a_cuda_engine_copies_only_constrained_rows_to_the_host(engines):
    on, off = engines
    regex = SamplingParams(max_tokens=20, constraint=Constraint("regex", r"[a-c]{3,9}"))
    assert outs(on, regex) == outs(off, regex)
    stats = on.committer.sampling_stats
    assert stats["host_rows_grammar"] > 0 and stats["device_failures"] == 0, stats
