"""Embeddings: POST /v1/embeddings (OpenAI's, as vLLM and llama.cpp's server serve it)
and Ollama's POST /api/embed and /api/embeddings. Each input is prefilled by the pools as
a one-token generation that asks for its prompt's embedding (engine/pooling.py: the
mean of the last hidden states, unit length); the token is dropped."""

from __future__ import annotations

import base64
import functools
import math
import struct
import time
from contextlib import aclosing
from typing import Any, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from appliance.api import RequestFailed
from appliance.engine.sequence import SamplingParams
from appliance.server import routes
from appliance.server.body import validated
from appliance.server.errors import APIError
from appliance.server.generation import Choice, run_choices, unless_disconnected
from appliance.server.ollama_api.reply import NS
from appliance.server.ollama_api.request import served_name
from appliance.server.protocol import Body, keep_last, valid_unicode
from appliance.server.state import ServerState

EMBED = SamplingParams(max_tokens=1, embed=True)
MAX_INPUTS = 2048  # OpenAI's most inputs in one request


class EmbeddingRequest(Body):
    """OpenAI's body: one input or a batch, as text or token ids."""

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's: embed each input's last k tokens (-1: as many as the context takes).
    truncate_prompt_tokens: int | None = Field(None, ge=-1)

    def inputs(self) -> list[str | list[int]]:
        value = self.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]  # one text, or one list of ids
        return list(value)  # type: ignore[arg-type]


class OllamaEmbed(Body):
    """Ollama's /api/embed body (and its older /api/embeddings, `prompt`)."""

    model: str
    input: str | list[str] | None = None
    prompt: str | None = None  # /api/embeddings
    truncate: bool = True  # cut an input past the context, else refuse it
    options: dict[str, Any] | None = None  # accepted: sampling does not enter an embedding
    keep_alive: str | int | float | None = None  # the model stays loaded: accepted


async def openai_embeddings(request: Request) -> Response:
    """POST /v1/embeddings."""
    state, body = await routes.accept(request)
    req = validated(EmbeddingRequest, body)
    state.check_model(req.model)
    size = state.appliance.model_config.hidden_size
    if req.dimensions is not None and req.dimensions != size:
        raise APIError(400, f"dimensions must be this model's embedding size, {size}", "dimensions")
    inputs = req.inputs()
    if not inputs:
        raise APIError(400, "input must hold at least one item", "input")
    _check_count(len(inputs), "input")
    last = req.truncate_prompt_tokens
    prompts = [await _ids(state, item, "input", False, last) for item in inputs]
    vectors = await _embedded(request, state, prompts)
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
        for i, v in enumerate(vectors)
    ]
    tokens = sum(len(p) for p in prompts)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return JSONResponse(
        {"object": "list", "data": data, "model": state.appliance.model_name, "usage": usage}
    )


async def ollama_embed(request: Request) -> Response:
    """POST /api/embed: {"input": text or texts} -> {"embeddings": [[...]]}; without
    input it only loads the model (Ollama's), here loaded: no embeddings."""
    began = time.monotonic()
    state, req, prompts = await _ollama_inputs(request, "input")
    vectors = await _embedded(request, state, prompts) if prompts else []
    return JSONResponse(
        {
            "model": req.model,
            "embeddings": vectors,
            "total_duration": int((time.monotonic() - began) * NS),
            "load_duration": 0,
            "prompt_eval_count": sum(len(p) for p in prompts),
        }
    )


async def ollama_embeddings(request: Request) -> Response:
    """POST /api/embeddings (Ollama's older route): {"prompt": text} -> {"embedding"};
    an empty prompt only loads the model: an empty embedding."""
    state, _, prompts = await _ollama_inputs(request, "prompt")
    vectors = await _embedded(request, state, prompts) if prompts else [[]]
    return JSONResponse({"embedding": vectors[0]})


async def _ollama_inputs(
    request: Request, field: str
) -> tuple[ServerState, OllamaEmbed, list[list[int]]]:
    state, body = await routes.accept(request)
    req = validated(OllamaEmbed, served_name(body, state.appliance.model_name))
    state.check_model(req.model)
    given = req.input if field == "input" else req.prompt
    texts = [given] if isinstance(given, str) else given or []
    if texts == [""]:
        texts = []  # as no input: a load
    _check_count(len(texts), field)
    prompts = [await _ids(state, text, field, req.truncate) for text in texts]
    return state, req, prompts


def _check_count(count: int, param: str) -> None:
    """OpenAI's bound on a request's inputs (a 400 naming the field past it)."""
    if count > MAX_INPUTS:
        raise APIError(400, f"{param} holds {count} items; at most {MAX_INPUTS}", param)


async def _ids(
    state: ServerState,
    item: str | list[int],
    param: str,
    truncate: bool,
    last: int | None = None,
) -> list[int]:
    """One input's token ids, checked: not empty, in the vocabulary, inside the context
    (an embedding's prompt takes all of it but the one token generated), or cut to it:
    `truncate` keeps its start (Ollama's), `last` its last tokens (vLLM's
    truncate_prompt_tokens)."""
    if isinstance(item, str):
        if not item:
            raise APIError(400, f"{param} must not be an empty string", param)
        try:
            valid_unicode(item)  # JSON can carry a lone surrogate, which no tokenizer takes
        except ValueError as exc:
            raise APIError(400, f"{param}: {exc}", param) from None
        ids = await routes.tokenized(
            functools.partial(state.appliance.tokenize, prompt=item), param
        )
    else:
        ids = list(item)
    vocab = state.appliance.model_config.vocab_size
    if not ids or max(ids) >= vocab or min(ids) < 0:
        raise APIError(400, f"{param} holds no tokens, or ids outside the vocabulary", param)
    room = state.appliance.max_model_len - 1
    ids = keep_last(ids, last, room)
    if len(ids) > room:
        if not truncate:
            raise APIError(
                400,
                f"an input has {len(ids)} tokens; this model embeds at most {room}",
                param,
                "context_length_exceeded",
            )
        ids = ids[:room]
    return ids


async def _embedded(
    request: Request, state: ServerState, prompts: list[list[int]]
) -> list[list[float]]:
    """Each prompt's embedding, in order; the inputs run in waves of the admission
    slots free at each wave's start, so chat requests are not shut out for long."""
    limit = state.settings.server.max_concurrent_requests
    vectors: list[list[float]] = []
    while len(vectors) < len(prompts):
        # As many as the free slots take (at least one: a 429 only when none is free).
        room = max(1, limit - state.in_flight)
        part = prompts[len(vectors) : len(vectors) + room]
        ticket = state.admit(len(part))
        try:
            found = await unless_disconnected(request, _run(state, part, request.state.arrival))
        except RequestFailed as exc:
            raise APIError(503, f"embedding failed: {exc}", retry_after=1) from None
        finally:
            ticket.release()
        if found is None:  # the client hung up
            raise APIError(499, "the client closed the request")
        vectors += found
    return vectors


async def _run(state: ServerState, prompts: list[list[int]], arrival: float) -> list[list[float]]:
    choices = [Choice(i, ids, EMBED, arrival) for i, ids in enumerate(prompts)]
    found: dict[int, list[float]] = {}
    generate = state.appliance.generate_ids
    async with aclosing(run_choices(generate, choices, state.metrics)) as chunks:
        async for index, chunk in chunks:
            if chunk.embedding is not None:
                found[index] = chunk.embedding
    missing = [i for i in range(len(prompts)) if i not in found]
    if missing:
        raise RequestFailed(f"no embedding came back for input {missing[0]}")
    broken = [i for i, v in found.items() if not all(map(math.isfinite, v))]
    if broken:  # JSON has no NaN; the hidden state overflowed the model's dtype
        raise RequestFailed(f"the embedding of input {broken[0]} is not finite")
    return [found[i] for i in range(len(prompts))]


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    """float: the numbers; base64: their little-endian float32 bytes (OpenAI's)."""
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
