"""Ollama's API, for the applications written against it (Open WebUI, editors'
plugins, the `ollama` Python and JavaScript clients): POST /api/chat and /api/generate
(streamed as newline-delimited JSON unless `stream` is false), GET /api/tags, /api/ps
and /api/version, POST /api/show. The model is the one served, named as /api/tags
lists it (with or without ":latest"). Errors are Ollama's {"error": "..."}
(errors.APIError.response, for every path under /api/).

A chat or generate request is made into the chat (or, raw, text) completion the
OpenAI routes serve (request.py), run through the same path (routes.prepared_chat),
and its answer put in Ollama's shape (reply.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from appliance.model.model_source import default_model_path
from appliance.model.sampling_defaults import SamplingDefaults, shown
from appliance.server import replies, routes
from appliance.server.body import read_json_object, validated
from appliance.server.errors import APIError
from appliance.server.ollama_api.ndjson import NdjsonStream
from appliance.server.ollama_api.reply import Kind, OllamaReply, created_at, merged
from appliance.server.ollama_api.request import LATEST, OllamaChat, OllamaGenerate, served_name
from appliance.server.state import ServerState, server_version


async def chat(request: Request) -> Response:
    """POST /api/chat: no messages only loads the model (Ollama's), here loaded."""
    state, body = await routes.accept(request)
    req = validated(OllamaChat, served_name(body, state.appliance.model_name))
    reply = _reply("chat", state, request)
    if not req.messages:  # Ollama's way to load a model (`ollama run` sends it first)
        state.check_model(req.model)
        return JSONResponse(reply.loaded())
    prepared = await routes.prepared_chat(request, state, req.chat_body())
    return await _answer(request, state, prepared, reply, req.stream)


async def generate(request: Request) -> Response:
    """POST /api/generate: an empty prompt only loads the model (Ollama's), here loaded."""
    state, body = await routes.accept(request)
    req = validated(OllamaGenerate, served_name(body, state.appliance.model_name))
    reply = _reply("generate", state, request)
    if not req.prompt and not req.raw and not req.suffix:
        state.check_model(req.model)
        return JSONResponse(reply.loaded())
    if req.raw or req.suffix:  # an insert's suffix reaches prepared_completion in the body
        body = req.text_body()
        prepared = await routes.prepared_completion(request, state, body, open_ended=True)
    else:
        prepared = await routes.prepared_chat(request, state, req.chat_body())
    return await _answer(request, state, prepared, reply, req.stream)


def _reply(kind: Kind, state: ServerState, request: Request) -> OllamaReply:
    return OllamaReply(kind, _tag(state.appliance.model_name), request.state.arrival)


async def _answer(
    request: Request,
    state: ServerState,
    prepared: routes.Prepared,
    reply: OllamaReply,
    stream: bool,
) -> Response:
    """Both ways from the OpenAI stream (its timing gives Ollama's durations): line by
    line, or gathered into one object."""
    choices, envelope = prepared.choices, prepared.envelope
    ticket = state.admit(len(choices))
    data = replies.stream_data(state, choices, envelope, prepared.prompt_tokens, True)
    lines = _ollama_lines(_chunks(data), reply)
    if stream:
        ndjson = NdjsonStream(_ndjson(lines), replies.SEND_TIMEOUT_S)
        return replies.Releasing(ndjson, ticket)
    return await replies.whole_answer(request, _gathered(lines), ticket)


async def _chunks(data: AsyncGenerator[str]) -> AsyncGenerator[dict[str, Any]]:
    """The OpenAI stream's data lines as objects, [DONE] left out."""
    async with aclosing(data) as lines:
        async for line in lines:
            if line != "[DONE]":
                yield json.loads(line)


async def _ollama_lines(
    chunks: AsyncGenerator[dict[str, Any]], reply: OllamaReply
) -> AsyncGenerator[dict[str, Any]]:
    """Ollama's lines from OpenAI's chunks: a line a piece, then the calls and `done`
    (once the usage chunk, the last, has come); an error ends it as Ollama's does."""
    reason = None
    async with aclosing(chunks) as pieces:
        async for chunk in pieces:
            if "error" in chunk:
                yield {"error": chunk["error"]["message"]}
                return
            for choice in chunk.get("choices") or []:
                reason = choice.get("finish_reason") or reason
                delta = choice.get("delta") or {"content": choice.get("text") or ""}
                line = reply.piece(delta)
                if line is not None:
                    yield line
            if chunk.get("usage") is not None:
                for line in reply.last(reason, chunk["usage"]):
                    yield line


async def _ndjson(lines: AsyncGenerator[dict[str, Any]]) -> AsyncIterator[str]:
    async with aclosing(lines) as objects:
        async for line in objects:
            yield json.dumps(line, separators=(",", ":")) + "\n"


async def _gathered(lines: AsyncGenerator[dict[str, Any]]) -> dict[str, Any]:
    """`stream: false`: the lines as one object; a failed generation a 503."""
    seen = []
    async with aclosing(lines) as objects:
        async for line in objects:
            if "error" in line:
                raise APIError(503, line["error"], retry_after=1)
            seen.append(line)
    return merged(seen)


# ---------------------------------------------------------------- the model


def _tag(name: str) -> str:
    """The served model's name as Ollama lists one: with a tag."""
    return name if ":" in name else name + LATEST


def _card(state: ServerState) -> dict[str, Any]:
    """The served model as /api/tags and /api/ps list it."""
    architecture = state.appliance.model_config.architecture
    name = _tag(state.appliance.model_name)
    path = state.settings.model or default_model_path()
    details = {
        "format": "gguf" if path.suffix == ".gguf" else "safetensors",
        "family": architecture,
        "families": [architecture],
        "parameter_size": "",
        "quantization_level": "",
    }
    return {
        "name": name,
        "model": name,
        "modified_at": created_at(),
        "size": path.stat().st_size if path.is_file() else 0,
        "digest": "",
        "details": details,
    }


async def tags(request: Request) -> Response:
    """GET /api/tags: the one model served."""
    state: ServerState = request.app.state.server
    state.authorize(request)
    return JSONResponse({"models": [_card(state)]})


async def running(request: Request) -> Response:
    """GET /api/ps: the served model, loaded for as long as the server runs."""
    state: ServerState = request.app.state.server
    state.authorize(request)
    models = [_card(state) | {"expires_at": None, "size_vram": 0}] if state.appliance.ready else []
    return JSONResponse({"models": models})


async def show(request: Request) -> Response:
    """POST /api/show: the served model's details (404 for another name)."""
    state: ServerState = request.app.state.server
    state.authorize(request)
    raw = await read_json_object(request, state.settings.server.max_body_bytes)
    body = served_name(raw, state.appliance.model_name)
    name = body.get("model") or body.get("name")
    state.check_model(str(name))
    config = state.appliance.model_config
    card = _card(state)
    info = {
        "general.architecture": config.architecture,
        f"{config.architecture}.context_length": config.max_position_embeddings,
    }
    shown = {"details": card["details"], "model_info": info, "modified_at": card["modified_at"]}
    if parameters := _parameters(state.appliance.sampling_defaults):
        shown["parameters"] = parameters
    return JSONResponse(shown | {"capabilities": ["completion", "tools"]})


def _parameters(defaults: SamplingDefaults) -> str:
    """The sampling defaults as a Modelfile's PARAMETER lines, as Ollama shows its own."""
    names = {"repetition_penalty": "repeat_penalty", "max_new_tokens": "num_predict"}
    return "\n".join(f"{names.get(k, k):<30} {shown(v)}" for k, v in defaults.values.items())


async def ollama_version(request: Request) -> Response:
    """GET /api/version: this server's version (Ollama's clients ask for it)."""
    return JSONResponse({"version": server_version()})
