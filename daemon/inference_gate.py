"""The door of the generate op: each client's generates in flight, its quota of sequences, the
per-request caps, its fair share of a backlog, and the bounded wait of a queued generate. Asks the AdmissionController (a pure state machine)
for verdicts; knows nothing of the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

from daemon.admission import AdmissionController
from daemon.calls import GenerateCall
from daemon.limits import LimitSettings, quota_key
from daemon.wire import GenerateArgs, ProtocolError


class InferenceGate:
    def __init__(self) -> None:
        self.generating: Counter[Any] = Counter()  # generates in flight (admission included) per client
        self.queued = 0  # generates waiting for admission
        # Sequences in flight per quota key (daemon.limits.quota_key), and each call's share.
        self.sequences: Counter[Any] = Counter()
        self._held: dict[int, tuple[Any, int]] = {}

    def check(self, call: GenerateCall, args: GenerateArgs, limits: LimitSettings) -> None:
        """Refuse a generate over the per-request caps or its client's sequence quota; nothing
        is counted (enter() does)."""
        if args.max_tokens is not None and args.max_tokens > limits.max_tokens_ceiling:
            raise ProtocolError("bad_request", f"max_tokens {args.max_tokens} exceeds this daemon's ceiling of "
                                f"{limits.max_tokens_ceiling} (limits.max_tokens_ceiling)", param="max_tokens")
        check_sequences(args.n, limits)
        key = quota_key(call.client, call.principal)
        if self.sequences[key] + args.n > limits.max_sequences_per_client:
            raise ProtocolError("busy", f"this client has {self.sequences[key]} sequences in flight; at most "
                                f"{limits.max_sequences_per_client} (limits.max_sequences_per_client) are "
                                "allowed, whatever the number of sockets or connections", retry_after_s=0.5)

    def enter(self, call: GenerateCall, n: int = 1) -> None:
        self.generating[call.client] += 1
        key = quota_key(call.client, call.principal)
        self.sequences[key] += n
        self._held[id(call)] = (key, n)

    def leave(self, call: GenerateCall) -> None:
        self.generating[call.client] -= 1
        if self.generating[call.client] <= 0:
            del self.generating[call.client]
        key, n = self._held.pop(id(call), (None, 0))
        if key is not None:
            self.sequences[key] -= n
            if self.sequences[key] <= 0:
                del self.sequences[key]

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


def check_sequences(total: int, limits: LimitSettings) -> None:
    """One request's sequences (prompts x n) against limits.max_sequences_per_request."""
    if total > limits.max_sequences_per_request:
        raise ProtocolError("bad_request", f"the request asks for {total} sequences (prompts x n); at most "
                            f"{limits.max_sequences_per_request} per request (limits.max_sequences_per_request)",
                            param="n")
