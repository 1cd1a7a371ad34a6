"""Anthropic's Messages API, for the applications written against it (Anthropic's SDKs,
coding agents pointed at a local model through ANTHROPIC_BASE_URL): POST /v1/messages,
streamed as Anthropic's named events unless `stream` is false, and POST
/v1/messages/count_tokens. Errors are Anthropic's {"type": "error", "error": {...}}
(errors.APIError.response); the API key is taken as `x-api-key` or a bearer token.

A request is made into the chat completion the OpenAI route serves (request.py), run
through the same path (routes.prepared_chat), and the OpenAI stream read back into
Anthropic's events (reply.py); an error that path raises names the request's fields
(field_names.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from appliance.server import replies, routes, tokenization
from appliance.server.anthropic_api.field_names import in_anthropic_terms
from appliance.server.anthropic_api.reply import AnthropicReply, Event, message
from appliance.server.anthropic_api.request import MessagesRequest
from appliance.server.body import validated
from appliance.server.errors import APIError


async def messages(request: Request) -> Response:
    """POST /v1/messages."""
    state, body = await routes.accept(request)
    req = validated(MessagesRequest, body)
    chat = req.chat_body(body)
    try:
        prepared = await routes.prepared_chat(request, state, chat)
    except APIError as exc:  # the chat body's checks name its fields: name the request's
        raise in_anthropic_terms(exc, req.message_origins()) from None
    reply = AnthropicReply(
        state.appliance.model_name, prepared.prompt_tokens, tuple(req.stop_sequences)
    )
    ticket = state.admit(len(prepared.choices))
    data = replies.stream_data(
        state, prepared.choices, prepared.envelope, prepared.prompt_tokens, True
    )
    events = _events(data, reply)
    if req.stream:
        sse = replies.typed_event_stream(events)
        return replies.Releasing(sse, ticket)
    return await replies.whole_answer(request, _gathered(events), ticket)


async def count_tokens(request: Request) -> Response:
    """POST /v1/messages/count_tokens: the prompt a message request would prefill."""
    state, body = await routes.accept(request)
    req = validated(MessagesRequest, body)
    tokenizer = state.appliance.tokenizer
    assert tokenizer is not None  # requests are served only once the tokenizer is loaded
    chat = req.chat_body(body) | {"stream": False}
    try:
        turn = await tokenization.chat_turn(state, tokenizer, chat)
        ids = await routes.tokenized(turn.token_ids, "messages")
    except APIError as exc:
        raise in_anthropic_terms(exc, req.message_origins()) from None
    return JSONResponse({"input_tokens": len(ids)})


async def _events(data: AsyncGenerator[str], reply: AnthropicReply) -> AsyncGenerator[Event]:
    """Anthropic's events from the OpenAI stream's data lines; a failed generation ends
    with Anthropic's error event."""
    yield reply.start()
    finish, stop = None, None
    async with aclosing(data) as lines:
        async for line in lines:
            if line == "[DONE]":
                continue
            chunk = json.loads(line)
            if "error" in chunk:
                # a failed generation (503): the kind Anthropic's clients retry
                error = {"type": "overloaded_error", "message": chunk["error"]["message"]}
                yield {"type": "error", "error": error}
                return
            for choice in chunk.get("choices") or []:
                finish = choice.get("finish_reason") or finish
                stop = choice.get("stop_reason", stop)
                for event in reply.piece(choice.get("delta") or {}):
                    yield event
            if chunk.get("usage") is not None:
                for event in reply.last(finish, stop, chunk["usage"]):
                    yield event


async def _gathered(events: AsyncGenerator[Event]) -> dict[str, Any]:
    """`stream: false`: the message the events build; a failed generation a 503."""
    seen = []
    async with aclosing(events) as each:
        async for event in each:
            if event["type"] == "error":
                raise APIError(503, event["error"]["message"], retry_after=1)
            seen.append(event)
    return message(seen)
