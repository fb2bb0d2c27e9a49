"""Stored responses for `previous_response_id` and `GET/DELETE /v1/responses/{id}`: in memory
only, bounded per principal in count, bytes and age, each reachable only by the principal and
`user` that made it. Nothing here touches disk; a restart forgets them all.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from daemon.principals import Principal

MAX_RESPONSES = 256  # per principal
MAX_BYTES = 32 << 20  # per principal: the conversations' JSON text
MAX_AGE_S = 3600.0  # a user's text does not linger in memory for longer than this


@dataclass
class StoredResponse:
    owner: tuple[str, str]  # (principal kind, app)
    user: str  # the stored id of the user it was generated for ("": none named)
    messages: list[dict[str, Any]]  # the whole conversation, instructions excepted, output included
    response: dict[str, Any]  # the response object as sent
    created: float
    size: int = field(default=0)


@dataclass
class _Shelf:
    entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)
    size: int = 0


class ResponseStore:
    """What each principal stored, oldest first; `clock` is injectable for tests."""

    def __init__(self, *, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES,
                 max_age_s: float = MAX_AGE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.clock = clock
        self._shelves: dict[tuple[str, str], _Shelf] = {}

    @staticmethod
    def owner(who: Principal) -> tuple[str, str]:
        return (who.kind, who.app)

    def put(self, who: Principal, user: str | None, response_id: str, messages: list[dict[str, Any]],
            response: dict[str, Any]) -> None:
        size = len(json.dumps(messages, ensure_ascii=False)) + len(json.dumps(response, ensure_ascii=False))
        if size > self.max_bytes:
            return  # too large to keep at all: a later previous_response_id gets a 404 naming it
        shelf = self._shelves.setdefault(self.owner(who), _Shelf())
        self._expire(shelf)
        old = shelf.entries.pop(response_id, None)
        if old is not None:
            shelf.size -= old.size
        shelf.entries[response_id] = StoredResponse(self.owner(who), user, messages, response, self.clock(), size)
        shelf.size += size
        while len(shelf.entries) > self.max_responses or shelf.size > self.max_bytes:
            _, dropped = shelf.entries.popitem(last=False)
            shelf.size -= dropped.size

    def get(self, who: Principal, user: str | None, response_id: str) -> StoredResponse | None:
        """The entry, only for the principal that stored it and the same `user` (None: any
        user of that principal, for retrieve/delete by id)."""
        shelf = self._shelves.get(self.owner(who))
        if shelf is None:
            return None
        self._expire(shelf)
        entry = shelf.entries.get(response_id)
        if entry is None or (user is not None and entry.user != user):
            return None
        return entry

    def delete(self, who: Principal, response_id: str) -> bool:
        shelf = self._shelves.get(self.owner(who))
        entry = shelf.entries.pop(response_id, None) if shelf else None
        if shelf is None or entry is None:
            return False
        shelf.size -= entry.size
        return True

    def forget_user(self, user: str) -> int:
        """Drop every response generated for `user` (its stored id: `<app>~<user>`, or plain in
        the default app), whichever principal asked; returns how many went."""
        dropped = 0
        for shelf in self._shelves.values():
            for rid in [rid for rid, e in shelf.entries.items() if e.user == user]:
                shelf.size -= shelf.entries.pop(rid).size
                dropped += 1
        return dropped

    def count(self) -> int:
        return sum(len(s.entries) for s in self._shelves.values())

    def _expire(self, shelf: _Shelf) -> None:
        limit = self.clock() - self.max_age_s
        while shelf.entries:
            rid, oldest = next(iter(shelf.entries.items()))
            if oldest.created >= limit:
                break
            shelf.entries.pop(rid)
            shelf.size -= oldest.size
