"""The door of the generate op: each client's generates in flight, its fair share of a backlog,
and the bounded wait of a queued generate. Asks the AdmissionController (a pure state machine)
for verdicts; knows nothing of the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

from daemon.admission import AdmissionController
from daemon.calls import GenerateCall
from daemon.wire import ProtocolError


class InferenceGate:
    def __init__(self) -> None:
        self.generating: Counter[Any] = Counter()  # generates in flight (admission included) per client
        self.queued = 0  # generates waiting for admission

    def enter(self, call: GenerateCall) -> None:
        self.generating[call.client] += 1

    def leave(self, call: GenerateCall) -> None:
        self.generating[call.client] -= 1
        if self.generating[call.client] <= 0:
            del self.generating[call.client]

    def light_client(self, call: GenerateCall) -> bool:
        """A client with no other generate in flight, or fewer than the average client: a
        backlog it did not make must not refuse it (one flooding client would otherwise fail
        everyone else's requests). The server's `max_inflight` still bounds the total."""
        mine = self.generating[call.client] - 1  # not counting this one
        others = sum(self.generating.values()) - 1
        return mine == 0 or mine * len(self.generating) < others

    async def admit(self, admission: AdmissionController | None, call: GenerateCall, wait_s: float,
                    retry_after_s: float) -> None:
        if admission is None:
            return
        verdict = admission.admit("inference")
        if verdict.action != "allow" and self.light_client(call) and admission.device_allows_inference():
            return  # only the backlog says no, and this client's share of it is below average
        if verdict.action == "queue":
            self.queued += 1
            deadline = time.monotonic() + wait_s
            try:
                while verdict.action == "queue" and time.monotonic() < deadline and not call.cancel_reason:
                    await asyncio.sleep(0.05)
                    verdict = admission.admit("inference")
            finally:
                self.queued -= 1
            if verdict.action == "queue" and not call.cancel_reason:
                verdict = admission.admit("inference")
                if verdict.action == "queue":
                    retry = retry_after_s
                    raise ProtocolError("admission_rejected", f"waited {wait_s:g} s "
                                        f"for admission ({verdict.reason}); retry later", retry_after_s=retry,
                                        details={"state": admission.state.value})
        if verdict.action == "reject":
            retry = verdict.retry_after_s or retry_after_s
            raise ProtocolError("admission_rejected", f"the device is under pressure ({verdict.reason}); "
                                f"retry in {retry:g} s", retry_after_s=retry,
                                details={"state": admission.state.value, "reason": admission.decision.reason})
