"""Streams against the shared server: dropped clients free their KV blocks on both pools,
an overload is refused with 429 + Retry-After, and /metrics moves with the traffic."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import API_KEY, ServerProcess

from appliance.model.model_source import model_name

MODEL = model_name(None)
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def body(content: str, max_tokens: int, stream: bool = True) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def workers(url: str) -> list[dict]:
    health = httpx.get(url + "/health").json()
    return [w for pool in health["pools"].values() for w in pool]


def wait_all_free(url: str, bound_s: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + bound_s
    while True:
        state = workers(url)
        if all(w["num_free_blocks"] == w["num_blocks"] for w in state):
            return state
        if time.monotonic() > deadline:
            pytest.fail(f"KV blocks still held {bound_s} s after the clients left: {state}")
        time.sleep(0.05)


def test_health_reports_the_context_each_pool_holds(server: ServerProcess) -> None:
    health = httpx.get(server.url + "/health").json()
    assert health["kv_block_size"] == 16
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, context 8192. The fixture's 128 MiB buys
    # blocks of float32 or bfloat16 (the CPU's pick): on a CPU memory_mb sizes the pool.
    expected = {128 * 2**20 // (30 * 2 * 16 * 3 * 64 * size) for size in (4, 2)}
    contexts = []
    for worker in [w for pool in health["pools"].values() for w in pool]:
        assert worker["num_blocks"] in expected
        assert worker["kv_tokens"] == worker["num_blocks"] * 16
        assert worker["max_model_len"] == min(8192, worker["kv_tokens"])
        contexts.append(worker["max_model_len"])
    assert len(contexts) == 2 and health["max_model_len"] == min(contexts)
    card = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]
    assert card["max_model_len"] == health["max_model_len"]


def test_dropped_streams_free_their_blocks_on_both_pools(server: ServerProcess) -> None:
    all_reading = asyncio.Event()
    drop = asyncio.Event()  # set once the busy pools have been looked at
    readers = 0

    async def drop_midway(client: httpx.AsyncClient, i: int) -> int:
        nonlocal readers
        request = body(f"Tell me a long story about the number {i}.", 500)
        async with client.stream("POST", "/v1/chat/completions", json=request) as reply:
            assert reply.status_code == 200
            # Held, not left by `break`: a dropped line iterator is finalized at once, and
            # that closes the connection before the pools are looked at.
            lines = reply.aiter_lines()
            chunks = 0
            while chunks < 4:
                chunks += (await anext(lines)).startswith("data: {")
            readers += 1
            if readers == 20:
                all_reading.set()
            await drop.wait()
            await lines.aclose()
            return chunks  # leaving the block closes the connection mid-stream

    async def main() -> tuple[list[int], list[dict]]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as client:
            tasks = [asyncio.create_task(drop_midway(client, i)) for i in range(20)]
            await all_reading.wait()
            busy = await asyncio.to_thread(workers, server.url)
            drop.set()
            return list(await asyncio.gather(*tasks)), busy

    chunks, busy = asyncio.run(main())
    assert chunks == [4] * 20
    decode = [w for w in busy if w["role"] == "decode"]
    assert sum(w["running"] for w in decode) == 20, decode  # all of them were decoding
    assert all(w["num_free_blocks"] < w["num_blocks"] for w in decode if w["running"])
    wait_all_free(server.url)
    assert httpx.get(server.url + "/health").json()["generations_admitted"] == 0


def test_a_whole_response_abandoned_by_its_client_is_cancelled(server: ServerProcess) -> None:
    """A client that gives up on a whole (unstreamed) answer frees its KV blocks. The
    answer must outlast the client's 1.5 s: it ignores end-of-turn tokens, so it runs its
    full 2000 tokens, which the smallest pool takes (float32, 128 MiB: 2,912 tokens)."""
    request = body("Count to a million.", 2000, stream=False)
    assert request["ignore_eos"]  # else an early end of turn could answer within 1.5 s
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url + "/v1/chat/completions",
            json=request,
            headers=AUTH,
            timeout=httpx.Timeout(60, read=1.5),
        )
    wait_all_free(server.url)


def test_overload_is_refused_with_retry_after(server: ServerProcess) -> None:
    """The server admits 40 generations; 4x that at once: the excess is refused with 429
    at once (before any admitted one has finished: nothing queues), the admitted ones all
    complete."""
    count = 160

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str | None, int, float]:
        request = body(f"Describe the color number {i}.", 48)
        async with client.stream("POST", "/v1/chat/completions", json=request) as reply:
            if reply.status_code != 200:
                error = json.loads(await reply.aread())["error"]
                assert error["type"] == "rate_limit_error"
                return reply.status_code, reply.headers.get("retry-after"), 0, time.monotonic()
            texts = [line async for line in reply.aiter_lines() if line.startswith("data: {")]
            finished = [t for t in texts if '"finish_reason":"length"' in t]
            return 200, None, len(finished), time.monotonic()

    async def main() -> list[tuple[int, str | None, int, float]]:
        limits = httpx.Limits(max_connections=count + 10)
        async with httpx.AsyncClient(
            base_url=server.url, headers=AUTH, timeout=300, limits=limits
        ) as client:
            return list(await asyncio.gather(*(one(client, i) for i in range(count))))

    results = asyncio.run(main())
    refused = [r for r in results if r[0] == 429]
    served = [r for r in results if r[0] == 200]
    assert len(refused) + len(served) == count
    assert len(refused) >= count - 40 - 10 and len(served) >= 30
    assert all(r[1] == "1" for r in refused)
    assert all(r[2] == 1 for r in served)  # every admitted one completed
    assert max(r[3] for r in refused) < min(r[3] for r in served)
    wait_all_free(server.url)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_parse_and_move_with_traffic(server: ServerProcess) -> None:
    before = scrape(server.url)
    reply = httpx.post(
        server.url + "/v1/chat/completions",
        json=body("Name three rivers.", 9, stream=False),
        headers=AUTH,
        timeout=60,
    ).json()
    httpx.post(server.url + "/v1/chat/completions", json={}, headers=AUTH)  # a 422
    after = scrape(server.url)

    def moved(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert moved("appliance_requests_total", finish_reason="length") == 1
    assert moved("appliance_prompt_tokens_total") == reply["usage"]["prompt_tokens"]
    assert moved("appliance_generation_tokens_total") == 9
    for histogram in (
        "appliance_time_to_first_token_seconds",
        "appliance_time_per_output_token_seconds",
        "appliance_queue_time_seconds",
        "appliance_e2e_request_latency_seconds",
        "appliance_handoff_latency_seconds",
    ):
        assert moved(histogram + "_count") == 1, histogram
        assert moved(histogram + "_sum") > 0, histogram
    assert moved("appliance_inter_token_latency_seconds_count") == 8
    assert moved("appliance_handoff_bytes_total") > 0
    assert moved("appliance_error_responses_total", status="422") == 1
    gauges = {labels for name, labels in after if name == "appliance_worker_kv_usage_ratio"}
    roles = sorted(dict(labels)["role"] for labels in gauges)
    assert roles == ["decode", "prefill"]
    assert ("appliance_requests_in_flight", ()) in after
