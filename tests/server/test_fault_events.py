"""A real fault leaves one structured event of each fault and recovery it caused: a real
appliance (1 prefill + 1 decode CPU worker) under 8 streams, its decode worker SIGKILLed
while it holds requests. The worker's exit, the requests it held run again and its
restart each show as a JSON line on the `appliance.events` logger (in the server's log),
in the admin API (Snapshot.fault_events, Snapshot.faults) and as counts by kind in
/metrics (appliance_fault_events_total), with the worker and the request ids touched."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import ServerProcess, admin_split_server, wait_until
from worker_faults import json_events, settled_requests, state, stop_holding_requests, stream

from appliance.admin.schema import WorkerInfo

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

STREAMS = 8
MAX_TOKENS = 48
BOUND_S = 300.0


@pytest.fixture(scope="module")
def fault_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Its own server: the test kills a worker and counts fault events from the start."""
    folder = tmp_path_factory.mktemp("fault-events")
    # Three crashes of device 1 in these tests: none may mark it failed.
    process = admin_split_server(folder, 2, APPLIANCE_RECOVERY__MAX_CRASHES="5")
    process.start()
    yield process
    process.stop()


def fault_metrics(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    [family] = [
        f for f in text_string_to_metric_families(text) if f.name == "appliance_fault_events"
    ]
    return {s.labels["kind"]: s.value for s in family.samples if s.name.endswith("_total")}


def test_a_killed_worker_leaves_its_events_in_the_log_the_admin_api_and_metrics(
    fault_server: ServerProcess,
) -> None:
    async def scenario() -> tuple[int, set[int], list[int]]:
        async with httpx.AsyncClient(base_url=fault_server.url, timeout=BOUND_S) as client:
            traffic = asyncio.gather(*(stream(client, n, MAX_TOKENS) for n in range(STREAMS)))
            worker = await stop_holding_requests(fault_server, 1)  # SIGSTOPped, holding
            held = await settled_requests(fault_server, worker.worker_id)
            os.kill(worker.pid, signal.SIGKILL)
            return worker.worker_id, held, await asyncio.wait_for(traffic, BOUND_S)

    assert fault_metrics(fault_server) == dict.fromkeys(fault_metrics(fault_server), 0.0)
    worker_id, held, tokens = asyncio.run(scenario())
    assert tokens == [MAX_TOKENS] * STREAMS  # none lost
    assert held

    # The log: one JSON object per line, the exit naming the requests it held.
    wait_until(
        lambda: any(e["kind"] == "restart" for e in json_events(fault_server)), 120, "restart"
    )
    events = json_events(fault_server)
    [exited] = [e for e in events if e["kind"] == "worker_exit"]
    assert exited["worker"] == worker_id and exited["cause"] == "exit code -9"
    assert held <= set(exited["requests"])
    reruns = [e for e in events if e["kind"] == "rerun"]
    assert {r for e in reruns for r in e["requests"]} >= held
    assert all(f"worker {worker_id} exited" in e["cause"] for e in reruns)
    [restart] = [e for e in events if e["kind"] == "restart"]
    assert restart["worker"] != worker_id and f"worker {worker_id} exited" in restart["cause"]

    # The admin API: the same events, and the counts.
    snapshot = state(fault_server)
    shown = [e for e in snapshot.fault_events if e.fault == "worker_exit"]
    assert [(e.seq, e.worker, e.requests) for e in shown] == [
        (exited["seq"], worker_id, exited["requests"])
    ]
    kinds = {kind: sum(e["kind"] == kind for e in events) for kind in snapshot.faults}
    assert snapshot.faults == kinds | {"worker_exit": 1, "restart": 1}

    # /metrics: counted by kind.
    counted = fault_metrics(fault_server)
    assert counted["worker_exit"] == 1 and counted["restart"] == 1
    assert counted["rerun"] == len(reruns) and counted["box_lost"] == 0


def test_a_worker_killed_while_its_restart_loads_is_restarted_again(
    fault_server: ServerProcess,
) -> None:
    """The chaos soak's finding: the restart after a failed start found the dead worker's
    handle already forgotten (by that start), took it for a pool move's doing and gave
    up, leaving the device without a worker for good."""
    first = state(fault_server).devices[1].worker
    assert first is not None and first.phase == "ready"
    os.kill(first.pid, signal.SIGKILL)

    def loading() -> WorkerInfo | None:
        worker = state(fault_server).devices[1].worker
        loads = worker is not None and worker.phase == "starting" and worker.pid != first.pid
        return worker if loads else None

    second = wait_until(loading, 60, "device 1's restart loading", every_s=0.05)
    os.kill(second.pid, signal.SIGKILL)

    def back() -> bool:  # between two starts the device shows no worker
        worker = state(fault_server).devices[1].worker
        return worker is not None and worker.phase == "ready"

    wait_until(back, 180, "device 1 back")
    third = state(fault_server).devices[1].worker
    assert third is not None and third.pid not in (first.pid, second.pid)
    exits = [e for e in json_events(fault_server) if e["kind"] == "worker_exit"]
    assert [e["worker"] for e in exits[-2:]] == [first.worker_id, second.worker_id]
    assert json_events(fault_server)[-1]["kind"] == "restart"

    async def one() -> int:
        async with httpx.AsyncClient(base_url=fault_server.url, timeout=BOUND_S) as client:
            return await stream(client, 99, MAX_TOKENS)

    assert asyncio.run(one()) == MAX_TOKENS
