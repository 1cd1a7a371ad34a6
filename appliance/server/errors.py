"""OpenAI-style errors: every failure a client sees is `{"error": {message, type, param,
code}}` with a fitting status, never a bare 500 page or a dropped connection."""

from __future__ import annotations

import logging
import re
from types import MappingProxyType

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

log = logging.getLogger("appliance.server")
OLLAMA_PREFIX = "/api/"  # Ollama's routes (ollama_api/), whose errors are its shape
ANTHROPIC_PREFIX = "/v1/messages"  # Anthropic's (anthropic_api/), likewise
# Anthropic's error types where they differ from OpenAI's names.
ANTHROPIC_TYPES = MappingProxyType(
    {413: "request_too_large", 500: "api_error", 503: "overloaded_error"}
)

ERROR_TYPES = MappingProxyType(
    {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        405: "invalid_request_error",
        409: "conflict_error",
        413: "invalid_request_error",
        422: "invalid_request_error",
        429: "rate_limit_error",
        500: "server_error",
        503: "service_unavailable",
    }
)


class APIError(Exception):
    """An error answered to the client as it is."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        message = _sayable(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param if param is None else _sayable(param)
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict:
        error_type = ERROR_TYPES.get(self.status, "invalid_request_error")
        return {
            "error": {
                "message": self.message,
                "type": error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, path: str = "") -> JSONResponse:
        """The answer, in the shape of the API `path` belongs to: OpenAI's; under /api/
        Ollama's, {"error": message} (its clients read that string); under /v1/messages
        Anthropic's, {"type": "error", "error": {"type", "message"}}, the message led by
        the field it is about."""
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after else None
        status = self.status
        if path.startswith(OLLAMA_PREFIX):
            body: dict = {"error": self.message}
        elif path.startswith(ANTHROPIC_PREFIX):
            kind = ANTHROPIC_TYPES.get(status) or self.body()["error"]["type"]
            body = {"type": "error", "error": {"type": kind, "message": self._located()}}
            # Anthropic answers a malformed body with a 400 (its SDK's BadRequestError).
            status = 400 if status == 422 else status
        else:
            body = self.body()
        return JSONResponse(body, status_code=status, headers=headers)

    def _located(self) -> str:
        """The message led by the field it is about, as Anthropic's errors say where (its
        shape has no `param`): "stop_sequences: at most 16 ...". A validation error's
        message names its fields already."""
        if self.param is None or self.message.startswith(self.param):
            return self.message
        return f"{self.param}: {self.message}"


def _sayable(text: str) -> str:
    """`text` with a lone surrogate (JSON can carry "\ud800", which is no character) as
    its escape: an error that names what the client sent must still encode as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def from_validation(exc: ValidationError) -> APIError:
    """A 422 naming every bad field, its path in the body as `param`."""
    problems = []
    for error in exc.errors():
        where = _body_path(error["loc"]) or "body"
        problems.append(f"{where}: {error['msg'].removeprefix('Value error, ')}")
    param = _body_path(exc.errors()[0]["loc"]) or None
    return APIError(422, "; ".join(dict.fromkeys(problems)), param=param, code="invalid_value")


def _body_path(loc: tuple) -> str:
    # pydantic adds which member of a union it tried ("str", "list[int]"): not in the body.
    parts = [str(p) for p in loc if not _UNION_MEMBER.fullmatch(str(p))]
    return ".".join(parts)


_UNION_MEMBER = re.compile(r"str|int|float|bool|[\w-]+\[.*\]")


async def api_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's handler for APIError."""
    assert isinstance(exc, APIError)
    return exc.response(request.url.path)


async def http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own 404/405 and friends, in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed"}
    error = APIError(exc.status_code, message.get(exc.status_code, str(exc.detail)))
    response = error.response(request.url.path)
    response.headers.update(exc.headers or {})  # 405 names the allowed methods
    return response


async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug: answered as a 500 in the same shape, and logged with its traceback."""
    log.exception("unexpected error on %s", request.url.path)
    error = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
    return error.response(request.url.path)
