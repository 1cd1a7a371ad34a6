"""Ollama's model-management routes, as a server of one model answers them.

Open WebUI, the `ollama` CLI (OLLAMA_HOST pointed here) and scripts pull a model before
they use it: POST /api/pull of the served model succeeds at once, as Ollama's does for
a model it has (its last line, `{"status": "success"}`). Nothing is downloaded, written
or deleted over the API: any other pull, and /api/push, /api/create, /api/copy and
/api/delete, are a 400 in Ollama's shape saying what does it here: `appliance pull` on
the server's machine downloads a model, `appliance serve --model` serves it,
`served_model_name` names it. (Ollama's pulls write gigabytes on behalf of whoever can
reach its port; here a model is the operator's choice, made where the server runs.)"""

from __future__ import annotations

import json

from pydantic import field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from appliance.server.body import read_json_object, validated
from appliance.server.errors import APIError
from appliance.server.ollama_api.request import LATEST
from appliance.server.protocol import Body, valid_unicode
from appliance.server.state import ServerState

SUCCESS = {"status": "success"}


class OllamaPull(Body):
    """POST /api/pull: `model` (or the older `name`), `stream`, `insecure`."""

    model: str | None = None
    name: str | None = None  # what older clients send
    stream: bool = True
    insecure: bool = False  # a registry's TLS: there is none to reach

    @field_validator("model", "name")
    @classmethod
    def _unicode(cls, value: str | None) -> str | None:
        return value if value is None else valid_unicode(value)  # it is said back

    def named(self) -> str:
        name = self.model or self.name
        if not name:
            raise APIError(400, "model is required", "model")
        return name


async def pull(request: Request) -> Response:
    """POST /api/pull: success for the served model; a 400 for any other."""
    state: ServerState = request.app.state.server
    state.authorize(request)
    raw = await read_json_object(request, state.settings.server.max_body_bytes)
    body = validated(OllamaPull, raw)
    name, served = body.named(), state.appliance.model_name
    if name.removesuffix(LATEST) != served:
        raise APIError(
            400,
            f"this server pulls no models over its API; it serves {served!r}. "
            f"`appliance pull {name}` on its machine downloads {name!r}, "
            f"`appliance serve --model {name}` serves it",
            "model",
        )
    if not body.stream:
        return JSONResponse(SUCCESS)
    return Response(json.dumps(SUCCESS) + "\n", media_type="application/x-ndjson")


async def refused(request: Request) -> Response:
    """POST /api/push, /api/create, /api/copy; DELETE /api/delete: a 400 saying what does
    it here. The body is read (a bad one is its own 400) and otherwise not used."""
    state: ServerState = request.app.state.server
    state.authorize(request)
    await read_json_object(request, state.settings.server.max_body_bytes)
    what = request.url.path.removeprefix("/api/")
    raise APIError(400, REFUSALS[what].format(served=state.appliance.model_name), "model")


REFUSALS = {
    "push": "this server pushes no models to a registry; it serves {served!r}",
    "create": (
        "this server creates no models; it serves {served!r}. A model's chat template and "
        "sampling defaults are settings (chat_template, override_generation_config), read "
        "when `appliance serve` starts"
    ),
    "copy": (
        "this server serves one model under one name, {served!r}; `served_model_name` "
        "names it when `appliance serve` starts"
    ),
    "delete": (
        "this server deletes no models over its API; it serves {served!r}. "
        "`appliance models` on its machine lists the cache a model is removed from"
    ),
}
