"""A short soak of the shared server (bounded to 240 requests): streamed, whole, dropped
mid-stream and malformed requests, 8 at a time. It reports the memory and open file
descriptors of the server and its workers at the start and end; growth must stay within
stated bounds.

Memory is bounded by the sum of PSS over the processes: a shared page counts once, split
among the processes that map it. RSS counts it in every process: it grows (up to the
pool's size, here 128 MiB) as the decode worker reads more of the prefill pool's shared
KV tensor, which the prefix cache spreads requests over; that is the pool being used,
not a leak. Both are reported."""

from __future__ import annotations

import asyncio

import httpx
import psutil
import pytest
from server_process import API_KEY, ServerProcess

from appliance.model.model_source import model_name

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

REQUESTS = 240
CONCURRENCY = 8
PSS_BOUND = 64 * 2**20  # bytes, all processes together
FD_BOUND = 8
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def footprint(pid: int) -> tuple[int, int, int]:
    """(RSS bytes, PSS bytes, open fds) of the server and every process under it."""
    root = psutil.Process(pid)
    processes = [root, *root.children(recursive=True)]
    memory = [p.memory_full_info() for p in processes]
    return (
        sum(m.rss for m in memory),
        sum(m.pss for m in memory),
        sum(p.num_fds() for p in processes),
    )


async def one(client: httpx.AsyncClient, i: int) -> str:
    kind = ("stream", "whole", "drop", "bad")[i % 4]
    body = {
        "model": model_name(None),
        "messages": [{"role": "user", "content": f"Question {i}: name a fruit."}],
        "max_tokens": 12,
        "ignore_eos": True,
        "stream": kind in ("stream", "drop"),
    }
    if kind == "bad":
        body["temperature"] = "hot"
        reply = await client.post("/v1/chat/completions", json=body)
        return "refused" if reply.status_code == 422 else f"bad answered {reply.status_code}"
    if kind == "whole":
        reply = await client.post("/v1/chat/completions", json=body)
        return "ok" if reply.status_code == 200 else f"whole {reply.status_code}"
    async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        lines = 0
        async for line in reply.aiter_lines():
            lines += line.startswith("data: ")
            if kind == "drop" and lines == 3:
                return "dropped"  # leaving the block closes the connection mid-stream
        return "ok" if lines else "empty stream"


async def soak(url: str) -> list[str]:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def limited(client: httpx.AsyncClient, i: int) -> str:
        async with gate:
            return await one(client, i)

    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as client:
        return list(await asyncio.gather(*(limited(client, i) for i in range(REQUESTS))))


def test_soak_keeps_memory_and_descriptors_flat(server: ServerProcess) -> None:
    asyncio.run(soak_warmup(server.url))
    rss_start, pss_start, fds_start = footprint(server.process.pid)
    outcomes = asyncio.run(soak(server.url))
    rss_end, pss_end, fds_end = footprint(server.process.pid)
    mib = 2**20
    print(
        f"\n| soak ({REQUESTS} requests) | start | end | growth | bound |\n"
        f"|---|---|---|---|---|\n"
        f"| PSS, MiB | {pss_start / mib:.0f} | {pss_end / mib:.0f} | "
        f"{(pss_end - pss_start) / mib:+.1f} | {PSS_BOUND / mib:.0f} |\n"
        f"| RSS, MiB | {rss_start / mib:.0f} | {rss_end / mib:.0f} | "
        f"{(rss_end - rss_start) / mib:+.1f} | - |\n"
        f"| open fds | {fds_start} | {fds_end} | {fds_end - fds_start:+d} | {FD_BOUND} |"
    )
    counts = {o: outcomes.count(o) for o in set(outcomes)}
    assert counts == {"ok": REQUESTS // 2, "dropped": REQUESTS // 4, "refused": REQUESTS // 4}
    assert pss_end - pss_start <= PSS_BOUND
    assert fds_end - fds_start <= FD_BOUND
    assert httpx.get(server.url + "/health").json()["generations_admitted"] == 0


async def soak_warmup(url: str) -> None:
    """Every kind of request once or twice first, so caches and pools are already sized."""
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as client:
        await asyncio.gather(*(one(client, i) for i in range(16)))
