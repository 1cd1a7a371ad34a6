"""Running a request's choices on the pools: each choice observed for the metrics,
several merged into one stream, a client that goes away cancelling them all."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TypeVar, cast

from starlette.requests import Request

from appliance.api import Chunk, RequestFailed, SamplingParams
from appliance.server.metrics import Metrics
from appliance.tracing.spans import add_to, fail_current

T = TypeVar("T")
Chunks = AsyncGenerator[Chunk, None]
TaggedChunks = AsyncGenerator[tuple[int, Chunk], None]
# Starts one generation of prompt token ids: Appliance.generate_ids.
GenerateIds = Callable[[list[int], SamplingParams], AsyncIterator[Chunk]]


@dataclass
class Choice:
    """One generation of a request: choice `index` of its prompt."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float  # time.monotonic() when its HTTP request arrived


async def observed(generate: GenerateIds, choice: Choice, metrics: Metrics) -> Chunks:
    """The choice's chunks, timed from the request's arrival as they reach the server."""
    arrival = choice.arrival
    first = last = 0.0
    num_tokens = 0
    outcome = "abort"  # unless it finishes or fails
    try:
        # The supervisor's generate is an async generator, annotated AsyncIterator (no aclose).
        generated = cast(Chunks, generate(choice.prompt_ids, choice.params))
        async with aclosing(generated) as chunks:
            async for chunk in chunks:
                now = time.monotonic()
                if num_tokens == 0:
                    first = now
                    metrics.observe_first_token(
                        now - arrival, len(choice.prompt_ids), chunk.cached_tokens
                    )
                else:
                    metrics.itl.observe(now - last)
                last = now
                num_tokens += len(chunk.token_ids)
                metrics.generation_tokens.inc(len(chunk.token_ids))
                if chunk.finished:
                    outcome = ""
                    add_to("gen_ai.usage.output_tokens", num_tokens)  # the request's span
                    metrics.observe_finished(chunk, num_tokens, arrival, first, last)
                yield chunk
    except RequestFailed as exc:
        outcome = "error"
        fail_current(str(exc))
        raise
    finally:
        if outcome:
            metrics.requests.labels(outcome).inc()


async def merged(streams: list[Chunks]) -> TaggedChunks:
    """(stream index, chunk) from several streams as they come; closing this closes all."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for chunk in only:
                yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, Chunk | Exception | None]] = asyncio.Queue()

    async def pump(index: int, stream: Chunks) -> None:
        try:
            async with aclosing(stream) as chunks:
                async for chunk in chunks:
                    queue.put_nowait((index, chunk))
        except Exception as exc:
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, None))  # this stream is done

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def run_choices(generate: GenerateIds, choices: list[Choice], metrics: Metrics) -> TaggedChunks:
    """Every choice's chunks, tagged with the choice's index."""
    streams = [observed(generate, c, metrics) for c in choices]
    return _retag(merged(streams), [c.index for c in choices])


async def _retag(pairs: TaggedChunks, indices: list[int]) -> TaggedChunks:
    async with aclosing(pairs) as items:
        async for position, chunk in items:
            yield indices[position], chunk


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it if the client hangs up first (then None)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return task.result() if not task.cancelled() else None


async def _disconnected(request: Request) -> None:
    # The body is read already, so the next message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
