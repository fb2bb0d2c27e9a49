"""A command's reply never waits behind a background calibration shape (issue #28: a cached 8B
start's first command, the fleet adapter's newest version, was answered 84 s late, behind shapes
the engine thread measured in the same turn): the shape waits for quiet after commands as after
generations, and the turn's replies go out before it. The fake shape blocks until the reply has
arrived, so the old order runs into the failure bound (20 s); nothing here waits on a guess."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from daemon.engine_thread import EngineThread
from tests.daemon.test_engine_thread import loader, run


def test_a_command_is_answered_before_the_next_calibration_shape(tiny_model: Path) -> None:
    entered = threading.Event()  # the first shape ran: the engine thread is calibrating
    replied = threading.Event()  # the command's reply reached the event loop
    shapes: list[bool] = []  # per shape after the first: whether the reply arrived while it ran

    def load():
        engine = loader(tiny_model)()
        engine._calibration = object()  # a calibration with shapes left: `calibrating` is True

        def calibrate_step(interrupted=lambda: False) -> None:
            if entered.is_set():
                # As a real shape does, give way to a waiting command (between forwards); the old
                # order holds the reply until this shape returns, so the wait runs out.
                deadline = time.monotonic() + 20
                while not replied.is_set() and time.monotonic() < deadline:
                    if interrupted():
                        return  # the shape is left for a later turn
                    time.sleep(0.01)
                shapes.append(replied.is_set())
                engine._calibration = None
            entered.set()
        engine.calibrate_step = calibrate_step
        return engine

    async def main() -> None:
        thread = EngineThread(load, asyncio.get_running_loop(), calibration_quiet_s=0.05)
        await thread.start()
        while not entered.is_set():
            await asyncio.sleep(0.01)
        assert await thread.call(lambda engine: "newest") == "newest"
        replied.set()
        while not shapes:
            await asyncio.sleep(0.01)
        thread.stop()
        assert await thread.join(5)

    run(main())
    assert shapes == [True], shapes
