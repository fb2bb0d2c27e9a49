"""The ops on a user's data (feedback, consent, export, erase, adapter listing and rollback), each
on behalf of a principal: an app reaches only its own users, the operator any app's
(docs/security.md). Replies and errors name users as their app sent them, never as stored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

from daemon.principals import DEFAULT_APP, Identities, Principal, split_stored, stored_user
from daemon.wire import (
    AdaptersListArgs,
    ConsentArgs,
    FeedbackArgs,
    ProtocolError,
    RollbackArgs,
    UserArgs,
)
from edge_runtime.errors import MaceError
from edge_runtime.feedback import feedback_from_dict
from edge_runtime.kv.prefix_store import forget_stored_prefixes
from edge_runtime.lora.registry import FLEET


class UserOps:
    """The service's user-data ops; `service` is the daemon.service.Service that owns this."""

    def __init__(self, service: Any) -> None:
        self.service = service
        # Holders of user data outside the store and the engine (the HTTP front's stored
        # responses): kind -> erase(stored user) -> how many items went. Erasure calls each.
        self.erasers: dict[str, Callable[[str], int]] = {}

    @property
    def identities(self) -> Identities:
        return self.service.identities

    def stored(self, who: Principal, app: str | None, user: str) -> str:
        """The stored id of `user` of the app the request names (its principal's own unless an
        operator names another)."""
        return stored_user(self.identities.target_app(who, app), user)

    async def feedback(self, args: FeedbackArgs, who: Principal) -> dict[str, Any]:
        service = self.service
        astore = service._store()
        stored = self.stored(who, None, args.user)
        service.ops_in_flight += 1
        try:
            with own_names(stored, args.user):
                ack = await astore.record_feedback(stored, args.interaction_id, feedback_from_dict(args.feedback))
        finally:
            service.ops_in_flight -= 1
        service.counters["feedback"] += 1
        service.fine_tuner.on_feedback(stored, ack.pair_ids)
        return {"feedback_id": ack.feedback_id, "pair_ids": list(ack.pair_ids),
                "unpaired_ids": list(ack.unpaired_ids), "durable": True}

    async def consent(self, args: ConsentArgs, who: Principal) -> dict[str, Any]:
        store = self.service._store()
        stored = self.stored(who, args.app, args.user)
        changed = False
        with own_names(stored, args.user):
            if args.granted is not None:
                changed = await store.set_consent(stored, args.granted)
            if args.fleet is not None:
                changed = await store.set_fleet_consent(stored, args.fleet) or changed
            state = await store.consent_state(stored)
        return {"user": args.user, "granted": state.granted, "fleet": state.fleet, "changed": changed}

    async def export(self, args: UserArgs, who: Principal) -> dict[str, Any]:
        stored = self.stored(who, args.app, args.user)
        with own_names(stored, args.user):
            data = await self.service._store().export_user(stored)
        return {"user": args.user, "data": _renamed(data, stored, args.user)}

    async def forget(self, args: UserArgs, who: Principal) -> dict[str, Any]:
        store = self.service._store()
        stored = self.stored(who, args.app, args.user)
        with own_names(stored, args.user):
            # The engine stops serving the user's adapters before their files go.
            removed = await self.service.fine_tuner.forget(stored)
            in_memory, on_disk = await self._forget_prefixes(stored)
            elsewhere = {"prefix_blocks": on_disk, "prefix_blocks_in_memory": in_memory}
            elsewhere.update({kind: erase(stored) for kind, erase in self.erasers.items()})
            report = await store.forget(stored, adapters_removed=removed, elsewhere=elsewhere)
        erased = asdict(report)
        erased.update(erased.pop("elsewhere"))
        return {"user": args.user, "erased": _renamed(erased, stored, args.user)}

    async def _forget_prefixes(self, stored: str) -> tuple[int, int]:
        """The user's prompt blocks (their prompts, so their data): (dropped from the in-memory
        prefix cache, files removed from its disk tier)."""
        engine = self.service.engine
        in_memory, on_disk = (await engine.call(lambda e: e.prefixes.forget(stored), parked=lambda p: (0, 0))
                              if engine is not None and engine.alive else (0, 0))  # unloaded: all on disk
        # Then every model's and format's folder, the live one included (whatever a writer raced in).
        return in_memory, on_disk + forget_stored_prefixes(self.service.config.prefix_store_dir, stored)

    async def adapters_list(self, args: AdaptersListArgs, who: Principal) -> dict[str, Any]:
        tuner = self.service.fine_tuner
        if args.user is not None:
            stored = self.stored(who, args.app, args.user)
            entries = [{**e, "user": args.user} for e in await tuner.adapters(stored)]
        else:
            app = None if who.is_operator and args.app is None else self.identities.target_app(who, args.app)
            entries = [e for e in (self.own_entry(e, app) for e in await tuner.adapters(None)) if e is not None]
        return {"adapters": entries, "trainer": tuner.name}

    @staticmethod
    def own_entry(entry: dict[str, Any], app: str | None) -> dict[str, Any] | None:
        """An adapter listing's entry as `app` may see it (its own users, by their plain ids),
        or None; app None (the operator's whole view) sees every entry as stored."""
        if app is None:
            return entry
        owner, user = split_stored(str(entry["user"]))
        if owner != app or (owner == DEFAULT_APP and user == FLEET):
            return None
        return {**entry, "user": user}

    async def adapters_rollback(self, args: RollbackArgs, who: Principal) -> dict[str, Any]:
        self.service._require("serving")
        stored = self.stored(who, args.app, args.user)
        with own_names(stored, args.user):
            result = await self.service.fine_tuner.rollback(stored, args.version)
        return {**result, "user": args.user} if "user" in result else result


def _renamed(value: Any, stored: str, user: str) -> Any:
    """`value` with the stored id replaced by the app's own wherever a field holds it whole."""
    if stored == user:
        return value
    if isinstance(value, dict):
        return {k: _renamed(v, stored, user) for k, v in value.items()}
    if isinstance(value, list):
        return [_renamed(v, stored, user) for v in value]
    return user if value == stored else value


@contextlib.contextmanager
def own_names(stored: str, user: str) -> Iterator[None]:
    """Errors raised inside name the user as the app knows them, not as stored."""
    try:
        yield
    except ProtocolError as exc:
        if stored != user and stored in exc.message:
            raise ProtocolError(exc.code, exc.message.replace(stored, user), param=exc.param,
                                retry_after_s=exc.retry_after_s, details=exc.details) from None
        raise
    except MaceError as exc:
        if stored != user and stored in str(exc):
            raise ProtocolError(exc.code, str(exc).replace(stored, user),
                                param=getattr(exc, "param", None)) from None
        raise
