"""POST /v1/responses: the request's conversation through the model's chat template and
the same pools as /v1/chat/completions, answered as one response object or as the
Responses API's event stream.

Key -> readiness -> body -> refusals -> validation -> model -> tokens -> output budget ->
admission -> the pools (generation.py) -> events; a whole response is the stream's last
event's response, so the two cannot disagree."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from appliance.api import Chunk, RequestFailed, SamplingParams
from appliance.chat.chat_output import ChatOutputs
from appliance.model.sampling_defaults import SamplingDefaults
from appliance.server import replies, routes
from appliance.server.body import read_json_object, validated
from appliance.server.errors import APIError
from appliance.server.generation import Choice, run_choices, unless_disconnected
from appliance.server.replies import Releasing, token_pieces
from appliance.server.responses import LOWEST_LOGPROB
from appliance.server.responses_api.events import (
    Draft,
    EventStream,
    OutputItems,
    usage,
)
from appliance.server.responses_api.request import (
    LOGPROBS,
    ResponsesRequest,
    chat_messages,
    refuse_unserved,
)
from appliance.server.responses_api.store import continued, input_items, keeping
from appliance.server.state import ServerState
from appliance.server.tool_fields import ChatTurn, constrained

log = logging.getLogger("appliance.server")
Events = AsyncIterator[dict[str, Any]]


async def create_response(request: Request) -> Response:
    """POST /v1/responses."""
    state: ServerState = request.app.state.server
    arrival = time.monotonic()
    state.authorize(request)
    body = await read_json_object(request, state.settings.server.max_body_bytes)
    state.check_ready()
    state.check_admission_open()
    refuse_unserved(body)
    body = continued(body, state.responses)  # the earlier turns first
    defaults = state.appliance.sampling_defaults
    req = validated(ResponsesRequest, defaults.fill(body, ResponsesRequest.DEFAULTED))
    state.check_model(req.model)
    state.check_room(1)
    tokenizer = state.appliance.tokenizer
    assert tokenizer is not None  # requests are served only once the tokenizer is loaded
    # As chat completions does: the tools in the prompt where the family's template reads
    # them, the constraint of tool_choice required or named, the readers of the output.
    turn = ChatTurn.of(tokenizer, chat_messages(req), req.tool_fields())
    outputs = turn.outputs()
    if req.wants_logprobs() and outputs is not None:
        # The parsers split the text into reasoning, reply and calls; token logprobs are
        # not split with it.
        raise APIError(
            400,
            f"include {LOGPROBS}: logprobs are served for a plain reply only, without "
            "tools and on a model without reasoning",
            "include",
            "unsupported",
        )
    ids = await _tokenize(turn)
    max_tokens = _output_budget(req, len(ids), state.appliance.max_model_len, defaults.max_tokens)
    try:
        params = _unfielded_defaults(req.sampling_params(max_tokens), defaults)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    choice = Choice(0, ids, constrained(params, turn.structured), arrival)
    ticket = state.admit(1)
    kept = req.store and state.responses.limit > 0
    draft = Draft(response_echo(req, state.appliance.model_name, kept))
    events = _events(state, choice, draft, outputs)
    if kept:
        events = keeping(events, state.responses, input_items(req.input) or [])
    if req.stream:
        sse = replies.typed_event_stream(events)
        return Releasing(sse, ticket)
    try:
        final = await unless_disconnected(request, _last(events))
    finally:
        ticket.release()
    if final is None:
        return Response(status_code=499)  # the client left: nobody reads it
    response = final["response"]
    if response["status"] == "failed":
        raise APIError(503, response["error"]["message"], retry_after=1)
    return JSONResponse(response)


async def get_response(request: Request) -> Response:
    """GET /v1/responses/{response_id}: a kept response; 404 for another."""
    state: ServerState = request.app.state.server
    state.authorize(request)
    return JSONResponse(state.responses.get(request.path_params["response_id"]).response)


async def delete_response(request: Request) -> Response:
    """DELETE /v1/responses/{response_id}: forget a kept response; 404 for another."""
    state: ServerState = request.app.state.server
    state.authorize(request)
    response_id = request.path_params["response_id"]
    state.responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def _tokenize(turn: ChatTurn) -> list[int]:
    ids = await routes.tokenized(turn.token_ids, "input")
    if not ids:
        raise APIError(400, "the prompt is empty", "input")
    return ids


def _unfielded_defaults(params: SamplingParams, defaults: SamplingDefaults) -> SamplingParams:
    """The model's sampling defaults this API has no field for (top_k, min_p,
    repetition_penalty): no request can say otherwise, so each applies as it is."""
    values = defaults.values
    top_k = values.get("top_k")
    return replace(
        params,
        top_k=params.top_k if top_k is None else max(int(top_k), 0),  # -1: none, as 0
        min_p=float(values.get("min_p", params.min_p)),
        repetition_penalty=float(values.get("repetition_penalty", params.repetition_penalty)),
    )


def _output_budget(
    req: ResponsesRequest, prompt_len: int, context: int, default: int | None
) -> int:
    """max_output_tokens, checked against the room the prompt leaves; unset, the model's
    default (max_new_tokens) within that room, or all of it."""
    if prompt_len >= context:
        raise APIError(
            400,
            f"the input has {prompt_len} tokens, but this model's context holds {context} "
            f"tokens (input + output); shorten the input to at most {context - 1} tokens",
            "input",
            "context_length_exceeded",
        )
    room = context - prompt_len
    if req.max_output_tokens is None:
        return room if default is None else min(default, room)
    if req.max_output_tokens > room:
        raise APIError(
            400,
            f"max_output_tokens is {req.max_output_tokens}, but the input has {prompt_len} "
            f"tokens and the context holds {context}: at most {room} tokens can be generated",
            "max_output_tokens",
            "context_length_exceeded",
        )
    return req.max_output_tokens


def response_echo(req: ResponsesRequest, model: str, kept: bool) -> dict[str, Any]:
    """The request fields every response object repeats, in OpenAI's shapes (`kept`:
    whether the server keeps it)."""
    return {
        "model": model,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls,
        "tool_choice": req.echoed_tool_choice(),
        "tools": [tool.echoed() for tool in req.tools],
        "text": {"format": req.text.format.echoed()},
        "store": kept,
        "background": False,
        "previous_response_id": req.previous_response_id,
        "top_logprobs": req.top_logprobs,
        "reasoning": {"effort": req.reasoning.effort, "summary": None},
        "truncation": "disabled",
        "metadata": req.metadata,
        "user": req.user,
    }


async def _events(
    state: ServerState, choice: Choice, draft: Draft, outputs: ChatOutputs | None
) -> Events:
    """The stream's events from response.created to the closing one; a failed generation
    ends it with response.failed (what was streamed stays in its output)."""
    stream = EventStream(draft)
    for event in stream.opening():
        yield event
    try:
        async for event in _generated(state, choice, OutputItems(stream), outputs):
            yield event
    except RequestFailed as exc:
        draft.fail("server_error", f"generation failed: {exc}")
    except Exception as exc:  # a bug: still end the stream properly, and say what broke
        log.exception("responses stream failed")
        draft.fail("server_error", f"internal error: {type(exc).__name__}: {exc}")
    yield stream.closing()


async def _generated(
    state: ServerState, choice: Choice, items: OutputItems, outputs: ChatOutputs | None
) -> Events:
    """The output items' events as the pools generate. `outputs` reads reasoning and tool
    calls out of the text (None: the text is all reply)."""
    output_tokens = cached = 0
    reason = None
    logprobs = Logprobs(state) if choice.params.logprobs is not None else None
    generate = state.appliance.generate_ids
    async with aclosing(run_choices(generate, [choice], state.metrics)) as chunks:
        async for _, chunk in chunks:
            output_tokens += len(chunk.token_ids)
            cached = max(cached, chunk.cached_tokens)
            if chunk.finished:
                reason = chunk.finish_reason
            if outputs is None:
                entries = logprobs.of(chunk) if logprobs is not None else None
                for event in items.text(chunk.text, entries):
                    yield event
                continue
            fields, _ = outputs.delta(0, outputs.text_of(0, chunk), reason)
            for event in _items_of(items, fields):
                yield event
    prompt_len = len(choice.prompt_ids)
    written = _cache_written(state, prompt_len, cached)
    items.stream.draft.finish(reason, usage(prompt_len, output_tokens, cached, written))
    for event in items.finish(logprobs.pending if logprobs is not None else None):
        yield event


class Logprobs:
    """The logprob entries of a reply's tokens (token, bytes, logprob, top_logprobs), in
    the Responses API's shape; tokens whose text is held back (a partial character) wait
    for the next text."""

    def __init__(self, state: ServerState) -> None:
        self.piece = token_pieces(state)
        self.pending: list[dict[str, Any]] = []

    def of(self, chunk: Chunk) -> list[dict[str, Any]]:
        """The entries of the tokens whose text this chunk completes (none while its text
        is held back: they wait in `pending`)."""
        self.pending += [
            {
                **self._entry(t.token_id, t.logprob),
                "top_logprobs": [self._entry(i, lp) for i, lp in t.top],
            }
            for t in chunk.logprobs or []
        ]
        if not chunk.text:
            return []
        entries, self.pending = self.pending, []
        return entries

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": self.piece(token_id),
            "bytes": list(self.piece.bytes_of(token_id)),  # part of a character: its bytes
            "logprob": max(logprob, LOWEST_LOGPROB),  # JSON has no -inf
        }


def _items_of(items: OutputItems, fields: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a chat delta's fields (reasoning_content, content, tool_calls: each
    call's index, id and name first, then its argument fragments)."""
    events = items.reasoning(fields.get("reasoning_content", ""))
    events += items.text(fields.get("content", ""))
    for call in fields.get("tool_calls", []):
        function = call["function"]
        events += items.call(
            call["index"], function.get("name"), function["arguments"], call.get("id", "")
        )
    return events


def _cache_written(state: ServerState, prompt_len: int, cached: int) -> int:
    """Input tokens the prefix cache keyed anew: the prompt's full blocks it did not
    already hold (only full blocks are keyed)."""
    kv = state.settings.kv
    if not kv.prefix_caching:
        return 0
    return max(0, prompt_len // kv.block_size * kv.block_size - cached)


async def _last(events: Events) -> dict[str, Any]:
    """Run the events to their end: the closing one."""
    last: dict[str, Any] = {}
    async with aclosing(events) as each:  # type: ignore[type-var]
        async for event in each:
            last = event
    return last
