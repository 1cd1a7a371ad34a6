"""One streamed request to an OpenAI-compatible /v1/completions endpoint, timed."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
from httpx_sse import EventSource, aconnect_sse

from appliance.bench.workloads import RequestSpec
from appliance.core.goodput import RequestResult

CountTokens = Callable[[str], int]


async def send(
    client: httpx.AsyncClient,
    model: str,
    spec: RequestSpec,
    extra_body: dict[str, Any],
    run_start: float,
    count_tokens: CountTokens,
) -> RequestResult:
    """Stream one completion; any failure is recorded in the result, never raised.

    Output tokens come from the stream's `usage`; a server that sends none (llama-cpp-
    python) has its text counted with `count_tokens`, as vLLM's benchmark does."""
    body = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra_body,
    }
    result = RequestResult(prompt_tokens=spec.prompt_tokens)
    sent = time.perf_counter()
    result.start = sent - run_start
    try:
        async with aconnect_sse(client, "POST", "/v1/completions", json=body) as source:
            reply = source.response
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")
                result.error = f"HTTP {reply.status_code}: {text[:200]}"
                return result
            await _read_events(source, result, sent, count_tokens)
    except Exception as exc:  # a bad reply of any kind is a failed request, never a crash
        result.ok = False
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _read_events(
    source: EventSource, result: RequestResult, sent: float, count_tokens: CountTokens
) -> None:
    """Time the stream's messages (httpx-sse parses it; a reply that is no
    text/event-stream raises SSEError); only their data counts, whatever their name."""
    last = sent
    text = ""
    usage_tokens = None
    async for message in source.aiter_sse():
        data = message.data.strip()
        if not data:
            continue
        if data == "[DONE]":
            result.ok = True
            break
        event = json.loads(data)
        if "error" in event:
            result.error = str(event["error"])
            return
        if event.get("usage"):
            usage_tokens = event["usage"]["completion_tokens"]
        piece = "".join(choice.get("text") or "" for choice in event.get("choices") or [])
        if not piece:
            continue
        now = time.perf_counter()
        if not text:
            result.ttft = now - sent
        else:
            result.itl.append(now - last)
        last, text = now, text + piece
    if not result.ok:
        result.error = "the stream ended without [DONE]"
    elif not text:
        result.ok, result.error = False, "the stream carried no text"
    result.latency = last - sent
    result.output_tokens = usage_tokens if usage_tokens is not None else count_tokens(text)
