"""The root span of each API request: an ASGI middleware (added only where tracing is on)
that opens a SERVER span around the whole exchange, a streamed body included, made current
so the supervisor's span for each choice hangs under it. A `traceparent` header continues
the caller's trace."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from appliance.tracing.spans import server_span

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
TRACED_PREFIX = "/v1/"  # the OpenAI routes; health, metrics and admin polls are not traced


class RequestSpans:
    """ASGI middleware: a span per HTTP request to the OpenAI routes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(TRACED_PREFIX):
            await self.app(scope, receive, send)
            return
        method = scope.get("method", "")
        attributes = {"http.request.method": method, "url.path": path}
        with server_span(f"{method} {path}", traceparent(scope), attributes) as span:

            async def send_status(message: Message) -> None:
                if message["type"] == "http.response.start" and span is not None:
                    status = int(message["status"])
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        from opentelemetry.trace import Status, StatusCode

                        span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
                await send(message)

            await self.app(scope, receive, send_status)


def traceparent(scope: Scope) -> str:
    """The request's `traceparent` header ("" without one)."""
    for name, value in scope.get("headers", []):
        if name == b"traceparent":
            return bytes(value).decode("latin-1").strip()
    return ""
