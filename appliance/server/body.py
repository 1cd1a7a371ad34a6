"""Reading a request body: bounded in size, UTF-8, a JSON object."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from appliance.server.errors import APIError, from_validation

M = TypeVar("M", bound=BaseModel)

DRAIN_FACTOR = 16  # past this many times the limit, stop reading and let the connection go


async def read_json_object(request: Request, limit: int) -> dict[str, Any]:
    """The body as a dict; 413 when over `limit` bytes, 400 when not a UTF-8 JSON object.

    An oversized body is still read on (and dropped), up to a bound, so a client that is
    still sending gets the 413 instead of a reset connection."""
    body = await _read(request, limit)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError, ValueError) as exc:
        # RecursionError: nesting too deep; ValueError: an integer of thousands of digits.
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise APIError(
            400, f"request body is not valid JSON: {reason}", code="invalid_json"
        ) from None
    if not isinstance(value, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(value).__name__}")
    return value


async def _read(request: Request, limit: int) -> bytes:
    body = bytearray()
    size = 0
    try:
        async for piece in request.stream():
            size += len(piece)
            if size <= limit:
                body += piece
            elif size > DRAIN_FACTOR * limit:
                break
    except ClientDisconnect:  # nobody is left to answer
        raise APIError(400, "the client left while sending its body") from None
    if size > limit:
        raise APIError(413, f"request body is over {limit} bytes", code="too_large")
    return bytes(body)


def validated(model: type[M], body: dict[str, Any]) -> M:
    """The body as `model`; 422 naming every bad field otherwise."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc) from None
