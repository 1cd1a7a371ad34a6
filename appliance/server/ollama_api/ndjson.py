"""Ollama's stream on the wire: newline-delimited JSON, a client that stops reading
dropped as the SSE streams drop one (replies.SEND_TIMEOUT_S), its generation closed."""

from __future__ import annotations

import logging

import anyio
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

log = logging.getLogger("appliance.server")


class NdjsonStream(StreamingResponse):
    """A StreamingResponse of lines whose every send must finish within `send_timeout_s`:
    a client that holds the connection open without reading would otherwise hold its
    generation (and its admission slot) for as long as it likes."""

    media_type = "application/x-ndjson"

    def __init__(self, lines: object, send_timeout_s: float) -> None:
        super().__init__(lines)  # type: ignore[arg-type]  # an async iterator of str
        self.send_timeout_s = send_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stalled = False

        async def timed(message: Message) -> None:
            nonlocal stalled
            try:
                with anyio.fail_after(self.send_timeout_s):
                    await send(message)
            except TimeoutError:
                stalled = True
                raise

        try:
            await super().__call__(scope, receive, timed)
        except (TimeoutError, ClientDisconnect):  # Starlette makes OSErrors the latter
            if not stalled:
                raise
            log.info("dropped a client that read nothing for %.0f s", self.send_timeout_s)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()  # the lines' generators, down to the generation
