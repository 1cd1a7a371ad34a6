"""The request flow routes by what the box's KV store holds, on plain data: a real store
owner (two colocated workers of one namespace, the store holding a chat's history), a
real router and request table, a recording pool. Where worker 0 holds the history in
its pool and is busy, and the store holds it too, the turn goes to idle worker 1 with
the store's hits before its Submit; each worker's queue grows by the tokens the prompt
computes there, and falls back at its first token."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from table_messages import tokens

from appliance.core.events import EventLog
from appliance.core.request_table import RequestTable
from appliance.core.roles import Role
from appliance.core.router import Router
from appliance.core.tuning import initial_tuning
from appliance.engine.sequence import SamplingParams
from appliance.kv.prefix_cache import prefix_keys
from appliance.kv_store.namespace import StoreNamespace
from appliance.pools.kv_store_owner import StoreOwner
from appliance.pools.request_flow import RequestFlow
from appliance.pools.worker_handle import WorkerHandle
from appliance.settings.config import Settings
from appliance.settings.kv_store import KVStoreSettings
from appliance.workers.messages import StoreHits, StoreReady, Submit, TokenBatch, ToWorker

BLOCK = 16
BYTES = 1024  # a block's bytes, as stored
NAMESPACE = StoreNamespace("smollm2-135m", "q8_0:abc", "float32", BLOCK)
HISTORY = list(range(1000, 1000 + 30 * BLOCK))  # a system prompt and earlier turns
TURN = [*HISTORY, *range(7000, 7080)]  # the next turn: 560 tokens, 80 new


class Pool:
    """The flow's view of the pools: two colocated workers, every message recorded."""

    def __init__(self) -> None:
        unused = cast(Any, None)
        role: Role = "colocated"
        self.workers = {
            i: WorkerHandle(i, role, i, f"cpu:{i}", (i,), unused, unused, ready=True)
            for i in range(2)
        }
        self.sent: list[tuple[int | None, ToWorker]] = []

    def send(self, worker_id: int | None, message: ToWorker, /) -> None:
        self.sent.append((worker_id, message))

    def may_come_back(self, role: Role, /) -> bool:
        return False


@pytest.fixture
def owner() -> Iterator[StoreOwner]:
    shm = Path("/dev/shm") / f"kvrouting-{uuid.uuid4().hex}"
    shm.mkdir()
    store = StoreOwner(KVStoreSettings(enabled=True, host_memory_mb=1, shm_dir=shm), BLOCK)
    for worker_id in (0, 1):
        store.on_ready(StoreReady(worker_id, NAMESPACE, BYTES))
    yield store
    store.close()
    for leftover in shm.iterdir():
        leftover.unlink()
    shm.rmdir()


def flow_with(store: StoreOwner | None) -> tuple[RequestFlow, RequestTable, Pool]:
    settings = Settings()
    table, pool = RequestTable(), Pool()
    router = Router(settings.kv.block_size, settings.kv.prefix_caching)
    tuning = initial_tuning(settings.batch)
    unused = cast(Any, None)
    flow = RequestFlow(
        settings, table, router, cast(Any, pool), lambda: tuning, EventLog(), unused, unused
    )
    flow.store = store
    return flow, table, pool


def send(flow: RequestFlow, table: RequestTable, prompt: list[int]) -> int:
    request = table.add(prompt, SamplingParams(max_tokens=8), time.monotonic())
    flow.submit(request)
    wire = table.requests[request.request_id].wire_id
    assert wire is not None
    return wire


def test_a_busy_holder_loses_the_turn_the_store_holds_to_an_idle_worker(
    owner: StoreOwner,
) -> None:
    assert owner.store is not None
    digest = NAMESPACE.digest()
    for key in prefix_keys(HISTORY, BLOCK):
        owner.store.put((digest, key), bytes(BYTES))
    flow, table, pool = flow_with(owner)
    holder, idle = pool.workers[0], pool.workers[1]
    flow.router.prefill([holder], [*HISTORY, 1], flow.tuning())  # 0's pool: the history
    holder.running = 2  # decoding two other chats' answers

    wire = send(flow, table, TURN)
    to, submit = pool.sent[-1]
    assert to == 1 and isinstance(submit, Submit) and submit.request_id == wire
    hits = pool.sent[-2]
    assert hits[0] == 1 and isinstance(hits[1], StoreHits) and len(hits[1].slots) == 30
    assert idle.queued_tokens == 80 and holder.queued_tokens == 0  # what it computes
    flow.on_tokens(idle, TokenBatch(1, [tokens(wire, [7])], num_running=1))
    assert idle.queued_tokens == 0  # its first token: off the queue


def test_without_the_store_the_holder_takes_it_though_busy() -> None:
    flow, table, pool = flow_with(None)
    holder, idle = pool.workers[0], pool.workers[1]
    flow.router.prefill([holder], [*HISTORY, 1], flow.tuning())
    holder.running = 2
    send(flow, table, TURN)
    assert pool.sent[-1][0] == 0  # 80 tokens and 2 rows against 560
    assert holder.queued_tokens == 80 and idle.queued_tokens == 0
