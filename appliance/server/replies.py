"""Answering a request from its running choices: one JSON body, or an SSE stream of
OpenAI chunks that always ends with `[DONE]` (after an error event if generation fails)."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from sse_starlette.sse import EventSourceResponse
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from appliance.api import RequestFailed, TokenLogprobs
from appliance.server.errors import APIError
from appliance.server.generation import Choice, run_choices
from appliance.server.responses import Envelope, Logprobs, Piece, usage
from appliance.server.state import ServerState, Ticket

log = logging.getLogger("appliance.server")
SEND_TIMEOUT_S = 30  # a client that stops reading for this long is dropped (frees its slot)


async def whole(
    state: ServerState, choices: list[Choice], envelope: Envelope, prompt_tokens: int
) -> dict[str, Any]:
    """Every choice run to its end, as one OpenAI response body."""
    texts = [""] * len(choices)
    reasons: list[str | None] = [None] * len(choices)
    cached = [0] * len(choices)
    tokens: list[list[TokenLogprobs]] = [[] for _ in choices]
    generated = 0
    generate = state.appliance.generate_ids
    async with aclosing(run_choices(generate, choices, state.metrics)) as chunks:
        async for index, chunk in chunks:
            texts[index] += envelope.shape.text_of(index, chunk)
            generated += len(chunk.token_ids)
            cached[index] = max(cached[index], chunk.cached_tokens)
            tokens[index].extend(chunk.logprobs or [])
            if chunk.finished:
                reasons[index] = chunk.finish_reason
    pieces = token_pieces(state)
    body = [
        envelope.shape.choice(
            i, texts[i], reasons[i], _logprobs(envelope, choices[i], tokens[i], pieces, 0)
        )
        for i in range(len(choices))
    ]
    return envelope.whole(body, usage(prompt_tokens, generated, cached_prompt(choices, cached)))


def token_pieces(state: ServerState) -> Piece:
    """Each token id's text as logprobs name it: the tokenizer's decoding of it alone,
    special tokens kept (vLLM's), remembered for the request."""
    tokenizer = state.appliance.tokenizer
    assert tokenizer is not None  # requests are served only once the tokenizer is loaded

    @functools.lru_cache(maxsize=4096)
    def piece(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return piece


def _logprobs(
    envelope: Envelope, choice: Choice, tokens: list[TokenLogprobs], pieces: Piece, offset: int
) -> Logprobs:
    """A choice's "logprobs" value: None unless its request asked for logprobs."""
    if choice.params.logprobs is None:
        return None
    return envelope.shape.logprobs(tokens, pieces, offset)


def cached_prompt(choices: list[Choice], cached: list[int]) -> int:
    """Prompt tokens served from the prefix cache, counted once per prompt as
    prompt_tokens is (n choices of one prompt count it once)."""
    per_prompt: dict[tuple[int, ...], int] = {}
    for choice, tokens in zip(choices, cached, strict=True):
        key = tuple(choice.prompt_ids)
        per_prompt[key] = max(per_prompt.get(key, 0), tokens)
    return sum(per_prompt.values())


def streamed(
    state: ServerState,
    choices: list[Choice],
    envelope: Envelope,
    prompt_tokens: int,
    include_usage: bool,
    ticket: Ticket,
) -> Releasing:
    events = _events(state, choices, envelope, prompt_tokens, include_usage)
    response = EventSourceResponse(events, sep="\n", send_timeout=SEND_TIMEOUT_S)
    return Releasing(response, ticket)


async def _events(
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
    cached = [0] * len(choices)
    # Logprobs of tokens whose text is held back (a possible stop string, a partial
    # character) wait for the next delta; `sent`: characters streamed so far.
    pending: list[list[TokenLogprobs]] = [[] for _ in choices]
    sent = [0] * len(choices)
    pieces = token_pieces(state)
    try:
        for c in choices:
            opening = envelope.shape.opening(c.index)
            if opening is not None:
                yield chunk(opening)
        generate = state.appliance.generate_ids
        async with aclosing(run_choices(generate, choices, state.metrics)) as chunks:
            async for index, piece in chunks:
                generated += len(piece.token_ids)
                cached[index] = max(cached[index], piece.cached_tokens)
                pending[index].extend(piece.logprobs or [])
                text = envelope.shape.text_of(index, piece)  # what tool parsers read
                if text or piece.finished:
                    logprobs = _logprobs(
                        envelope, choices[index], pending[index], pieces, sent[index]
                    )
                    pending[index], sent[index] = [], sent[index] + len(piece.text)
                    delta = envelope.shape.delta(index, text, piece.finish_reason, logprobs)
                    yield chunk(delta)
        if include_usage:
            total = usage(prompt_tokens, generated, cached_prompt(choices, cached))
            yield _json(envelope.chunk([], total, True))
    except RequestFailed as exc:
        yield _json(APIError(503, f"generation failed: {exc}").body())
    except Exception as exc:  # a bug: still end the stream properly, and say what broke
        log.exception("stream failed")
        yield _json(APIError(500, f"internal error: {type(exc).__name__}: {exc}").body())
    yield "[DONE]"


def _json(value: dict[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"))


class Releasing(Response):
    """A streamed response that gives its admission back however the stream ends
    (finished, failed, or the client hung up before it began)."""

    def __init__(self, response: Response, ticket: Ticket) -> None:
        self.response = response
        self.ticket = ticket
        self.status_code = response.status_code
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.ticket.release()
