"""Faults under load on a real appliance (1 prefill + 2 decode CPU devices): 50 streams in
flight while a decode worker, then the prefill worker, is SIGKILLed. Every request ends
(whole, or with a clean error event and [DONE]) within a bound, the workers come back,
every KV block is free afterwards, and a new request succeeds."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from server_process import ServerProcess, admin_split_server, wait_until
from worker_faults import json_events, state, stop_holding_requests

from appliance.model.model_source import model_name

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

CLIENTS = 50
REQUESTS_PER_CLIENT = 3
MAX_TOKENS = 16
REQUEST_BOUND_S = 180.0  # a request still open after this long has hung
RESTART_BOUND_S = 120.0


@pytest.fixture(scope="module")
def fault_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """1 prefill + 2 decode workers, room for every client's stream at once."""
    folder = tmp_path_factory.mktemp("faults")
    process = admin_split_server(folder, 3, APPLIANCE_SERVER__MAX_CONCURRENT_REQUESTS="64")
    process.start()
    yield process
    process.stop()


async def one_request(client: httpx.AsyncClient, prompt: str) -> str:
    """'completed' (MAX_TOKENS tokens, [DONE]) or 'error' (an error event, then [DONE]);
    anything else is a broken stream and fails the test."""
    body = {
        "model": model_name(None),
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    outcome, done = None, False
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            return f"http {reply.status_code}"
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                outcome = "error"
            elif chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                outcome = "completed" if tokens == MAX_TOKENS else f"{tokens} tokens"
    return outcome if done and outcome else f"broken stream ({outcome}, done={done})"


async def load(url: str, outcomes: Counter, started: asyncio.Event) -> None:
    async def client_loop(index: int, client: httpx.AsyncClient) -> None:
        for n in range(REQUESTS_PER_CLIENT):
            prompt = f"Story {index}.{n}: once upon a time"
            outcomes[await asyncio.wait_for(one_request(client, prompt), REQUEST_BOUND_S)] += 1
            if sum(outcomes.values()) >= 10:
                started.set()

    limits = httpx.Limits(max_connections=CLIENTS + 5)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_BOUND_S, limits=limits) as client:
        await asyncio.gather(*(client_loop(i, client) for i in range(CLIENTS)))


async def kill_and_wait(server: ServerProcess, device: int, holding: bool = False) -> None:
    """SIGKILL the worker on `device` (with `holding`, only while it holds requests the
    supervisor would have to run again: see `stop_holding_requests`); wait until a new one
    serves there."""
    if holding:
        before = await stop_holding_requests(server, device)
    else:
        before = (await asyncio.to_thread(state, server)).devices[device].worker
    os.kill(before.pid, signal.SIGKILL)
    await _back_after(server, device, before.pid)
    worker = (await asyncio.to_thread(state, server)).devices[device].worker
    assert worker.restarts == before.restarts + 1 and worker.role == before.role


def test_killed_workers_lose_no_request_and_come_back(fault_server: ServerProcess) -> None:
    outcomes: Counter = Counter()

    async def scenario() -> None:
        started = asyncio.Event()
        traffic = asyncio.create_task(load(fault_server.url, outcomes, started))
        await asyncio.wait_for(started.wait(), REQUEST_BOUND_S)
        await kill_and_wait(fault_server, 1, holding=True)  # decode: its requests re-run
        await kill_and_wait(fault_server, 0)  # the only prefill worker
        await traffic

    asyncio.run(scenario())
    print(f"\noutcomes of {CLIENTS * REQUESTS_PER_CLIENT} requests: {dict(outcomes)}")
    assert sum(outcomes.values()) == CLIENTS * REQUESTS_PER_CLIENT  # every one ended
    assert set(outcomes) <= {"completed", "error"}, outcomes  # and cleanly
    assert outcomes["completed"] >= 0.9 * CLIENTS * REQUESTS_PER_CLIENT

    snap = state(fault_server)
    assert [d.worker.phase for d in snap.devices] == ["ready"] * 3
    assert [d.worker.restarts for d in snap.devices] == [1, 1, 0]
    # The whole fault log: the admin snapshot's last 20 events may be all the handoffs
    # that piled up on the stopped worker (50 clients), pushing its reruns out.
    reruns = [e["message"] for e in json_events(fault_server) if e["kind"] == "rerun"]
    assert any("running it again" in m for m in reruns), reruns
    wait_until(
        lambda: not any(d.worker.kv_blocks_used for d in state(fault_server).devices),
        10,
        "every KV block free after the load",
    )
    assert state(fault_server).requests_in_flight == 0

    after = asyncio.run(_fresh_request(fault_server.url))
    assert after == "completed"


async def _fresh_request(url: str) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await one_request(client, "A new request after the faults:")


def test_a_device_that_keeps_crashing_fails_and_its_pool_carries_on(
    fault_server: ServerProcess,
) -> None:
    """Device 2 (decode) crashes 3 times within the crash window: it is not restarted
    again, /health says degraded and names it, and device 1 serves the decode pool."""
    for crash in range(3):
        worker = state(fault_server).devices[2].worker
        os.kill(worker.pid, signal.SIGKILL)
        if crash < 2:
            asyncio.run(_back_after(fault_server, 2, worker.pid))

    def health_naming_device_2() -> dict | None:
        health = httpx.get(fault_server.url + "/health").json()
        return health if health["failed_devices"] == [2] else None

    health = wait_until(health_naming_device_2, 10, "device 2 marked failed")
    assert health["status"] == "degraded"
    time.sleep(2)  # past any backoff: still no new worker on device 2
    assert state(fault_server).devices[2].worker.phase == "exited"
    assert asyncio.run(_fresh_request(fault_server.url)) == "completed"
    assert "crashed too often" in " ".join(e.message for e in state(fault_server).events)


async def _back_after(server: ServerProcess, device: int, old_pid: int) -> None:
    deadline = time.monotonic() + RESTART_BOUND_S
    while True:
        worker = (await asyncio.to_thread(state, server)).devices[device].worker
        if worker and worker.pid != old_pid and worker.phase == "ready":
            return
        assert time.monotonic() < deadline, f"device {device} did not come back"
        await asyncio.sleep(0.2)
