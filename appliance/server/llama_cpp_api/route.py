"""llama.cpp server's own routes, for the applications written against them (editor
plugins' llama.cpp providers, SillyTavern, llama.cpp's Python and JavaScript helpers):
POST /completion (also /completions), streamed as server-sent events unless `stream`
is false; POST /infill, code completion at a cursor (server/infill.py); GET /props, the
server's model and defaults. /tokenize, /detokenize and
/apply-template take llama.cpp's fields too (server/tokenization.py); /health and
/v1/* answer as llama-server's do.

A /completion is made into the text completion the OpenAI route serves (request.py),
checked and tokenized on the same path (routes.prepared_completion), run on the pools,
and its chunks put in llama.cpp's shape (reply.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from appliance.api import RequestFailed, SamplingParams
from appliance.model.model_source import default_model_path
from appliance.server import replies, routes
from appliance.server.body import validated
from appliance.server.errors import APIError
from appliance.server.generation import Choice, run_choices
from appliance.server.infill import Infill
from appliance.server.llama_cpp_api.reply import LlamaReply, llama_samplers
from appliance.server.llama_cpp_api.request import RENAMED, LlamaCompletion, LlamaInfill
from appliance.server.state import ServerState, server_version


async def completion(request: Request) -> Response:
    """POST /completion: one prompt (text or token ids), streamed or whole."""
    state, body = await routes.accept(request)
    req = validated(LlamaCompletion, body)
    return await _serve(request, state, req, body, None)


async def infill(request: Request) -> Response:
    """POST /infill: code completion at a cursor, in the model's infill markers."""
    state, body = await routes.accept(request)
    req = validated(LlamaInfill, body)
    return await _serve(request, state, req, body, req.infill())


async def _serve(
    request: Request,
    state: ServerState,
    req: LlamaCompletion,
    body: dict[str, Any],
    infill: Infill | None,
) -> Response:
    completion_body = req.completion_body(body, state.appliance.model_name)
    try:
        prepared = await routes.prepared_completion(
            request, state, completion_body, open_ended=True, infill=infill
        )
    except APIError as exc:  # named as the client named it
        exc.param = RENAMED.get(exc.param or "", exc.param)
        raise
    choice = prepared.choices[0]  # one prompt, n 1
    reply = _reply(state, req, choice)
    ticket = state.admit(1)
    if req.stream:
        events = EventSourceResponse(
            _events(state, choice, reply), sep="\n", send_timeout=replies.SEND_TIMEOUT_S
        )
        return replies.Releasing(events, ticket)
    return await replies.whole_answer(request, _whole(state, choice, reply), ticket)


def _reply(state: ServerState, req: LlamaCompletion, choice: Choice) -> LlamaReply:
    tokenizer = state.appliance.tokenizer
    assert tokenizer is not None  # requests are served only once the tokenizer is loaded
    return LlamaReply(
        tokenizer,
        replies.token_pieces(state),
        state.appliance.model_name,
        choice.prompt_ids,
        choice.params,
        choice.arrival,
        n_probs=req.n_probs,
        probabilities=req.post_sampling_probs,
        return_tokens=req.return_tokens,
        n_ctx=state.appliance.max_model_len,
    )


async def _whole(state: ServerState, choice: Choice, reply: LlamaReply) -> dict[str, Any]:
    chunks = run_choices(state.appliance.generate_ids, [choice], state.metrics)
    async with aclosing(chunks) as pieces:
        async for _, chunk in pieces:
            reply.piece(chunk)
    return reply.last(streamed=False)


async def _events(state: ServerState, choice: Choice, reply: LlamaReply) -> AsyncIterator[str]:
    """SSE data: a piece per chunk, then the last object (llama.cpp sends no [DONE]); a
    failed generation ends with llama.cpp's error object."""
    chunks = run_choices(state.appliance.generate_ids, [choice], state.metrics)
    try:
        async with aclosing(chunks) as pieces:
            async for _, chunk in pieces:
                line = reply.piece(chunk)
                if line["content"] or line["tokens"]:
                    yield _json(line)
        yield _json(reply.last(streamed=True))
    except RequestFailed as exc:
        yield _json({"error": {"code": 503, "message": f"generation failed: {exc}"}})


def _json(value: dict[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


async def props(request: Request) -> Response:
    """GET /props: the served model, its template and context, and the defaults a
    /completion samples with where it names none."""
    state: ServerState = request.app.state.server
    state.authorize(request)
    state.check_ready()
    appliance = state.appliance
    tokenizer = appliance.tokenizer
    assert tokenizer is not None
    defaults = appliance.sampling_defaults.values
    params = {
        "n_predict": defaults.get("max_new_tokens", -1),
        "temperature": defaults.get("temperature", 1.0),
        "top_k": defaults.get("top_k", -1),
        "top_p": defaults.get("top_p", 1.0),
        "min_p": defaults.get("min_p", 0.0),
        "repeat_penalty": defaults.get("repetition_penalty", 1.0),
        **llama_samplers(SamplingParams()),  # off, as the server starts them
        "seed": -1,
    }
    settings = {"id": 0, "id_task": -1, "n_ctx": appliance.max_model_len, "params": params}
    return JSONResponse(
        {
            "default_generation_settings": settings,
            "total_slots": state.settings.server.max_concurrent_requests,
            "model_alias": appliance.model_name,
            "model_path": str(state.settings.model or default_model_path()),
            "chat_template": tokenizer.chat_template or "",
            "bos_token": tokenizer.special_tokens.get("bos_token", ""),
            "eos_token": tokenizer.special_tokens.get("eos_token", ""),
            "modalities": {"vision": False, "audio": False},
            "build_info": f"appliance {server_version()}",
        }
    )
