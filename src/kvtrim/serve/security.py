"""Who may talk to the HTTP server: a ``Host`` allow-list, an ``Origin`` check, an optional Bearer API key and
``application/json`` on every POST.

Threat model: a server bound to 127.0.0.1 is still reachable from any web page open in a browser on the same
machine. Such a page can send "simple" cross-origin POSTs (``Content-Type: text/plain``, no preflight) and, through
DNS rebinding, even read the answers under its own host name. Requiring ``application/json`` forces a CORS
preflight (which fails unless ``--allowed-origins`` names the page's origin), refusing a foreign ``Origin`` stops
simple requests outright, and the ``Host`` allow-list defeats DNS rebinding (the browser sends the attacker's
host name). The API key (as vLLM's ``--api-key``) guards ``/v1/*``; ``/health`` and ``/metrics`` stay open, as
in vLLM, so load balancers and Prometheus need no secret.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import InvalidParameterError
from .request_error import RequestError

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
PROTECTED_PREFIX = "/v1"


def is_loopback(host: str) -> bool:
    """True for a bind address only this machine can reach (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class SecurityConfig:
    """Access rules of one server.

    Attributes:
        api_key: the Bearer token ``/v1/*`` requests must carry (None: no authentication)
        allowed_hosts: accepted ``Host`` header names, any port (``("*",)`` or None: any host)
        allowed_origins: browser origins allowed by CORS, e.g. ``("http://localhost:3000",)`` (empty: CORS off and
            any request carrying an ``Origin`` header is refused)
    """

    api_key: str | None = None
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise InvalidParameterError("api_key must be a non-empty string (or None for no authentication)")
        if self.allowed_hosts is not None:
            hosts = tuple(_host_name(h) for h in self.allowed_hosts)
            object.__setattr__(self, "allowed_hosts", None if "*" in hosts else hosts)
        object.__setattr__(self, "allowed_origins", tuple(o.rstrip("/") for o in self.allowed_origins))

    @classmethod
    def for_bind(
        cls,
        bind: str,
        api_key: str | None = None,
        extra_hosts: tuple[str, ...] = (),
        allowed_origins: tuple[str, ...] = (),
    ) -> SecurityConfig:
        """The default rules for a server listening on ``bind``: on a loopback address only the loopback names are
        accepted as ``Host`` (plus ``extra_hosts``); on any other address the ``Host`` is checked only when
        ``extra_hosts`` is given."""
        if is_loopback(bind):
            hosts: tuple[str, ...] | None = (*LOOPBACK_HOSTS, *extra_hosts)
        else:
            hosts = tuple(extra_hosts) or None
        return cls(api_key=api_key or None, allowed_hosts=hosts, allowed_origins=tuple(allowed_origins))


def _host_name(host: str) -> str:
    """``Host`` header value without its port, lower-cased (``[::1]:8000`` -> ``[::1]``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _reject(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> JSONResponse:
    body = RequestError(message, status=status, code=code).body()
    return JSONResponse(body, status_code=status, headers=headers)


class HostOriginMiddleware:
    """Refuses a ``Host`` outside the allow-list (400) and, when CORS is off, any request with an ``Origin`` header
    that is not allowed (403). Runs outside the CORS middleware for the host check and inside it for the origin."""

    def __init__(self, app: ASGIApp, config: SecurityConfig, check: str):
        self.app, self.config, self.check = app, config, check

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self.check == "host" and self.config.allowed_hosts is not None:
            host = _host_name(headers.get("host", ""))
            if host not in self.config.allowed_hosts:
                allowed = ", ".join(self.config.allowed_hosts)
                message = f"Host header {host[:100]!r} is not allowed (allowed: {allowed}; extend with --allowed-hosts)"
                await _reject(400, message, "host_not_allowed")(scope, receive, send)
                return
        if self.check == "origin":
            origin = headers.get("origin")
            allowed = self.config.allowed_origins
            if origin is not None and origin.rstrip("/") not in allowed and "*" not in allowed:
                message = f"cross-origin requests from {origin[:100]!r} are not allowed (see --allowed-origins)"
                await _reject(403, message, "origin_not_allowed")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class AuthMiddleware:
    """Bearer API key on ``/v1/*`` (401), then ``application/json`` on every POST (415)."""

    def __init__(self, app: ASGIApp, config: SecurityConfig):
        self.app, self.config = app, config
        self._key = None if config.api_key is None else config.api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self._key is not None and scope["path"].startswith(PROTECTED_PREFIX):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            # compare_digest on bytes: constant time in the key's content (a str would refuse non-ASCII)
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
                message = "invalid or missing API key: send 'Authorization: Bearer <key>' (see --api-key)"
                response = _reject(401, message, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        if scope["method"] == "POST":
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                shown = headers.get("content-type")
                message = f"Content-Type must be application/json, got {shown[:100] if shown else 'none'!r}"
                await _reject(415, message, "unsupported_media_type")(scope, receive, send)
                return
        await self.app(scope, receive, send)
