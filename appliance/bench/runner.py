"""Driving a workload against an endpoint: Poisson arrivals at a rate, or a closed loop at
a concurrency; a count of requests or a duration; or a shift's schedule of requests at
set times; warm-up requests not counted."""

from __future__ import annotations

import asyncio
import itertools
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from appliance.bench.client import CountTokens, send
from appliance.bench.shift import ScheduledRequest, Shift
from appliance.bench.workloads import RequestSpec
from appliance.core.goodput import RequestResult


@dataclass
class Load:
    """How requests arrive and how many: rate (req/s, Poisson; inf = all at once) or
    concurrency (closed loop), and num_requests or duration (s)."""

    rate: float | None = None
    concurrency: int | None = None
    num_requests: int | None = 100
    duration: float | None = None
    warmup: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            ((self.rate is None) != (self.concurrency is None), "give a rate or a concurrency"),
            (self.rate is None or self.rate > 0, f"request rate must be > 0, got {self.rate}"),
            (
                self.concurrency is None or self.concurrency >= 1,
                f"concurrency must be at least 1, got {self.concurrency}",
            ),
            (
                self.num_requests is not None or self.duration is not None,
                "give a number of requests or a duration",
            ),
            (
                self.num_requests is None or self.num_requests >= 1,
                f"number of requests must be at least 1, got {self.num_requests}",
            ),
            (
                self.duration is None or self.duration > 0,
                f"duration must be > 0, got {self.duration}",
            ),
            (self.warmup >= 0, f"warm-up must be >= 0, got {self.warmup}"),
            (
                not (self.rate == float("inf") and self.num_requests is None),
                "an infinite rate needs a number of requests",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def poisson_gaps(rate: float, rng: random.Random) -> Iterator[float]:
    """Seconds between arrivals of a Poisson process (0 for an infinite rate)."""
    while True:
        yield 0.0 if rate == float("inf") else rng.expovariate(rate)


async def find_model(client: httpx.AsyncClient) -> str:
    """The first model the endpoint lists; ValueError naming the URL if it cannot say."""
    try:
        reply = await client.get("/v1/models")
        reply.raise_for_status()
        return reply.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        raise ValueError(f"cannot list the models of {client.base_url}: {exc}") from None


async def run_load(
    url: str,
    specs: Iterator[RequestSpec],
    load: Load | Shift,
    count_tokens: CountTokens,
    model: str | None = None,
    extra_body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    request_timeout: float = 600.0,
    label: str = "",
) -> tuple[list[RequestResult], float]:
    """Run the warm-up (the first `load.warmup` of `specs`), then the measured requests:
    the rest of `specs` at a Load, or a Shift's own schedule (each result then records its
    phase); returns their results and the measured wall time."""
    extra = extra_body or {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(request_timeout, connect=30.0)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=timeout, limits=limits, trust_env=False
    ) as client:
        model = model or await find_model(client)
        for spec in itertools.islice(specs, load.warmup):
            await send(client, model, spec, extra, time.perf_counter(), count_tokens)
        total = len(load.schedule) if isinstance(load, Shift) else load.num_requests
        progress = tqdm(total=total, desc=label or url, file=sys.stderr, leave=False)
        sender = _Sender(client, model, extra, time.perf_counter(), count_tokens)
        if isinstance(load, Shift):
            results = await _scheduled(sender, load.schedule, progress)
        elif load.rate is not None:
            results = await _open_loop(sender, itertools.islice(specs, total), load, progress)
        else:
            results = await _closed_loop(sender, itertools.islice(specs, total), load, progress)
        progress.close()
        return results, time.perf_counter() - sender.start


@dataclass
class _Sender:
    """What every measured request is sent with; `start` is the run's clock zero."""

    client: httpx.AsyncClient
    model: str
    extra: dict[str, Any]
    start: float
    count_tokens: CountTokens

    async def send(self, spec: RequestSpec) -> RequestResult:
        return await send(self.client, self.model, spec, self.extra, self.start, self.count_tokens)


def _past(load: Load, start: float) -> bool:
    return load.duration is not None and time.perf_counter() - start >= load.duration


async def _open_loop(
    sender: _Sender, specs: Iterator[RequestSpec], load: Load, progress: tqdm
) -> list[RequestResult]:
    assert load.rate is not None  # run_load takes the open loop only at a rate
    # Its own stream of randomness: the workload drew from Random(seed) already.
    gaps = poisson_gaps(load.rate, random.Random(f"arrivals:{load.seed}"))
    tasks = []
    due = sender.start  # the first request goes at once, as in vLLM's benchmark
    for spec in specs:
        if load.duration is not None and due - sender.start >= load.duration:
            break
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        task = asyncio.create_task(sender.send(spec))
        task.add_done_callback(lambda _: progress.update())
        tasks.append(task)
        due += next(gaps)
    return list(await asyncio.gather(*tasks))


async def _scheduled(
    sender: _Sender, schedule: tuple[ScheduledRequest, ...], progress: tqdm
) -> list[RequestResult]:
    """Each request at its arrival time from the run's start, however slow the earlier
    ones answer."""

    async def one(item: ScheduledRequest) -> RequestResult:
        result = await sender.send(item.spec)
        result.phase = item.phase
        progress.update()
        return result

    tasks = []
    for item in sorted(schedule, key=lambda item: item.arrival_s):
        await asyncio.sleep(max(0.0, sender.start + item.arrival_s - time.perf_counter()))
        tasks.append(asyncio.create_task(one(item)))
    return list(await asyncio.gather(*tasks))


async def _closed_loop(
    sender: _Sender, specs: Iterator[RequestSpec], load: Load, progress: tqdm
) -> list[RequestResult]:
    assert load.concurrency is not None  # a Load without a rate has a concurrency
    results: list[RequestResult] = []

    async def user() -> None:
        for spec in specs:  # one shared iterator: each spec is taken once
            if _past(load, sender.start):
                return
            results.append(await sender.send(spec))
            progress.update()

    await asyncio.gather(*(user() for _ in range(load.concurrency)))
    return results
