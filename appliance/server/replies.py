"""Answering a request from its running choices: one JSON body, or an SSE stream of
OpenAI chunks that always ends with `[DONE]` (after an error event if generation fails)."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from contextlib import aclosing
from typing import Any

from sse_starlette import ServerSentEvent
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from appliance.api import RequestFailed, TokenLogprobs
from appliance.model.tokenizer import Tokenizer
from appliance.server.errors import APIError
from appliance.server.generation import Choice, run_choices, unless_disconnected
from appliance.server.prediction import prediction_usage
from appliance.server.responses import (
    ChatShape,
    CompletionShape,
    Envelope,
    Logprobs,
    Piece,
    usage,
    vllm_prompt_logprobs,
)
from appliance.server.state import ServerState, Ticket
from appliance.server.stop_reason import stop_reason

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
    prompts: list[list[TokenLogprobs] | None] = [None] * len(choices)
    outputs: list[list[int]] = [[] for _ in choices]
    raw = [""] * len(choices)  # the text as generated, before any parser read it
    generate = state.appliance.generate_ids
    async with aclosing(run_choices(generate, choices, state.metrics)) as chunks:
        async for index, chunk in chunks:
            texts[index] += envelope.shape.text_of(index, chunk)
            raw[index] += chunk.text
            outputs[index].extend(chunk.token_ids)
            cached[index] = max(cached[index], chunk.cached_tokens)
            tokens[index].extend(chunk.logprobs or [])
            prompts[index] = chunk.prompt_logprobs or prompts[index]
            if chunk.finished:
                reasons[index] = chunk.finish_reason
    pieces = token_pieces(state, envelope.tokens_as_ids)
    body = []
    for i, choice in enumerate(choices):
        prefix, head = _echo(state, envelope, choice, prompts[i], pieces)
        tail = _logprobs(envelope, choice, tokens[i], pieces, _end(head, prefix))
        answer = envelope.shape.choice(i, prefix + texts[i], reasons[i], _joined(head, tail))
        answer["stop_reason"] = _stop_reason(state, choice, reasons[i], outputs[i], raw[i])
        body.append(answer)
    result = envelope.whole(body, _usage(choices, prompt_tokens, cached, outputs))
    k = envelope.prompt_logprobs
    if k is not None:  # vLLM's: on each completion choice; once for a chat (one prompt)
        found = [
            vllm_prompt_logprobs(choice.prompt_ids, prompts[i] or [], pieces, k)
            for i, choice in enumerate(choices)
        ]
        if isinstance(envelope.shape, ChatShape):
            result["prompt_logprobs"] = found[0]
        else:
            for entry, logprobs in zip(body, found, strict=True):
                entry["prompt_logprobs"] = logprobs
    return result


def _usage(
    choices: list[Choice], prompt_tokens: int, cached: list[int], outputs: list[list[int]]
) -> dict[str, Any]:
    """The answer's usage: its token counts, and where a prediction was sent, how much of
    it the answers hold (prediction.py)."""
    generated = sum(len(ids) for ids in outputs)
    counts = usage(prompt_tokens, generated, cached_prompt(choices, cached))
    return counts | prediction_usage([c.params.prediction for c in choices], outputs)


def token_pieces(state: ServerState, as_ids: bool = False) -> Piece:
    """Each token id's text as logprobs name it: the tokenizer's decoding of it alone,
    special tokens kept (vLLM's), or with `as_ids` "token_id:N" (vLLM's
    return_tokens_as_token_ids); and its bytes; remembered for the request."""
    tokenizer = state.appliance.tokenizer
    assert tokenizer is not None  # requests are served only once the tokenizer is loaded
    return _Pieces(tokenizer, as_ids)


class _Pieces:
    """A Piece over the tokenizer: each token's text and bytes, found once."""

    def __init__(self, tokenizer: Tokenizer, as_ids: bool = False) -> None:
        self._text = functools.lru_cache(maxsize=4096)(self._decoded)
        self.bytes_of = functools.lru_cache(maxsize=4096)(tokenizer.token_bytes)
        self._tokenizer = tokenizer
        self._as_ids = as_ids

    def __call__(self, token_id: int, /) -> str:
        return self._text(token_id)

    def _decoded(self, token_id: int) -> str:
        if self._as_ids:
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


def _logprobs(
    envelope: Envelope, choice: Choice, tokens: list[TokenLogprobs], pieces: Piece, offset: int
) -> Logprobs:
    """A choice's "logprobs" value: None unless its request asked for logprobs."""
    if choice.params.logprobs is None:
        return None
    return envelope.shape.logprobs(tokens, pieces, offset)


def _echo(
    state: ServerState,
    envelope: Envelope,
    choice: Choice,
    prompt: list[TokenLogprobs] | None,
    pieces: Piece,
) -> tuple[str, Logprobs]:
    """What a completion with echo puts first: the prompt's text, and with logprobs the
    prompt's tokens and their logprobs (`prompt`, from the first chunk). Else nothing."""
    shape = envelope.shape
    if not isinstance(shape, CompletionShape) or not shape.echo:
        return "", None
    tokenizer = state.appliance.tokenizer
    assert tokenizer is not None  # requests are served only once the tokenizer is loaded
    text = tokenizer.decode(choice.prompt_ids)
    if choice.params.logprobs is None:
        return text, None
    return text, shape.prompt_logprobs(
        choice.prompt_ids, prompt or [], pieces, choice.params.logprobs
    )


def _end(head: Logprobs, prefix: str) -> int:
    """Where the generated tokens' text offsets start after an echoed prompt."""
    if head is None or not head["tokens"]:
        return len(prefix)
    return int(head["text_offset"][-1]) + len(head["tokens"][-1])


def _joined(head: Logprobs, tail: Logprobs) -> Logprobs:
    """The echoed prompt's logprobs followed by the generated tokens' (same keys)."""
    if head is None or tail is None:
        return tail if head is None else head
    return {key: head[key] + tail[key] for key in head}


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
    events = stream_data(state, choices, envelope, prompt_tokens, include_usage)
    response = EventSourceResponse(events, sep="\n", send_timeout=SEND_TIMEOUT_S)
    return Releasing(response, ticket)


async def stream_data(
    state: ServerState,
    choices: list[Choice],
    envelope: Envelope,
    prompt_tokens: int,
    include_usage: bool,
) -> AsyncGenerator[str]:
    """SSE data lines: OpenAI's chunks, an error event if generation fails, then [DONE]."""

    def chunk(choice: dict[str, Any]) -> str:
        return _json(envelope.chunk([choice], None, include_usage))

    outputs: list[list[int]] = [[] for _ in choices]
    raw = [""] * len(choices)  # the text as generated, before any parser read it
    cached = [0] * len(choices)
    # Logprobs of tokens whose text is held back (a possible stop string, a partial
    # character) wait for the next delta; `sent`: characters streamed so far.
    pending: list[list[TokenLogprobs]] = [[] for _ in choices]
    sent = [0] * len(choices)
    prompts: list[list[TokenLogprobs] | None] = [None] * len(choices)
    echoed = [False] * len(choices)  # echo: the prompt went out with the first delta
    pieces = token_pieces(state, envelope.tokens_as_ids)
    try:
        for c in choices:
            opening = envelope.shape.opening(c.index)
            if opening is not None:
                yield chunk(opening)
        generate = state.appliance.generate_ids
        async with aclosing(run_choices(generate, choices, state.metrics)) as chunks:
            async for index, piece in chunks:
                outputs[index].extend(piece.token_ids)
                raw[index] += piece.text
                cached[index] = max(cached[index], piece.cached_tokens)
                pending[index].extend(piece.logprobs or [])
                prompts[index] = piece.prompt_logprobs or prompts[index]
                text = envelope.shape.text_of(index, piece)  # what tool parsers read
                if text or piece.finished:
                    prefix, head = "", None
                    if not echoed[index]:
                        echoed[index] = True
                        prefix, head = _echo(
                            state, envelope, choices[index], prompts[index], pieces
                        )
                        sent[index] = _end(head, prefix)
                    tail = _logprobs(envelope, choices[index], pending[index], pieces, sent[index])
                    pending[index], sent[index] = [], sent[index] + len(piece.text)
                    logprobs = _joined(head, tail)
                    delta = envelope.shape.delta(
                        index, prefix + text, piece.finish_reason, logprobs
                    )
                    if piece.finished:
                        delta["stop_reason"] = _stop_reason(
                            state, choices[index], piece.finish_reason, outputs[index], raw[index]
                        )
                    if not _empty(delta):
                        yield chunk(delta)
        if include_usage:
            total = _usage(choices, prompt_tokens, cached, outputs)
            yield _json(envelope.chunk([], total, True))
    except RequestFailed as exc:
        yield _json(APIError(503, f"generation failed: {exc}").body())
    except Exception as exc:  # a bug: still end the stream properly, and say what broke
        log.exception("stream failed")
        yield _json(APIError(500, f"internal error: {type(exc).__name__}: {exc}").body())
    yield "[DONE]"


def _stop_reason(
    state: ServerState, choice: Choice, reason: str | None, ids: list[int], text: str
) -> str | int | None:
    """vLLM's `stop_reason` of a finished choice: the stop string or token id that ended
    it; None for the model's end, and for a choice that did not stop (length)."""
    tokenizer = state.appliance.tokenizer
    if reason != "stop" or tokenizer is None:
        return None
    return stop_reason(tokenizer, choice.params, ids, text)


def _empty(choice: dict[str, Any]) -> bool:
    """A chat delta that says nothing: text a tool parser holds back (a call's opening
    marker, say) and no logprobs or finish to carry. OpenAI's stream sends none."""
    return choice.get("delta") == {} and not choice["logprobs"] and not choice["finish_reason"]


def _json(value: dict[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"))


async def whole_answer(
    request: Request, work: Coroutine[Any, Any, dict[str, Any]], ticket: Ticket
) -> Response:
    """A whole (not streamed) answer: `work`'s JSON; a failed generation a 503; 499 (nginx's
    "client closed request": nobody reads it, the access log shows it) when the client
    left first. The admission is given back however it ends."""
    try:
        result = await unless_disconnected(request, work)
    except RequestFailed as exc:
        raise APIError(503, f"generation failed: {exc}", retry_after=1) from None
    finally:
        ticket.release()
    return JSONResponse(result) if result is not None else Response(status_code=499)


def typed_event_stream(events: AsyncIterator[dict[str, Any]]) -> EventSourceResponse:
    """Events as the Responses API and Anthropic's send them: `event: <type>` and the
    event's JSON as data (a client that stops reading is dropped after SEND_TIMEOUT_S)."""
    return EventSourceResponse(_typed(events), sep="\n", send_timeout=SEND_TIMEOUT_S)


async def _typed(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[ServerSentEvent]:
    async with aclosing(events) as each:  # type: ignore[type-var]
        async for event in each:
            data = json.dumps(event, separators=(",", ":"))
            yield ServerSentEvent(data=data, event=event["type"])


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
