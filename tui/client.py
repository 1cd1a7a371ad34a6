"""AdminClient: the appliance's admin API (/admin) over httpx, returning the schema's models."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import aconnect_sse

from appliance.admin.schema import Event, Move, Snapshot, Tuning
from appliance.admin.token import TokenError, read_token


class AdminError(Exception):
    """The admin API answered with an error status; `message` is the one its body gave."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return f"{self.message} (HTTP {self.status})"


def parse_item(event: str, data: str) -> Snapshot | Event | None:
    """The model one SSE message carries; None for event names the console doesn't know
    and for messages without data."""
    if not data:
        return None
    if event == "state":
        return Snapshot.model_validate_json(data)
    if event == "event":
        return Event.model_validate_json(data)
    return None


class AdminClient:
    """The admin API of one appliance, authenticated with its admin token.

    API errors raise AdminError; connection failures raise httpx.TransportError. With
    `token_file`, a 401 re-reads the token from it, so the next call works once a
    restarted appliance has written a new one.
    """

    def __init__(
        self, base_url: str, token: str, timeout: float = 10.0, token_file: Path | None = None
    ) -> None:
        self._token_file = token_file
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
        )

    @property
    def base_url(self) -> str:
        """Where the appliance is."""
        return str(self._http.base_url)

    async def state(self) -> Snapshot:
        """GET /admin/state."""
        response = await self._http.get("/admin/state")
        self._raise_for_error(response)
        return Snapshot.model_validate_json(response.content)

    async def events(self) -> AsyncIterator[Snapshot | Event]:
        """GET /admin/events: snapshots and events as they come, until the stream ends."""
        async with aconnect_sse(self._http, "GET", "/admin/events") as source:
            response = source.response
            if response.is_error:
                await response.aread()
                self._raise_for_error(response)
            # httpx-sse parses the stream (and refuses one that is not text/event-stream:
            # an SSEError, an httpx.HTTPError); `id` and `retry` go unused, since the
            # console resumes from a fresh snapshot
            async for message in source.aiter_sse():
                item = parse_item(message.event, message.data)
                if item is not None:
                    yield item

    async def move(self, device: int, to: str) -> Move:
        """POST /admin/pools: start moving device `device` to the `to` pool."""
        response = await self._http.post("/admin/pools", json={"device": device, "to": to})
        self._raise_for_error(response)
        return Move.model_validate(response.json()["move"])

    async def apply_plan(self) -> Move:
        """POST /admin/planner/apply: start the move the planner recommends."""
        response = await self._http.post("/admin/planner/apply")
        self._raise_for_error(response)
        return Move.model_validate(response.json()["move"])

    async def tune(self, **changes: Any) -> Tuning:
        """PATCH /admin/tuning with `changes` (TuningPatch fields); returns the new tuning."""
        response = await self._http.patch("/admin/tuning", json=changes)
        self._raise_for_error(response)
        return Tuning.model_validate(response.json()["tuning"])

    async def aclose(self) -> None:
        """Close the connections."""
        await self._http.aclose()

    def _raise_for_error(self, response: httpx.Response) -> None:
        if not response.is_error:
            return
        if response.status_code == 401 and self._token_file is not None:
            try:
                token = read_token(self._token_file)
            except TokenError:
                pass  # not written yet: the appliance may still be starting
            else:
                self._http.headers["Authorization"] = f"Bearer {token}"
        raise AdminError(response.status_code, _error_message(response))


def _error_message(response: httpx.Response) -> str:
    """The API's `error.message`; failing that (a proxy's page, say) the body or reason."""
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = body["error"].get("message")
        if message:
            return str(message)
    return response.text.strip()[:200] or response.reason_phrase
