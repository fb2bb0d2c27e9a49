"""One request must never fail another: a fault in one request's forward rows, sampling,
detokenising or callback fails that request alone (finish reason "error", `error` set), every
other request's tokens stay what they would have been, and only a fault no request caused
(the forward fails even for a one-token probe) is raised from `Engine.step()`.

Faults are injected into the real path (the tiny model's engine) by wrapping one of its parts."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_runtime import Engine, SamplingParams
from edge_runtime.errors import EngineBroken

from .helpers import make_engine

PROMPTS = [f"Bystander {i} asks about rivers and {'mountains ' * i}" for i in range(4)]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
MARK = "poisoned request"


@pytest.fixture(scope="module")
def alone(tiny_model_dir: Path) -> list[list[int]]:
    engine = make_engine(tiny_model_dir)
    return [engine.generate(p, GREEDY)[0].token_ids for p in PROMPTS]


def run_all(engine: Engine) -> dict[str, object]:
    outputs = {}
    for _ in range(500):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            assert out.request_id not in outputs, "two final outputs for one request"
            outputs[out.request_id] = out
    assert not engine.has_unfinished()
    return outputs


def submit_mix(engine: Engine, bad_params: SamplingParams = GREEDY) -> tuple[list[str], str]:
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
    bad = engine.add_request(MARK, bad_params)
    ids += [engine.add_request(p, GREEDY) for p in PROMPTS[2:]]
    return ids, bad


def assert_failed_alone(engine: Engine, outputs: dict, ids: list[str], bad: str, alone: list[list[int]],
                        words: str) -> None:
    assert [outputs[i].token_ids for i in ids] == alone, "a bystander's tokens changed"
    assert all(outputs[i].error is None for i in ids)
    failed = outputs[bad]
    assert failed.error is not None and words in failed.error, failed.error
    assert all(c.finish_reason == "error" for c in failed.candidates)
    assert engine.requests == {} and engine.pool.num_used == 0


def test_a_request_whose_sampling_raises_fails_alone(tiny_model_dir: Path, alone, monkeypatch) -> None:
    import edge_runtime.commit as engine_module

    real = engine_module.sample_next

    def sample(logits, params, generator):
        if params.seed == 666:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, params, generator)

    monkeypatch.setattr(engine_module, "sample_next", sample)
    engine = make_engine(tiny_model_dir)
    ids, bad = submit_mix(engine, SamplingParams(max_tokens=12, temperature=0.7, seed=666, n=3))
    outputs = run_all(engine)
    assert_failed_alone(engine, outputs, ids, bad, alone, "probability tensor")
    # The engine keeps serving.
    assert engine.generate(PROMPTS[0], GREEDY)[0].token_ids == alone[0]


def test_a_request_whose_detokenising_or_callback_raises_fails_alone(tiny_model_dir: Path, alone) -> None:
    engine = make_engine(tiny_model_dir)
    ids, bad = submit_mix(engine)
    decoder = engine.requests[bad].seqs[0].decoder

    class Exploding:
        def step(self, token: int) -> str:
            if len(engine.requests[bad].seqs[0].token_ids) > len(engine.requests[bad].prompt_ids) + 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
            return decoder.step(token)

    engine.requests[bad].seqs[0].decoder = Exploding()
    outputs = run_all(engine)
    assert_failed_alone(engine, outputs, ids, bad, alone, "UnicodeDecodeError")
    assert len(outputs[bad].token_ids) == 4  # the tokens before the fault are kept in the output

    def callback(event) -> None:
        raise ValueError("the app's token callback broke")

    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
    bad = engine.add_request(MARK, GREEDY, on_token=callback)
    ids += [engine.add_request(p, GREEDY) for p in PROMPTS[2:]]
    assert_failed_alone(engine, run_all(engine), ids, bad, alone, "callback broke")


def poison_forward(engine: Engine, always: bool = False) -> list[int]:
    """Make the backend raise on any batch that holds the poisoned request (or on every batch)."""
    execute = engine.backend.execute
    calls = []

    def faulty(batch, lora=None):
        calls.append(len(batch.items))
        if always or any(item.seq.request.prompt == MARK for item in batch.items):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return execute(batch)

    engine.backend.execute = faulty
    return calls


def test_a_request_that_breaks_the_forward_is_found_and_fails_alone(tiny_model_dir: Path, alone) -> None:
    engine = make_engine(tiny_model_dir)
    calls = poison_forward(engine)
    ids, bad = submit_mix(engine)
    outputs = run_all(engine)
    assert_failed_alone(engine, outputs, ids, bad, alone, "forward failed on this request")
    assert max(calls) >= 5 and 1 in calls  # the whole bin first, then parts down to the culprit


def test_a_request_alone_that_breaks_the_forward_fails_but_the_probe_keeps_the_engine(tiny_model_dir: Path,
                                                                                       alone) -> None:
    engine = make_engine(tiny_model_dir)
    poison_forward(engine)
    for _ in range(5):  # more than the daemon's three-in-a-row limit: none of these count
        bad = engine.add_request(MARK, GREEDY)
        outputs = run_all(engine)
        assert outputs[bad].error is not None and outputs[bad].candidates[0].finish_reason == "error"
    assert engine.generate(PROMPTS[1], GREEDY)[0].token_ids == alone[1]
    assert engine.pool.num_used == 0


def test_a_forward_that_fails_for_everyone_raises_engine_broken(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    poison_forward(engine, always=True)
    engine.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(EngineBroken, match="illegal memory access"):
        engine.step()


def test_a_request_that_cannot_be_built_leaves_nothing_behind(tiny_model_dir: Path, monkeypatch) -> None:
    engine = make_engine(tiny_model_dir)
    made = []
    real = engine.tokenizer.stream_decoder

    def stream_decoder():
        made.append(1)
        if len(made) == 2:
            raise RuntimeError("decoder failed")
        return real()

    monkeypatch.setattr(engine.tokenizer, "stream_decoder", stream_decoder)
    with pytest.raises(RuntimeError):
        engine.add_request("hello", SamplingParams(temperature=1.0, seed=5, n=3), request_id="half")
    assert "half" not in engine.requests
    assert not engine.scheduler.waiting and not engine.has_unfinished()


def test_sampling_extremes_the_protocol_admits_give_greedy_tokens(tiny_model_dir: Path, alone) -> None:
    """Temperatures and top_p down to the smallest positive double: no NaN, the argmax wins."""
    engine = make_engine(tiny_model_dir)
    extremes = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=t, top_p=p, seed=1)
                for t, p in ((1e-39, 1.0), (5e-324, 1.0), (1.0, 1e-300), (100.0, 5e-324), (1e-300, 5e-324))]
    for params in extremes:
        out = engine.generate(PROMPTS[0], params)[0]
        assert out.error is None and out.token_ids == alone[0], params
