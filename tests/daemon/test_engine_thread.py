"""The engine thread: requests in through the queue, tokens and results out on the event loop,
aborts with reasons, calls between iterations, and a broken engine reported instead of hanging."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from daemon.engine_thread import MAX_CONSECUTIVE_STEP_FAILURES, EngineFailed, EngineThread
from edge_runtime.errors import BadRequest
from edge_runtime.outputs import RequestOutput, TokenEvent


class Sink:
    def __init__(self) -> None:
        self.tokens: list[TokenEvent] = []
        self.done: asyncio.Future[tuple[Any, Any, Any]] = asyncio.get_running_loop().create_future()

    def on_tokens(self, events: list[TokenEvent]) -> None:
        assert not self.done.done(), "tokens after the end"
        self.tokens.extend(events)

    def on_finished(self, output: RequestOutput | None, aborted: str | None, error: BaseException | None) -> None:
        self.done.set_result((output, aborted, error))


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def loader(model_dir: Path):
    def load():
        from edge_runtime.engine import Engine

        return Engine.load(str(model_dir), dtype="float32", kv_cache_bytes=8 << 20)
    return load


def test_tokens_and_result_reach_the_event_loop(tiny_model: Path) -> None:
    from edge_runtime.sampling import SamplingParams

    async def main() -> None:
        thread = EngineThread(loader(tiny_model), asyncio.get_running_loop())
        await thread.start()
        sinks = [Sink() for _ in range(4)]
        for i, sink in enumerate(sinks):
            await thread.submit(f"r{i}", "hello", SamplingParams(max_tokens=6, ignore_eos=True), sink)
        for sink in sinks:
            output, aborted, error = await sink.done
            assert aborted is None and error is None and output.finished
            assert len(output.candidates[0].token_ids) == 6
            streamed = "".join(e.text for e in sink.tokens)
            assert streamed == output.text
        stats = await thread.call(lambda e: e.stats())
        assert stats["requests_in_flight"] == 0 and thread.model_info["weights_bytes"] > 0
        thread.stop()
        assert await thread.join(5)

    run(main())


def test_bad_request_fails_the_submit_future(tiny_model: Path) -> None:
    from edge_runtime.sampling import SamplingParams

    async def main() -> None:
        thread = EngineThread(loader(tiny_model), asyncio.get_running_loop())
        await thread.start()
        with pytest.raises(BadRequest):
            await thread.submit("bad id with spaces", "hi", SamplingParams(), Sink())
        thread.stop()
        await thread.join(5)

    run(main())


def test_abort_and_stop_finish_requests_with_their_reason(tiny_model: Path) -> None:
    from edge_runtime.sampling import SamplingParams

    async def main() -> None:
        thread = EngineThread(loader(tiny_model), asyncio.get_running_loop())
        await thread.start()
        long = SamplingParams(max_tokens=1000, ignore_eos=True)
        first, second = Sink(), Sink()
        await thread.submit("a", "hello", long, first)
        await thread.submit("b", "hello", long, second)
        assert await thread.abort("a", "cancelled") is True
        output, aborted, _ = await first.done
        assert aborted == "cancelled" and output.candidates[0].finish_reason == "abort"
        assert await thread.abort("a", "cancelled") is False  # already gone: idempotent
        thread.stop("shutting_down")
        _, aborted, _ = await second.done
        assert aborted == "shutting_down"
        assert await thread.join(5)
        with pytest.raises(EngineFailed):
            await thread.call(lambda e: None)

    run(main())


class BrokenEngine:
    """Accepts requests, then every iteration raises (a CUDA error, a bug)."""

    def __init__(self) -> None:
        self.requests: dict[str, Any] = {}
        self.iterations = 0
        self.last_iteration_s = 0.0
        self.scheduler = type("S", (), {"waiting": [], "running": []})()
        self.model = type("M", (), {"parameters": lambda self: [], "buffers": lambda self: []})()

    def add_request(self, prompt: Any, params: Any, *, request_id: str, on_token: Any) -> str:
        self.requests[request_id] = object()
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        raise RuntimeError("device lost")

    def abort(self, request_id: str) -> RequestOutput:
        self.requests.pop(request_id)
        return RequestOutput(request_id, "", [])


def test_a_failing_engine_fails_its_requests_then_reports_itself_dead() -> None:
    async def main() -> None:
        died: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        thread = EngineThread(BrokenEngine, asyncio.get_running_loop(),
                              on_dead=lambda exc: died.set_result(exc))
        await thread.start()
        for attempt in range(MAX_CONSECUTIVE_STEP_FAILURES):
            sink = Sink()
            await thread.submit(f"r{attempt}", "hi", None, sink)  # type: ignore[arg-type]
            output, aborted, error = await sink.done
            assert output is None and isinstance(error, EngineFailed) and "device lost" in str(error)
        assert "device lost" in str(await died)
        assert await thread.join(5)

    run(main())


def test_a_model_that_fails_to_load_fails_start() -> None:
    def load() -> Any:
        raise FileNotFoundError("no weights")

    async def main() -> None:
        thread = EngineThread(load, asyncio.get_running_loop())
        with pytest.raises(FileNotFoundError):
            await thread.start()

    run(main())
