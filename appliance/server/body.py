"""Reading a request body: bounded in size, UTF-8, a JSON object."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from appliance.server.errors import APIError


async def read_json_object(request: Request, limit: int) -> dict[str, Any]:
    """The body as a dict; 413 when over `limit` bytes, 400 when not UTF-8 JSON object.

    An oversized body is still read to its end (and dropped) so the client, which is
    usually still sending, gets the 413 instead of a reset connection."""
    body = bytearray()
    size = 0
    async for piece in request.stream():
        size += len(piece)
        if size <= limit:
            body += piece
    if size > limit:
        raise APIError(413, f"request body is {size} bytes; the limit is {limit}", code="too_large")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(value, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(value).__name__}")
    return value
