"""engine.keep_alive on the engine thread itself (tiny model, in process): an idle engine is
unloaded and nothing keeps it alive, the next command that needs it loads it again, commands
that need no model are answered parked, requests queued during the reload are all answered, and
what holds the model (or a negative keep_alive) keeps it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from daemon.engine_thread import EngineThread
from daemon.keep_alive import LOADED, UNLOADED, KeepAlive, ParkedEngine
from edge_runtime.outputs import RequestOutput, TokenEvent
from edge_runtime.sampling import SamplingParams


class Sink:
    def __init__(self) -> None:
        self.tokens: list[TokenEvent] = []
        self.done: asyncio.Future[tuple[Any, Any, Any]] = asyncio.get_running_loop().create_future()

    def on_tokens(self, events: list[TokenEvent]) -> None:
        self.tokens.extend(events)

    def on_finished(self, output: RequestOutput | None, aborted: str | None, error: BaseException | None) -> None:
        self.done.set_result((output, aborted, error))


def loader(model_dir: Path, adapters: Path | None):
    def load():
        from edge_runtime.engine import Engine

        return Engine.load(str(model_dir), dtype="float32", kv_cache_bytes=8 << 20,
                           adapters_root=str(adapters) if adapters is not None else None)
    return load


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 120))


async def greedy(thread: EngineThread, request_id: str, prompt: str = "hello there") -> list[int]:
    sink = Sink()
    await thread.submit(request_id, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), sink)
    output, aborted, error = await sink.done
    assert aborted is None and error is None, (aborted, error)
    return list(output.candidates[0].token_ids)


async def wait_state(keep: KeepAlive, state: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while keep.state != state:
        assert time.monotonic() < deadline, f"still {keep.state}, never {state}"
        await asyncio.sleep(0.05)


def test_idle_engine_is_unloaded_freed_and_loaded_again_for_the_next_request(tiny_model: Path, tmp_path: Path) -> None:
    async def main() -> None:
        keep = KeepAlive(keep_alive_s=0.3)
        thread = EngineThread(loader(tiny_model, tmp_path), asyncio.get_running_loop(), keep_alive=keep,
                              idle_wait_s=0.05)
        await thread.start()  # the engine is not kept here: the thread must hold the only reference
        before = await greedy(thread, "a")
        await wait_state(keep, UNLOADED)
        assert keep.unloads == 1 and keep.reloads == 0
        assert not keep.released_engine_referenced, "something still references the unloaded engine"
        assert "idle" in keep.last_unload_reason
        assert thread.stats["kv_cache_bytes"] == 0 and thread.stats["model"]
        after = await greedy(thread, "b")
        assert after == before
        assert keep.reloads == 1 and keep.last_reload_s is not None and keep.last_reload_s > 0
        thread.stop()
        assert await thread.join(10)

    run(main())


def test_commands_that_need_no_model_are_answered_parked(tiny_model: Path, tmp_path: Path) -> None:
    async def main() -> None:
        keep = KeepAlive(keep_alive_s=0.0)
        thread = EngineThread(loader(tiny_model, tmp_path), asyncio.get_running_loop(), keep_alive=keep,
                              idle_wait_s=0.05)
        await thread.start()
        await wait_state(keep, UNLOADED)
        seen = await thread.call(lambda e: "loaded", parked=lambda p: type(p).__name__)
        assert seen == ParkedEngine.__name__
        assert await thread.call(lambda e: e.adapters.users(), parked=lambda p: p.adapters.users()) == []
        assert await thread.abort("nothing-in-flight", "cancelled") is False
        assert keep.reloads == 0 and keep.state == UNLOADED
        thread.stop()  # stopping an unloaded engine loads nothing
        assert await thread.join(10)
        assert keep.reloads == 0

    run(main())


def test_requests_queued_while_unloaded_are_all_answered_after_one_reload(tiny_model: Path, tmp_path: Path) -> None:
    async def main() -> None:
        keep = KeepAlive(keep_alive_s=0.2)
        thread = EngineThread(loader(tiny_model, tmp_path), asyncio.get_running_loop(), keep_alive=keep,
                              idle_wait_s=0.05)
        await thread.start()
        expected = await greedy(thread, "warm")
        await wait_state(keep, UNLOADED)
        results = await asyncio.gather(*(greedy(thread, f"r{i}") for i in range(6)))
        assert all(r == expected for r in results)
        assert keep.reloads == 1, keep.history
        thread.stop()
        assert await thread.join(10)

    run(main())


def test_what_holds_the_model_keeps_it_and_negative_keep_alive_never_unloads(tiny_model: Path, tmp_path: Path) -> None:
    async def main() -> None:
        held = {"why": "fine-tuning in progress"}
        keep = KeepAlive(keep_alive_s=0.1, holds=lambda: held["why"])
        never = KeepAlive(keep_alive_s=-1.0)
        loop = asyncio.get_running_loop()
        threads = [EngineThread(loader(tiny_model, tmp_path / "a"), loop, keep_alive=keep, idle_wait_s=0.05),
                   EngineThread(loader(tiny_model, tmp_path / "b"), loop, keep_alive=never, idle_wait_s=0.05)]
        for thread in threads:
            await thread.start()
        await asyncio.sleep(1.0)
        assert keep.state == LOADED and never.state == LOADED
        held["why"] = None  # the hold ends: keep_alive counts from then
        await wait_state(keep, UNLOADED)
        assert never.state == LOADED and never.unloads == 0
        for thread in threads:
            thread.stop()
            assert await thread.join(10)

    run(main())


def test_adapters_held_only_in_memory_are_never_unloaded(tiny_model: Path) -> None:
    async def main() -> None:
        keep = KeepAlive(keep_alive_s=0.0)
        thread = EngineThread(loader(tiny_model, None), asyncio.get_running_loop(), keep_alive=keep,
                              idle_wait_s=0.05)
        await thread.start()
        await asyncio.sleep(0.5)
        assert keep.state == LOADED and keep.refused and not keep.enabled
        thread.stop()
        assert await thread.join(10)

    run(main())


def test_memory_pressure_is_admissions_memory_rung_with_its_figures() -> None:
    from daemon.admission import AdmissionController, AdmissionSignals
    from daemon.keep_alive import memory_pressure

    admission = AdmissionController()
    admission.observe(AdmissionSignals(memory_headroom_mb=9000.0))
    assert memory_pressure(admission) is None
    admission.observe(AdmissionSignals(memory_headroom_mb=3000.0))  # shed_finetune: not pressure enough
    assert memory_pressure(admission) is None
    admission.observe(AdmissionSignals(memory_headroom_mb=812.0))
    assert memory_pressure(admission) == "memory headroom 812 MiB < 1024 MiB"
    admission.observe(AdmissionSignals(memory_headroom_mb=1500.0))  # held until the exit limit
    assert memory_pressure(admission) == "memory headroom 1500 MiB < 2048 MiB"
    keep = KeepAlive(keep_alive_s=300.0, pressure=memory_pressure(admission))
    assert keep.unload_reason(idle_s=0.0) == "device memory pressure (memory headroom 1500 MiB < 2048 MiB)"
    assert KeepAlive(keep_alive_s=-1.0, pressure="x").unload_reason(idle_s=1e9) is None
    assert memory_pressure(None) is None


def test_keep_alive_reloads_with_sighup_and_shows_in_metrics() -> None:
    from daemon.config import RELOADABLE, load_config
    from daemon.metrics import DaemonMetrics

    assert "engine.keep_alive" in RELOADABLE
    assert load_config(environ={}).keep_alive.keep_alive == 300.0
    assert load_config(environ={"MACE_ENGINE_KEEP_ALIVE": "-1"}).keep_alive.keep_alive == -1.0
    keep = KeepAlive(keep_alive_s=0.0)
    keep.unloaded("idle for 1.0 s (keep_alive 0 s)", 0.5, 900 << 20, 300 << 20, referenced=False)
    keep.reloaded(2.25)
    text = DaemonMetrics().render({"daemon": {"state": "serving"}, "keep_alive": keep.status()}, []).decode()
    assert 'mace_model_state{state="loaded"} 1.0' in text and 'mace_model_state{state="unloaded"} 0.0' in text
    assert "mace_model_unloads_total 1.0" in text and "mace_model_last_reload_seconds 2.25" in text
