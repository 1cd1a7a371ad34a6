"""The routes: OpenAI's chat and text completions and model list, health, metrics.

A completion request goes: key -> readiness -> body -> validation -> model -> tokens ->
context check -> admission -> the supervisor (generation.py) -> JSON or SSE."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import asdict
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from appliance.server.body import read_json_object
from appliance.server.errors import APIError, from_validation
from appliance.server.generation import Choice, run_choices, unless_disconnected
from appliance.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    unsupported_field,
)
from appliance.server.responses import ChatShape, CompletionShape, Envelope, Shape, usage
from appliance.server.state import ServerState, Ticket
from appliance.supervisor import RequestFailed

R = TypeVar("R", bound=BaseModel)


async def chat_completions(request: Request) -> Response:
    state, body = await _accept(request)
    req = _parse(ChatCompletionRequest, body)
    state.check_model(req.model)
    messages = [m.for_template() for m in req.messages]
    ids = _tokenize(lambda: state.appliance.tokenize(messages=messages), "messages")
    return await _respond(request, state, req, [ids], ChatShape())


async def completions(request: Request) -> Response:
    state, body = await _accept(request)
    req = _parse(CompletionRequest, body)
    state.check_model(req.model)
    vocab = state.appliance.config.vocab_size
    prompts = []
    for prompt in req.prompts():
        ids = _tokenize(lambda p=prompt: state.appliance.tokenize(prompt=p), "prompt")
        if max(ids) >= vocab:
            raise APIError(
                400, f"token id {max(ids)} is outside the vocabulary ({vocab})", "prompt"
            )
        prompts.append(ids)
    return await _respond(request, state, req, prompts, CompletionShape())


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    state.authorize(request)
    card = {
        "id": state.appliance.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "appliance",
        "max_model_len": state.appliance.max_model_len if state.appliance.ready else None,
    }
    return JSONResponse({"object": "list", "data": [card]})


async def health(request: Request) -> Response:
    """200 once every worker is ready, 503 before; the pools' states either way."""
    state: ServerState = request.app.state.server
    supervisor = state.appliance.supervisor
    ready = state.appliance.ready and state.startup_error is None
    workers = [asdict(v) for v in supervisor.views()]
    body = {
        "status": "ok" if ready else ("failed" if state.startup_error else "starting"),
        "model": state.appliance.model_name,
        "mode": state.settings.mode,
        "pools": {
            role: [w for w in workers if w["role"] == role]
            for role in ("prefill", "decode", "colocated")
            if any(w["role"] == role for w in workers)
        },
        "requests_in_flight": state.in_flight,
        "error": state.startup_error,
    }
    return JSONResponse(body, status_code=200 if ready else 503)


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# ---------------------------------------------------------------- the steps


async def _accept(request: Request) -> tuple[ServerState, dict[str, Any]]:
    state: ServerState = request.app.state.server
    state.authorize(request)
    body = await read_json_object(request, state.settings.server.max_body_bytes)
    state.check_ready()
    field = unsupported_field(body)
    if field is not None:
        raise APIError(400, f"{field} is not supported by this server", field, "unsupported")
    return state, body


def _parse(model: type[R], body: dict[str, Any]) -> R:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc) from None


def _tokenize(tokenize: Callable[[], list[int]], param: str) -> list[int]:
    try:
        return tokenize()
    except TypeError:  # the tokenizer refuses str holding a lone surrogate ("\ud800")
        raise APIError(400, "the text is not valid Unicode (a lone surrogate?)", param) from None
    except ValueError as exc:  # an empty prompt, a template that rejects the messages
        raise APIError(400, str(exc), param) from None


def _max_tokens(req: SamplingFields, prompt_len: int, context: int, param: str) -> int:
    """The output budget: what was asked, checked against the room the prompt leaves."""
    if prompt_len >= context:
        raise APIError(
            400,
            f"the prompt has {prompt_len} tokens, but this model's context holds {context} "
            f"tokens (prompt + output); shorten the prompt to at most {context - 1} tokens",
            param,
            "context_length_exceeded",
        )
    room = context - prompt_len
    asked = req.requested_max_tokens()
    if asked is None:
        return req.default_max_tokens(room)
    if asked > room:
        raise APIError(
            400,
            f"max_tokens is {asked}, but the prompt has {prompt_len} tokens and the context "
            f"holds {context}: at most {room} tokens can be generated",
            "max_tokens",
            "context_length_exceeded",
        )
    return asked


async def _respond(
    request: Request,
    state: ServerState,
    req: SamplingFields,
    prompts: list[list[int]],
    shape: Shape,
) -> Response:
    if req.n > state.settings.server.max_n:
        raise APIError(422, f"n is {req.n}; at most {state.settings.server.max_n}", "n")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options needs stream: true", "stream_options")
    param = "messages" if isinstance(shape, ChatShape) else "prompt"
    context = state.appliance.max_model_len
    choices = []
    for p, ids in enumerate(prompts):
        max_tokens = _max_tokens(req, len(ids), context, param)
        for j in range(req.n):
            choices.append(Choice(p * req.n + j, ids, req.sampling_params(max_tokens, j)))
    ticket = state.admit(len(choices))
    envelope = Envelope(shape, state.appliance.model_name)
    prompt_tokens = sum(len(ids) for ids in prompts)
    if req.stream:
        events = _stream(state, choices, envelope, prompt_tokens, req.include_usage)
        return Releasing(EventSourceResponse(events, sep="\n"), ticket)
    try:
        result = await unless_disconnected(
            request, _collect(state, choices, envelope, prompt_tokens)
        )
    except RequestFailed as exc:
        raise APIError(503, f"generation failed: {exc}", retry_after=1) from None
    finally:
        ticket.release()
    return JSONResponse(result) if result is not None else Response(status_code=499)


async def _collect(
    state: ServerState, choices: list[Choice], envelope: Envelope, prompt_tokens: int
) -> dict[str, Any]:
    texts = [""] * len(choices)
    reasons: list[str | None] = [None] * len(choices)
    generated = 0
    async with aclosing(run_choices(state.appliance.supervisor, choices, state.metrics)) as chunks:
        async for index, chunk in chunks:
            texts[index] += chunk.text
            generated += len(chunk.token_ids)
            if chunk.finished:
                reasons[index] = chunk.finish_reason
    body = [envelope.shape.choice(i, texts[i], reasons[i]) for i in range(len(choices))]
    return envelope.whole(body, usage(prompt_tokens, generated))


async def _stream(
    state: ServerState,
    choices: list[Choice],
    envelope: Envelope,
    prompt_tokens: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    """SSE data lines: OpenAI's chunks, an error event if generation fails, then [DONE]."""

    def chunk(choice: dict[str, Any]) -> str:
        return _json(envelope.chunk([choice], None, include_usage))

    generated = 0
    try:
        for c in choices:
            opening = envelope.shape.opening(c.index)
            if opening is not None:
                yield chunk(opening)
        supervisor = state.appliance.supervisor
        async with aclosing(run_choices(supervisor, choices, state.metrics)) as chunks:
            async for index, piece in chunks:
                generated += len(piece.token_ids)
                if piece.text or piece.finished:
                    yield chunk(envelope.shape.delta(index, piece.text, piece.finish_reason))
        if include_usage:
            yield _json(envelope.chunk([], usage(prompt_tokens, generated), True))
    except RequestFailed as exc:
        yield _json(APIError(503, f"generation failed: {exc}").body())
    yield "[DONE]"


def _json(value: dict[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"))


class Releasing:
    """A streamed response that gives its admission back however the stream ends
    (finished, failed, or the client hung up before it began)."""

    def __init__(self, response: Response, ticket: Ticket) -> None:
        self.response = response
        self.ticket = ticket

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.ticket.release()
