"""The admin API against a real appliance on 3 CPU devices (1 prefill + 2 decode): it
shows the real workers, moves a device between pools while requests keep completing,
applies tuning live, pauses admission, streams events, and lets no one in without the
token."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from admin_calls import MOVE_BOUND_S, admin_headers, pools, snapshot
from server_process import API_KEY, ServerProcess, wait_until
from traffic import Traffic

from appliance.admin.schema import Event, Snapshot, WorkerInfo
from appliance.model.model_source import model_name
from tui.client import AdminClient, AdminError


def move(server: ServerProcess, device: int, to: str) -> dict:
    """Start a move, check the 202, and wait until it is done."""
    reply = httpx.post(
        server.url + "/admin/pools",
        json={"device": device, "to": to},
        headers=admin_headers(server),
    )
    assert reply.status_code == 202, reply.text
    started = reply.json()["move"]
    # Between decode and colocated the worker switches in place: done at once.
    assert started["phase"] in {"draining", "done"} and started["to_role"] == to

    def finished() -> dict | None:
        moves = [m for m in snapshot(server).moves if m.move_id == started["move_id"]]
        return moves[0].model_dump() if moves and moves[0].finished_at else None

    done = wait_until(finished, MOVE_BOUND_S, f"move of device {device} to {to}")
    assert done["phase"] == "done", done["error"]
    return done


def tune(server: ServerProcess, **changes: Any) -> httpx.Response:
    return httpx.patch(server.url + "/admin/tuning", json=changes, headers=admin_headers(server))


@pytest.fixture
def tuned(pool_server: ServerProcess) -> Iterator[ServerProcess]:
    """The pool server; whatever a test tunes is put back afterwards."""
    before = snapshot(pool_server).tuning
    yield pool_server
    assert tune(pool_server, **before.model_dump()).status_code == 200


def test_state_shows_the_real_workers(pool_server: ServerProcess) -> None:
    snap = snapshot(pool_server)
    assert snap.ready and snap.mode == "disaggregated" and snap.model == model_name(None)
    assert pools(snap) == {"prefill": [0], "decode": [1, 2]}
    for device in snap.devices:
        worker = device.worker
        assert worker is not None and worker.phase == "ready" and worker.role == device.pool
        os.kill(worker.pid, 0)  # a live process of ours
        assert worker.kv_blocks_total > 0 and worker.kv_blocks_used == 0
        assert device.memory_used > 100 * 2**20  # a worker's RSS holds the model
        assert "shared" in device.name
    assert snap.tuning.admission == "open" and snap.requests == []


def test_the_token_file_is_private(pool_server: ServerProcess) -> None:
    mode = stat.S_IMODE(pool_server.admin_token_file.stat().st_mode)
    assert mode == 0o600


def test_a_second_server_on_the_same_port_leaves_the_token_alone(
    pool_server: ServerProcess,
) -> None:
    token = pool_server.admin_token_file.read_text()
    env = {**os.environ, "APPLIANCE_PORT": str(pool_server.port)}
    env["APPLIANCE_ADMIN__TOKEN_FILE"] = str(pool_server.admin_token_file)
    env["APPLIANCE_CPU_DEVICES"] = "1"
    env["APPLIANCE_MODE"] = "colocated"
    second = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode != 0 and "address already in use" in second.stderr
    assert pool_server.admin_token_file.read_text() == token
    assert snapshot(pool_server).ready


def test_the_console_client_rereads_a_replaced_token(pool_server: ServerProcess) -> None:
    async def scenario() -> None:
        client = AdminClient(pool_server.url, "stale", token_file=pool_server.admin_token_file)
        try:
            with pytest.raises(AdminError) as caught:
                await client.state()
            assert caught.value.status == 401
            assert (await client.state()).ready  # the token it read after the 401
        finally:
            await client.aclose()

    asyncio.run(scenario())


ADMIN_CALLS = [
    ("GET", "/admin/state", None),
    ("GET", "/admin/events", None),
    ("POST", "/admin/pools", {"device": 2, "to": "prefill"}),
    ("PATCH", "/admin/tuning", {"admission": "paused"}),
    ("GET", "/admin/profile", None),
]


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Bearer {API_KEY}"])
def test_admin_calls_need_the_admin_token(
    pool_server: ServerProcess, method: str, path: str, body: dict | None, authorization: str
) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    reply = httpx.request(method, pool_server.url + path, json=body, headers=headers)
    assert reply.status_code == 401
    error = reply.json()["error"]
    assert error["code"] == "invalid_admin_token" and "admin token" in error["message"]
    assert snapshot(pool_server).tuning.admission == "open"  # nothing was done


def test_the_profile_is_fitted_from_the_steps_the_workers_ran(pool_server: ServerProcess) -> None:
    """After traffic, /admin/profile has the step costs of the workers' size, fitted from
    their steps (on top of a profile on disk, if this machine has one)."""

    def ask(prompt: str) -> None:
        body = {"model": model_name(None), "prompt": prompt, "max_tokens": 24, "ignore_eos": True}
        reply = httpx.post(
            pool_server.url + "/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text

    prompts = [" ".join(["word"] * (5 + 9 * i)) for i in range(8)]  # prompts of 5..68 words
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(ask, prompts))
    reply = httpx.get(
        pool_server.url + "/admin/profile", headers=admin_headers(pool_server), timeout=30
    )
    assert reply.status_code == 200, reply.text
    profile = reply.json()
    assert "1x1" in profile["workers"]  # one shared core per device
    decode = profile["workers"]["1x1"]["decode"]
    assert decode["base_s"] > 0 or decode["per_seq_s"] > 0


@pytest.mark.parametrize(
    "path", ["/v1/admin/state", "/v1/pools", "/v1/tuning", "/v1/admin/pools", "/v1/state"]
)
def test_the_openai_routes_have_no_admin_actions(pool_server: ServerProcess, path: str) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}", **admin_headers(pool_server)}
    for method in ("GET", "POST", "PATCH"):
        reply = httpx.request(method, pool_server.url + path, headers=headers, json={})
        assert reply.status_code in (404, 405), (method, path, reply.status_code)


def test_tuning_reaches_the_workers_live(tuned: ServerProcess) -> None:
    reply = tune(tuned, decode_max_seqs=1)
    assert reply.status_code == 200 and reply.json()["tuning"]["decode_max_seqs"] == 1
    assert snapshot(tuned).tuning.decode_max_seqs == 1
    most_running = 0
    with Traffic(tuned.url, API_KEY, concurrency=4, max_tokens=16) as traffic:
        while traffic.completed < 8 and not traffic.errors:
            snap = snapshot(tuned)
            decode = [d.worker.running for d in snap.devices if d.pool == "decode"]
            most_running = max(most_running, *decode)
        traffic.wait_completed(8)
    assert traffic.errors == []
    assert most_running == 1  # four clients, yet no decode worker ran two at once


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"chunk_size": 100000}, None),  # more than the prefill budget
        ({"decode_max_seqs": 0}, "decode_max_seqs"),
        ({"routing": "random"}, "routing"),
        ({"max_num_seqs": 3}, "max_num_seqs"),
        ({"chunk_size": "big"}, "chunk_size"),
    ],
)
def test_bad_tuning_is_refused_and_changes_nothing(
    tuned: ServerProcess, changes: dict, param: str | None
) -> None:
    before = snapshot(tuned).tuning
    reply = tune(tuned, **changes)
    assert reply.status_code == 422
    error = reply.json()["error"]
    assert error["param"] == param and error["message"]
    assert snapshot(tuned).tuning == before


def test_paused_admission_answers_503_until_resumed(tuned: ServerProcess) -> None:
    assert tune(tuned, admission="paused").status_code == 200
    chat = {
        "model": model_name(None),
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
    }
    auth = {"Authorization": f"Bearer {API_KEY}"}
    reply = httpx.post(tuned.url + "/v1/chat/completions", json=chat, headers=auth)
    assert reply.status_code == 503 and reply.headers["Retry-After"] == "5"
    assert reply.json()["error"]["code"] == "admission_paused"
    assert tune(tuned, admission="open").status_code == 200
    reply = httpx.post(tuned.url + "/v1/chat/completions", json=chat, headers=auth, timeout=60)
    assert reply.status_code == 200
    kinds = [(e.kind, e.message) for e in snapshot(tuned).events]
    assert ("admission", "admission=paused") in kinds and ("admission", "admission=open") in kinds


def test_moving_a_device_keeps_serving(pool_server: ServerProcess) -> None:
    with Traffic(pool_server.url, API_KEY, concurrency=3) as traffic:
        traffic.wait_completed(3)
        done = move(pool_server, 2, "prefill")
        snap = snapshot(pool_server)
        assert pools(snap) == {"prefill": [0, 2], "decode": [1]}
        moved = snap.devices[2].worker
        assert moved.role == "prefill" and moved.phase == "ready"
        assert done["from_role"] == "decode" and done["remaining"] == 0
        served = traffic.completed
        traffic.wait_completed(served + 6)  # both prefill workers now take prompts

        back = move(pool_server, 2, "decode")
        assert back["from_role"] == "prefill"
        traffic.wait_completed(traffic.completed + 3)
    assert traffic.errors == []
    snap = snapshot(pool_server)
    assert pools(snap) == {"prefill": [0], "decode": [1, 2]}
    messages = [e.message for e in snap.events if e.kind == "move"]
    assert any("to prefill done" in m for m in messages)
    wait_all_blocks_free(pool_server)


def test_a_device_turns_colocated_beside_the_pools_and_back(tuned: ServerProcess) -> None:
    pool_server = tuned
    # Prompts sharing the chat template's prefix would stay with the worker that cached
    # it: taking turns makes the colocated worker get its share at once.
    assert tune(pool_server, routing="round_robin").status_code == 200
    worker = snapshot(pool_server).devices[2].worker
    assert worker is not None and worker.role == "decode"
    with Traffic(pool_server.url, API_KEY, concurrency=3) as traffic:
        traffic.wait_completed(3)
        done = move(pool_server, 2, "colocated")
        assert done["from_role"] == "decode"
        assert pools(snapshot(pool_server)) == {"prefill": [0], "decode": [1], "colocated": [2]}
        # Decode and colocated run one engine: the same process switched, nothing restarted.
        assert same_worker(snapshot(pool_server).devices[2].worker, worker)
        # The colocated worker takes prompts beside the prefill worker and decodes them.
        wait_until(
            lambda: (snapshot(pool_server).devices[2].worker.tokens_per_s or 0) > 0,
            MOVE_BOUND_S,
            "the colocated worker producing tokens",
        )
        traffic.wait_completed(traffic.completed + 6)
        move(pool_server, 2, "decode")
        # Back in the decode pool, it takes handoffs again with the pool it already holds.
        wait_until(
            lambda: any(
                r.decode_worker == worker.worker_id and r.prefill_worker != worker.worker_id
                for r in snapshot(pool_server).requests
            ),
            MOVE_BOUND_S,
            "a handoff decoding on the device back in the decode pool",
        )
        traffic.wait_completed(traffic.completed + 3)
    assert traffic.errors == []
    assert pools(snapshot(pool_server)) == {"prefill": [0], "decode": [1, 2]}
    assert same_worker(snapshot(pool_server).devices[2].worker, worker)
    wait_all_blocks_free(pool_server)


def test_the_prefill_device_turns_colocated_and_back_in_place(tuned: ServerProcess) -> None:
    pool_server = tuned
    assert tune(pool_server, routing="round_robin").status_code == 200
    worker = snapshot(pool_server).devices[0].worker
    assert worker is not None and worker.role == "prefill"

    def handed_off_from_it() -> bool:
        return any(
            r.prefill_worker == worker.worker_id and r.decode_worker not in (None, worker.worker_id)
            for r in snapshot(pool_server).requests
        )

    with Traffic(pool_server.url, API_KEY, concurrency=3) as traffic:
        traffic.wait_completed(3)
        move(pool_server, 0, "colocated")
        assert pools(snapshot(pool_server)) == {"colocated": [0], "decode": [1, 2]}
        assert same_worker(snapshot(pool_server).devices[0].worker, worker)
        traffic.wait_completed(traffic.completed + 6)  # it prefills and decodes them
        # Its pool was made to be handed off from: it turns prefill again in place, and
        # the decode workers, which still hold that pool, take its handoffs at once.
        move(pool_server, 0, "prefill")
        assert same_worker(snapshot(pool_server).devices[0].worker, worker)
        wait_until(handed_off_from_it, MOVE_BOUND_S, "a handoff from the device back in prefill")
        traffic.wait_completed(traffic.completed + 3)
    assert traffic.errors == []
    assert pools(snapshot(pool_server)) == {"prefill": [0], "decode": [1, 2]}
    wait_all_blocks_free(pool_server)


def wait_all_blocks_free(server: ServerProcess) -> None:
    wait_until(
        lambda: all(d.worker.kv_blocks_used == 0 for d in snapshot(server).devices),
        10,
        "every KV block free again",
    )


def same_worker(a: WorkerInfo | None, b: WorkerInfo | None) -> bool:
    return a is not None and b is not None and (a.worker_id, a.pid) == (b.worker_id, b.pid)


@pytest.mark.parametrize(
    ("device", "to", "status", "words"),
    [
        (0, "decode", 409, "would leave a layout where no worker can prefill"),
        (1, "decode", 409, "already in the decode pool"),
        (7, "prefill", 400, "no device 7"),
    ],
)
def test_impossible_moves_are_refused(
    pool_server: ServerProcess, device: int, to: str, status: int, words: str
) -> None:
    reply = httpx.post(
        pool_server.url + "/admin/pools",
        json={"device": device, "to": to},
        headers=admin_headers(pool_server),
    )
    assert reply.status_code == status and words in reply.json()["error"]["message"]
    assert pools(snapshot(pool_server)) == {"prefill": [0], "decode": [1, 2]}


def test_a_second_move_waits_for_the_first(pool_server: ServerProcess) -> None:
    headers = admin_headers(pool_server)
    url = pool_server.url + "/admin/pools"
    # Device 1 has only ever decoded: its pool is private, so turning prefill restarts
    # its worker (device 2, a prefill worker in earlier tests, would switch at once).
    first = httpx.post(url, json={"device": 1, "to": "prefill"}, headers=headers)
    assert first.status_code == 202 and first.json()["move"]["phase"] == "draining"
    second = httpx.post(url, json={"device": 2, "to": "prefill"}, headers=headers)
    assert second.status_code == 409 and "still running" in second.json()["error"]["message"]
    wait_until(lambda: snapshot(pool_server).moves[-1].finished_at, MOVE_BOUND_S, "first move")
    move(pool_server, 1, "decode")


@pytest.mark.parametrize("body", [{"device": "two", "to": "prefill"}, {"device": 2}, {"x": 1}])
def test_malformed_moves_get_422(pool_server: ServerProcess, body: dict) -> None:
    reply = httpx.post(
        pool_server.url + "/admin/pools", json=body, headers=admin_headers(pool_server)
    )
    assert reply.status_code == 422 and reply.json()["error"]["message"]


def read_sse(response: httpx.Response) -> Iterator[tuple[str, str]]:
    event = "message"
    for line in response.iter_lines():
        if line.startswith("event:"):
            event = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            yield event, line.removeprefix("data:").strip()
            event = "message"


def test_events_stream_states_and_what_happens(tuned: ServerProcess) -> None:
    url = tuned.url + "/admin/events"
    states = 0
    with (
        ThreadPoolExecutor(1) as pool,
        httpx.stream("GET", url, headers=admin_headers(tuned), timeout=30) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        started = time.monotonic()
        for kind, data in read_sse(response):
            if kind == "state":
                Snapshot.model_validate(json.loads(data))
                states += 1
                if states == 2:
                    pool.submit(tune, tuned, routing="round_robin")
            elif kind == "event":
                event = Event.model_validate_json(data)
                if event.kind == "tuning":
                    assert event.message == "routing=round_robin"
                    break
            assert time.monotonic() - started < 20, "no tuning event arrived"
    elapsed = time.monotonic() - started
    assert states >= 2 and elapsed < 20
