"""The routes: OpenAI's chat and text completions and model list, health, metrics.

A completion request goes: key -> readiness -> body -> validation -> model -> tokens ->
context check -> admission -> the pools (generation.py) -> JSON or SSE."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from appliance.server import replies
from appliance.server.body import read_json_object, validated
from appliance.server.errors import APIError
from appliance.server.generation import Choice
from appliance.server.infill import Infill, infill_prompts
from appliance.server.prediction import prediction_ids
from appliance.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenEndedCompletion,
    SamplingFields,
    unsupported_field,
    unsupported_message,
)
from appliance.server.responses import ChatShape, CompletionShape, Envelope, Shape
from appliance.server.state import ServerState
from appliance.server.tool_fields import ChatTurn
from appliance.tracing.spans import annotate

R = TypeVar("R", bound=BaseModel)
T = TypeVar("T")


async def chat_completions(request: Request) -> Response:
    """POST /v1/chat/completions: messages through the model's chat template."""
    state, body = await accept(request)
    return await _respond(request, state, await prepared_chat(request, state, body))


async def prepared_chat(request: Request, state: ServerState, body: dict[str, Any]) -> Prepared:
    """A chat completion's body made into its choices (Ollama's /api/chat, ollama_api/,
    answers from these too)."""
    defaults = state.appliance.sampling_defaults
    req = validated(ChatCompletionRequest, defaults.fill(body, ChatCompletionRequest.DEFAULTED))
    _precheck(state, req, num_prompts=1)
    messages = [m.for_template() for m in req.messages]
    tokenizer = state.appliance.tokenizer
    assert tokenizer is not None  # requests are served only once the tokenizer is loaded
    # The tools in the prompt where the family's template reads them, the constraint of
    # tool_choice required or named, and the readers of calls and reasoning (appliance/chat).
    turn = ChatTurn.of(tokenizer, messages, req, state.settings.server.trust_request_chat_template)
    req.constrain_tool_calls(turn.structured)
    ids = await tokenized(turn.token_ids, "messages")
    if not ids:
        raise APIError(400, "the prompt is empty", "messages")
    outputs = turn.outputs(tuple(req.stop), req.include_stop_str_in_output)
    return await _prepared(request, state, req, [ids], ChatShape(outputs))


async def completions(request: Request) -> Response:
    """POST /v1/completions: raw text or token-id prompts, one or a batch."""
    state, body = await accept(request)
    return await _respond(request, state, await prepared_completion(request, state, body))


async def prepared_completion(
    request: Request,
    state: ServerState,
    body: dict[str, Any],
    open_ended: bool = False,
    infill: Infill | None = None,
) -> Prepared:
    """A text completion's body made into its choices (Ollama's raw /api/generate and
    llama.cpp's /completion too: `open_ended`, no OpenAI 16-token default); at a cursor
    with a `suffix` (or llama.cpp's /infill: `infill`), the model's infill of it."""
    defaults = state.appliance.sampling_defaults
    kind = OpenEndedCompletion if open_ended else CompletionRequest
    req = validated(kind, defaults.fill(body, kind.DEFAULTED))
    _precheck(state, req, num_prompts=len(req.prompts()))
    infill = infill or (Infill(req.suffix) if req.suffix else None)
    if infill is not None:
        prompts, req = await infill_prompts(state, req, infill)
        return await _prepared(request, state, req, prompts, CompletionShape(False))
    vocab = state.appliance.model_config.vocab_size
    prompts = []
    for prompt in req.prompts():
        ids = await tokenized(functools.partial(state.appliance.tokenize, prompt=prompt), "prompt")
        if max(ids) >= vocab:
            raise APIError(
                400, f"token id {max(ids)} is outside the vocabulary ({vocab})", "prompt"
            )
        prompts.append(ids)
    return await _prepared(request, state, req, prompts, CompletionShape(req.echo))


async def models(request: Request) -> Response:
    """GET /v1/models: the one model served."""
    state: ServerState = request.app.state.server
    state.authorize(request)
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def model(request: Request) -> Response:
    """GET /v1/models/{id}: the served model's card; 404 (model_not_found) for another id."""
    state: ServerState = request.app.state.server
    state.authorize(request)
    state.check_model(request.path_params["model_id"])
    return JSONResponse(_model_card(state))


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.appliance.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "appliance",
        "max_model_len": state.appliance.max_model_len if state.appliance.ready else None,
    }


async def health(request: Request) -> Response:
    """200 while it serves: `ok`, or `degraded` when a worker is down (restarting, or its
    device failed) but every pool still has a live one; else 503 (`starting`, `stopping`,
    `failed`, `unavailable`). The pools' states either way, each worker with the context
    its KV pool holds (`kv_tokens`, and `max_model_len`, the longest prompt + output it
    takes; null until it has loaded), and the longest a request may be (`max_model_len`)."""
    state: ServerState = request.app.state.server
    workers = [asdict(v) for v in state.appliance.state.views()]
    block_size = state.settings.kv.block_size
    model_limit = _model_limit(state)
    pools: dict[str, list[dict[str, Any]]] = {}
    for worker in workers:
        loaded = worker["num_blocks"] > 0
        worker["kv_tokens"] = worker["num_blocks"] * block_size
        worker["max_model_len"] = min(model_limit, worker["kv_tokens"]) if loaded else None
        pools.setdefault(worker["role"], []).append(worker)
    every_pool_alive = all(any(w["alive"] for w in pool) for pool in pools.values())
    if state.startup_error is not None:
        status = "failed"
    elif state.draining:
        status = "stopping"
    elif not state.appliance.ready:
        status = "starting"
    else:
        all_alive = all(w["alive"] for w in workers)
        status = "unavailable" if not every_pool_alive else "ok" if all_alive else "degraded"
    body = {
        "status": status,
        "model": state.appliance.model_name,
        "mode": state.settings.mode,
        "pools": pools,
        "kv_block_size": block_size,
        "max_model_len": state.appliance.max_model_len if state.appliance.ready else None,
        "generations_admitted": state.in_flight,
        "failed_devices": sorted(state.appliance.state.failed_devices),
        "error": state.startup_error,
    }
    return JSONResponse(body, status_code=200 if status in ("ok", "degraded") else 503)


def _model_limit(state: ServerState) -> int:
    """The longest prompt + output the model and batch.max_model_len allow, whatever the
    KV pools hold."""
    context = state.appliance.model_config.max_position_embeddings
    return min(state.settings.batch.max_model_len or context, context)


async def metrics(request: Request) -> Response:
    """GET /metrics: Prometheus text format."""
    state: ServerState = request.app.state.server
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# ---------------------------------------------------------------- the steps


async def accept(request: Request) -> tuple[ServerState, dict[str, Any]]:
    """A generation request's server state and JSON body, once its key, the server's
    readiness and admission, and the fields it may not send are checked."""
    state: ServerState = request.app.state.server
    request.state.arrival = time.monotonic()
    state.authorize(request)
    body = await read_json_object(request, state.settings.server.max_body_bytes)
    state.check_ready()
    state.check_admission_open()
    field = unsupported_field(body)
    if field is not None:
        raise APIError(400, unsupported_message(field), field, "unsupported")
    return state, body


def _precheck(state: ServerState, req: SamplingFields, num_prompts: int) -> None:
    """What can be refused before paying for tokenization."""
    state.check_model(req.model)
    req.check_sampling(state.appliance.model_config.vocab_size)
    limits = state.settings.server
    if req.n > limits.max_n:
        raise APIError(422, f"n is {req.n}; at most {limits.max_n}", "n")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options needs stream: true", "stream_options")
    count = num_prompts * req.n
    if count > limits.max_concurrent_requests:
        raise APIError(
            400,
            f"{num_prompts} prompt(s) x n={req.n} is {count} generations; this server runs "
            f"at most {limits.max_concurrent_requests} at once",
            "prompt",
        )
    state.check_room(count)


async def tokenized(tokenize: Callable[[], T], param: str) -> T:
    """The tokenizer's work (encoding, rendering a template, decoding) off the loop that
    streams the others: long prompts take milliseconds to seconds. A ValueError (an empty
    prompt, a template that rejects the messages) is a 400 naming `param`."""
    try:
        return await asyncio.to_thread(tokenize)
    except ValueError as exc:  # an empty prompt, a template that rejects the messages
        raise APIError(400, str(exc), param) from None


async def tokenized_words(state: ServerState, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word as it starts a text and after a
    space (where that is other tokens), so it is barred in both places."""
    tokenizer = state.appliance.tokenizer
    assert tokenizer is not None  # requests are served only once the tokenizer is loaded

    def encode() -> tuple[tuple[int, ...], ...]:
        found: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                found[tuple(tokenizer.encode_text(text))] = None
        return tuple(ids for ids in found if ids)

    return await asyncio.to_thread(encode) if words else ()


def _max_tokens(
    req: SamplingFields, prompt_len: int, context: int, param: str, default: int | None
) -> int:
    """The output budget: what was asked, checked against the room the prompt leaves;
    unasked, the model's default (max_new_tokens) or the route's, within that room."""
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
        return min(default, room) if default is not None else req.default_max_tokens(room)
    if asked > room and req.CAPPED_AT_ROOM:
        return room
    if asked > room:
        field = req.max_tokens_field()
        raise APIError(
            400,
            f"{field} is {asked}, but the prompt has {prompt_len} tokens and the context "
            f"holds {context}: at most {room} tokens can be generated",
            field,
            "context_length_exceeded",
        )
    return asked


def _choices(
    req: SamplingFields,
    prompts: list[list[int]],
    context: int,
    param: str,
    arrival: float,
    tokenized: dict[str, Any] | None = None,
    default_max_tokens: int | None = None,
) -> list[Choice]:
    """n choices per prompt, each with its checked output budget and its own seed, and
    the parameters only the tokenizer fills (`tokenized`: the prediction, bad words)."""
    choices = []
    for p, ids in enumerate(prompts):
        max_tokens = _max_tokens(req, len(ids), context, param, default_max_tokens)
        for j in range(req.n):
            params = replace(req.sampling_params(max_tokens, j), **(tokenized or {}))
            choices.append(Choice(p * req.n + j, ids, params, arrival))
    return choices


@dataclass(frozen=True)
class Prepared:
    """A request's checked choices and the envelope its answer goes out in."""

    req: SamplingFields
    choices: list[Choice]
    envelope: Envelope
    prompt_tokens: int


async def _prepared(
    request: Request,
    state: ServerState,
    req: SamplingFields,
    prompts: list[list[int]],
    shape: Shape,
) -> Prepared:
    param = "messages" if isinstance(shape, ChatShape) else "prompt"
    context = state.appliance.max_model_len
    prompts = [req.truncated(ids, context) for ids in prompts]
    tokenized = {
        "prediction": await prediction_ids(state, req, context),
        "bad_words": await tokenized_words(state, req.bad_words),
    }
    default = state.appliance.sampling_defaults.max_tokens
    arrival = request.state.arrival
    choices = _choices(req, prompts, context, param, arrival, tokenized, default)
    envelope = Envelope(
        shape,
        state.appliance.model_name,
        prompt_logprobs=req.prompt_logprobs,
        tokens_as_ids=req.return_tokens_as_token_ids,
    )
    prompt_tokens = sum(len(ids) for ids in prompts)
    annotate(
        {
            "gen_ai.response.id": envelope.id,
            "gen_ai.request.model": state.appliance.model_name,
            "gen_ai.request.n": req.n,
            "gen_ai.usage.input_tokens": prompt_tokens,
        }
    )
    return Prepared(req, choices, envelope, prompt_tokens)


async def _respond(request: Request, state: ServerState, prepared: Prepared) -> Response:
    req, choices = prepared.req, prepared.choices
    envelope, prompt_tokens = prepared.envelope, prepared.prompt_tokens
    ticket = state.admit(len(choices))
    if req.stream:
        return replies.streamed(state, choices, envelope, prompt_tokens, req.include_usage, ticket)
    work = replies.whole(state, choices, envelope, prompt_tokens)
    return await replies.whole_answer(request, work, ticket)
