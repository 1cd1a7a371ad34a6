"""Who may talk to the server from a browser: requests from another site's page, and DNS
rebinding attacks on a loopback server without a key, are refused before any route runs.

Two rules, on every HTTP request (the page, /v1, /health, /metrics, /admin):

- **Origin.** A browser names the page a request comes from in `Origin` (on every POST and
  on every cross-origin fetch). When present it must be the server's own origin, the
  scheme (`http://`, or `https://` with TLS) + `Host` the request was sent to, or one of
  the allowed origins: else 403. No CORS headers are ever sent, so a browser never lets
  another site read an answer either.
  A client that sends no Origin (curl, the openai client, the console) is not concerned.
- **Host** (only on a loopback server without an API key). A page on evil.example whose
  name is re-pointed at 127.0.0.1 (DNS rebinding) talks to the server same-origin, Origin
  and Host both `evil.example:port`. What it cannot change is that name: on such a server
  `Host` must name this machine (`localhost` or a loopback address) or an allowed origin's
  host: else 421. Any port is accepted: a rebinding page cannot send a loopback name, and
  an SSH tunnel or port forward (`localhost:9000` to the server's 8000) keeps its own port.
  With an API key the rebinding page lacks the key; on a non-loopback address the server
  is open to the network by choice (`allow_remote`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from appliance.server.errors import APIError
from appliance.settings.config import Settings, is_loopback

DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class Origin:
    """scheme, host and port, normalized: lower case, brackets off IPv6, default ports named."""

    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = DEFAULT_PORTS.get(self.scheme)
        return f"{self.scheme}://{host}" + ("" if self.port == default else f":{self.port}")


def parse_origin(text: str) -> Origin | None:
    """`scheme://host[:port]` as an Origin; None for anything else (`null`, a path, junk)."""
    if any(c.isspace() or c == "," for c in text):  # two values folded into one, or junk
        return None
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:  # a port that is no number, or out of range
        return None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.hostname or parts.path not in ("", "/"):
        return None
    if parts.query or parts.fragment or parts.username or parts.password:
        return None
    return Origin(scheme, parts.hostname.lower(), port or DEFAULT_PORTS[scheme])


def parse_host(header: str, scheme: str = "http") -> Origin | None:
    """A `Host` header (`127.0.0.1:8000`, `[::1]:8000`, `localhost`) as the Origin it names
    for a request that came by `scheme` (https where the server serves TLS); None when it
    is not a host and optional port."""
    if not header or any(c in header for c in "/?#@\\ "):
        return None
    return parse_origin(f"{scheme}://{header}")


def names_this_machine(host: str) -> bool:
    """`localhost` or a loopback address (127.0.0.0/8, ::1): names no DNS can re-point."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # another name
        return False


@dataclass(frozen=True)
class Refusal:
    """A request refused: the status and the message the client gets."""

    status: int
    message: str
    code: str


@dataclass(frozen=True)
class OriginRules:
    """What the guard accepts: `check_host` on a loopback server without an API key;
    `allowed` origins besides the server's own (a reverse proxy's public address)."""

    check_host: bool
    allowed: frozenset[Origin] = frozenset()

    @classmethod
    def build(cls, check_host: bool, allowed_origins: Iterable[str] = ()) -> OriginRules:
        """Rules from origin strings; ValueError naming one that is no origin."""
        allowed = set()
        for text in allowed_origins:
            origin = parse_origin(text)
            if origin is None:
                raise ValueError(f"{text!r} is not an origin (scheme://host[:port])")
            allowed.add(origin)
        return cls(check_host, frozenset(allowed))

    @classmethod
    def for_settings(cls, settings: Settings) -> OriginRules:
        """The rules for a server: the Host check where it listens on loopback with no key,
        and the origins `server.allowed_origins` names."""
        check_host = is_loopback(settings.host) and settings.api_key is None
        return cls.build(check_host, settings.server.allowed_origins)

    def refusal(
        self, host_header: str | None, origin_header: str | None, scheme: str = "http"
    ) -> Refusal | None:
        """Why a request with these headers, sent by `scheme`, is refused; None when it
        may go on."""
        host = parse_host(host_header, scheme) if host_header is not None else None
        if self.check_host and not self._host_allowed(host):
            return Refusal(
                421,
                f"Host {host_header!r} does not name this machine: this server listens on "
                "loopback without an API key, so it answers only requests sent to localhost, "
                "127.0.0.1 or [::1] (a page on another site that re-points its name at this "
                "machine, DNS rebinding, is refused); to serve another name, set an API key "
                "or list that origin in server.allowed_origins",
                "host_not_allowed",
            )
        if origin_header is None:
            return None
        origin = parse_origin(origin_header)
        if origin is not None and (origin == host or origin in self.allowed):
            return None
        own_text = str(host) if host is not None else "unknown (no Host header)"
        return Refusal(
            403,
            f"cross-origin request refused: the page at {origin_header!r} is not this "
            f"server's origin ({own_text}); a browser may call this server only from its "
            "own page or an origin listed in server.allowed_origins",
            "origin_not_allowed",
        )

    def _host_allowed(self, host: Origin | None) -> bool:
        if host is None:
            return False
        return names_this_machine(host.host) or any(host.host == o.host for o in self.allowed)


class OriginGuard:
    """ASGI middleware: an HTTP request the rules refuse gets its error (OpenAI's error
    shape) without reaching the app; everything else passes through untouched."""

    def __init__(self, app: ASGIApp, rules: OriginRules) -> None:
        self.app = app
        self.rules = rules

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = _headers(scope)
            scheme = str(scope.get("scheme", "http"))  # https where uvicorn serves TLS
            refused = self.rules.refusal(headers.get("host"), headers.get("origin"), scheme)
            if refused is not None:
                error = APIError(refused.status, refused.message, code=refused.code)
                await error.response(str(scope.get("path", "")))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _headers(scope: Scope) -> dict[str, str]:
    # A repeated header is folded into one value, as HTTP does (RFC 9110 5.3): two Hosts
    # or two Origins then parse as neither, and are refused.
    found: dict[str, str] = {}
    for name, value in scope["headers"]:
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        found[key] = f"{found[key]}, {text}" if key in found else text
    return found
