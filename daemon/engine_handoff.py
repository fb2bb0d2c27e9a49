"""What the engine thread hands the event loop: a stream's tokens of one or more iterations
(`Tokens`, for a `GenerationSink`), run in order with every other result by `run_batch`, and
futures settled on the loop (`settle`). daemon/engine_thread.py decides what and when.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from edge_runtime.outputs import RequestOutput, TokenEvent

log = logging.getLogger("daemon.engine_thread")


class GenerationSink(Protocol):
    """Receives one request's events on the event loop."""

    def on_tokens(self, events: list[TokenEvent]) -> None: ...

    def on_finished(self, output: RequestOutput | None, aborted: str | None,
                    error: BaseException | None) -> None: ...


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
