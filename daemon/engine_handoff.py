"""What the engine thread hands the event loop: a stream's tokens of one or more iterations
(`Tokens`), run in order with every other result by `run_batch`, and futures settled on the
loop (`settle`). Plain data and functions; daemon/engine_thread.py decides when.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from daemon.engine_thread import GenerationSink
    from edge_runtime.outputs import TokenEvent

log = logging.getLogger("daemon.engine_thread")


@dataclass(eq=False)
class Tokens:
    sink: GenerationSink
    events: list[TokenEvent]


def run_batch(batch: list[Callable[[], None] | Tokens]) -> None:
    for item in batch:
        try:
            if isinstance(item, Tokens):
                item.sink.on_tokens(item.events)
            else:
                item()
        except Exception:  # one broken consumer must not starve the others of their tokens
            log.exception("delivering engine results failed")


def settle(future: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)
