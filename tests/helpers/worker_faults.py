"""Reading a real server's workers through the admin state, and catching a decode worker
while it holds requests (SIGSTOP), for the fault tests that kill it then."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
from server_process import ServerProcess

from appliance.admin.schema import Snapshot, WorkerInfo
from appliance.model.model_source import model_name

HOLD_BOUND_S = 60.0  # for the decode worker to be seen holding requests
SETTLE_S = 0.5  # between two reads of a stopped worker's requests


def state(server: ServerProcess) -> Snapshot:
    """GET /admin/state with the token of the server's token file, parsed."""
    token = Path(server.admin_token_file).read_text()
    reply = httpx.get(
        server.url + "/admin/state", headers={"Authorization": f"Bearer {token}"}, timeout=10
    )
    return Snapshot.model_validate(reply.json())


async def stop_holding_requests(server: ServerProcess, device: int) -> WorkerInfo:
    """SIGSTOP the decode worker on `device` at a moment the supervisor has requests
    decoding on it, and leave it stopped: a stopped worker cannot finish them, so they are
    still its when it is killed. Until then it is stopped, checked once what it sent
    before stopping has been read, and let go again, as often as it takes: a busy machine
    may leave the worker idle for a while."""
    deadline = time.monotonic() + HOLD_BOUND_S
    while True:
        snap = await asyncio.to_thread(state, server)
        worker = snap.devices[device].worker
        if decoding_on(snap, worker.worker_id):  # worth a look: stop it and see
            os.kill(worker.pid, signal.SIGSTOP)
            if await settled_requests(server, worker.worker_id):
                return worker
            os.kill(worker.pid, signal.SIGCONT)
        assert time.monotonic() < deadline, f"the worker on device {device} never held requests"
        await asyncio.sleep(0.2)


def decoding_on(snap: Snapshot, worker_id: int) -> set[int]:
    """Requests handed off to (and taken by) decode worker `worker_id`: if it dies, the
    supervisor runs them again."""
    return {
        r.request_id for r in snap.requests if r.state == "decode" and r.decode_worker == worker_id
    }


async def settled_requests(server: ServerProcess, worker_id: int) -> set[int]:
    """`decoding_on` once two reads SETTLE_S apart agree: a stopped worker's messages
    still in its pipe (a request it finished just before) have reached the supervisor."""
    held = decoding_on(await asyncio.to_thread(state, server), worker_id)
    while True:
        await asyncio.sleep(SETTLE_S)
        again = decoding_on(await asyncio.to_thread(state, server), worker_id)
        if again == held:
            return held
        held = again


async def stream(client: httpx.AsyncClient, n: int, max_tokens: int) -> int:
    """One greedy streamed completion of `max_tokens` (end of sequence ignored); the
    completion tokens its usage reports."""
    body = {"model": model_name(None), "prompt": f"Story {n}: once upon a time"}
    body |= {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    body |= {"stream_options": {"include_usage": True}}
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            data = line.removeprefix("data: ")
            if line.startswith("data: ") and data != "[DONE]":
                chunk = json.loads(data)
                assert "error" not in chunk, chunk
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    return tokens


def json_events(server: ServerProcess) -> list[dict]:
    """The fault events the server logged, one JSON object per `appliance.events` line."""
    marker = "appliance.events: "
    return [json.loads(line.split(marker, 1)[1]) for line in server.output if marker in line]
