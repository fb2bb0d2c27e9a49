"""What a browser may not do to the gateway: reach a loopback bind under another name (DNS
rebinding: the Host allow-list), and change state from a page it was not allowed to (CSRF: a
state-changing request must be application/json and must not come cross-site from an origin
outside the CORS allow-list). Pure ASGI, outside everything else, so it runs before routing.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from daemon.fronts.http.errors import GatewayError

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[..., Awaitable[Any]], Callable[..., Awaitable[Any]]], Awaitable[None]]

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# Methods a browser's form or no-cors fetch can send without a preflight are GET, HEAD and POST;
# every method that changes something is checked (PUT/PATCH/DELETE need a preflight anyway).
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def host_name(value: str) -> str:
    """'LocalHost:8000' -> 'localhost', '[::1]:80' -> '::1' (a trailing dot dropped)."""
    value = value.strip().lower()
    if value.startswith("["):
        name = value[1:].partition("]")[0]
    else:
        name, sep, port = value.rpartition(":")
        if not sep or not port.isdigit():
            name = value
    return name.rstrip(".")


class BrowserGuard:
    """ASGI middleware. `allowed_hosts`: None = any Host (a non-loopback bind, where API keys
    stand between a page and the data); else the names a request's Host may carry.
    `origin_allowed(origin)`: the CORS rule (the same one the CORS middleware applies)."""

    def __init__(self, app: ASGIApp, allowed_hosts: Callable[[], frozenset[str] | None],
                 origin_allowed: Callable[[str], bool]) -> None:
        self.app = app
        self.allowed_hosts = allowed_hosts
        self.origin_allowed = origin_allowed

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self.refusal(scope)
        if error is not None:
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> GatewayError | None:
        headers: dict[str, str] = {}
        for key, value in scope["headers"]:
            headers.setdefault(key.decode("latin-1"), value.decode("latin-1"))
        allowed = self.allowed_hosts()
        host = headers.get("host", "")
        if allowed is not None and host_name(host) not in allowed:
            return GatewayError("host_not_allowed", f"Host {host[:100]!r} is not served here: this gateway "
                                "answers localhost, 127.0.0.1, [::1] and http.allowed_hosts")
        if scope["method"] not in STATE_CHANGING:
            return None
        origin = headers.get("origin")
        fetch_site = headers.get("sec-fetch-site", "").lower()
        same_origin = origin is not None and origin.lower() == f"{scope.get('scheme', 'http')}://{host}".lower()
        if origin is not None and not same_origin and not self.origin_allowed(origin):
            return GatewayError("cross_site", f"requests from origin {origin[:100]!r} may not change anything "
                                "here; list it in http.cors_origins")
        if fetch_site == "cross-site" and not (origin is not None and self.origin_allowed(origin)):
            return GatewayError("cross_site", "a cross-site request (Sec-Fetch-Site) from an origin not in "
                                "http.cors_origins may not change anything here")
        media = headers.get("content-type", "").partition(";")[0].strip().lower()
        has_body = headers.get("content-length", "0") not in ("", "0") or "transfer-encoding" in headers
        if (scope["method"] != "DELETE" or has_body or media) and media != "application/json":
            return GatewayError("unsupported_media_type", f"Content-Type {media or '(none)'!r}: "
                                f"{scope['method']} bodies must be application/json")
        return None


def origin_rule(origins: list[str], loopback_pattern: str) -> Callable[[str], bool]:
    """The CORS allow-list as a predicate: the configured origins ('*' = any) and loopback pages."""
    listed = {o.lower() for o in origins}
    pattern = re.compile(loopback_pattern)

    def allowed(origin: str) -> bool:
        return "*" in listed or origin.lower() in listed or bool(pattern.fullmatch(origin))

    return allowed
