"""Request guard of a loopback server: the Host header must name this machine (so a web page whose
domain was re-pointed at 127.0.0.1, DNS rebinding, is refused) and a browser's Origin must be this
server (so another site's page cannot open a session's WebSocket or post to the API). Pure checks plus a
small ASGI middleware applying them to HTTP and WebSocket requests alike.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]
]


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """The host part of a ``Host`` header value (``"[::1]:8000"`` -> ``"::1"``, ``"a:80"`` -> ``"a"``)."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[1 : h.index("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def refusal(host_header: str | None, origin: str | None, allowed_hosts: tuple[str, ...]) -> str | None:
    """Why a request is refused, or None. ``allowed_hosts`` empty: any Host; an absent Origin (a client
    that is not a browser) passes; a present one must have the request's Host as its host and port."""
    if allowed_hosts and (host_header is None or host_name(host_header) not in allowed_hosts):
        return f"Host header {host_header!r} is not one of {list(allowed_hosts)} (a loopback-only server)"
    if origin is not None and origin != "null":
        netloc = urlsplit(origin).netloc.lower()
        if host_header is None or netloc != host_header.strip().lower():
            return f"Origin {origin!r} is not this server ({host_header!r}): cross-site requests are refused"
    return None


class GuardMiddleware:
    """Applies :func:`refusal` to every HTTP and WebSocket request (403 / close code 1008)."""

    def __init__(self, app: ASGIApp, allowed_hosts: tuple[str, ...]) -> None:
        self.app, self.allowed_hosts = app, allowed_hosts

    async def __call__(
        self,
        scope: Scope,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        why = refusal(headers.get("host"), headers.get("origin"), self.allowed_hosts)
        if why is None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await receive()  # the websocket.connect message
            await send({"type": "websocket.close", "code": 1008, "reason": why[:120]})
            return
        body = json.dumps({"detail": why}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 403,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


__all__ = ["LOOPBACK_NAMES", "GuardMiddleware", "host_name", "is_loopback", "refusal"]
