"""Autopilot on a real appliance (3 CPU devices sharing the cores: 1 prefill, 2 decode):
idle it holds; once traffic comes it moves the prefill device to colocated, as a
hand-made profile says it should, while the streams keep completing; the decision is an event, a
Prometheus count and on /admin/planner; every KV block is free after."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from admin_calls import MOVE_BOUND_S, admin_headers, pools, snapshot
from hand_profiles import hand_profile
from server_process import API_KEY, ServerProcess, wait_until
from traffic import Traffic

from appliance.admin.schema import PlannerView
from appliance.ops.autopilot import Autopilot
from appliance.ops.pool_moves import MoveError, PoolMover
from appliance.planner.profile import (
    HandoffCost,
    StepCost,
    WorkerCost,
)
from appliance.pools.supervisor import Supervisor
from appliance.settings.config import load_settings

# Steps cost a millisecond, but a handoff takes 5 s: on this box's profile every request
# of a prefill worker misses a 5 ms TPOT, and only a colocated worker can meet it. (The
# real box misses it too, so the measured attainment stays below the target.)
SLOW_HANDOFFS = hand_profile(
    {
        "1x1": WorkerCost(
            prefill=StepCost(base_s=0.001, per_token_s=0.0001),
            decode=StepCost(base_s=0.001),
            mixed=StepCost(base_s=0.002, per_token_s=0.0001),
            kv_blocks=10_000,
        )
    },
    atoms=3,
    handoff=HandoffCost(base_s=5.0, per_byte_s=0.0),
)


@pytest.fixture(scope="module")
def autopilot_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("autopilot")
    profile = SLOW_HANDOFFS.save(folder)
    token_file = folder / "admin.token"
    process = ServerProcess(
        {
            "APPLIANCE_API_KEY": API_KEY,
            "APPLIANCE_CPU_DEVICES": "3",
            "APPLIANCE_CPU_SHARE_CORES": "true",
            "APPLIANCE_PREFILL_DEVICES": "0",
            "APPLIANCE_DECODE_DEVICES": "1,2",
            "APPLIANCE_KV__MEMORY_MB": "64",
            # Without a prefix cache the router spreads prompts (no affinity to model).
            "APPLIANCE_KV__PREFIX_CACHING": "false",
            "APPLIANCE_ADMIN__TOKEN_FILE": str(token_file),
            "APPLIANCE_PLANNER__PROFILE": str(profile),
            "APPLIANCE_PLANNER__AUTO_REBALANCE": "true",
            "APPLIANCE_PLANNER__INTERVAL_S": "1",
            "APPLIANCE_PLANNER__WINDOW_S": "20",
            "APPLIANCE_PLANNER__MIN_REQUESTS": "3",
            "APPLIANCE_PLANNER__CONFIRM_WINDOWS": "1",
            "APPLIANCE_PLANNER__COOLDOWN_S": "3600",  # one move, then it holds
            "APPLIANCE_PLANNER__SLO_TPOT_MS": "5",
        }
    )
    process.start()
    process.admin_token_file = token_file
    yield process
    process.stop()


def planner(server: ServerProcess) -> PlannerView:
    reply = httpx.get(server.url + "/admin/planner", headers=admin_headers(server), timeout=10)
    assert reply.status_code == 200, reply.text
    return PlannerView.model_validate(reply.json())


def test_a_traffic_shift_moves_a_device_while_streams_complete(
    autopilot_server: ServerProcess,
) -> None:
    server = autopilot_server
    idle = wait_until(lambda: planner(server).decisions, 30, "a first look at no traffic")
    assert idle[-1].move_device is None and "requests in the window" in idle[-1].reason
    refused = httpx.post(server.url + "/admin/planner/apply", headers=admin_headers(server))
    assert refused.status_code == 409 and "nothing to apply" in refused.text
    with Traffic(server.url, API_KEY, concurrency=3, max_tokens=8) as traffic:
        acted = wait_until(
            lambda: [d for d in planner(server).decisions if d.acted],
            MOVE_BOUND_S,
            "the autopilot moving a device",
        )
        decision = acted[0]
        # Every prompt of a prefill worker waits 5 s for its handoff: the best layout one
        # move away has no prefill worker at all.
        assert (decision.move_device, decision.move_to) == (0, "colocated")
        assert decision.predicted_recommended > decision.predicted_current
        assert decision.attainment is not None and decision.attainment < 0.9
        wait_until(
            lambda: pools(snapshot(server)).get("colocated") == [0],
            MOVE_BOUND_S,
            "device 0 serving colocated",
        )
        traffic.wait_completed(traffic.completed + 6)  # streams go on on the new layout
    assert traffic.errors == []
    snap = snapshot(server)
    assert pools(snap) == {"colocated": [0], "decode": [1, 2]}
    moves = [e.message for e in snap.events if e.kind == "planner"]
    assert any("move device 0 to colocated" in m for m in moves), moves
    metrics = httpx.get(server.url + "/metrics").text
    assert 'appliance_planner_decisions_total{action="move"} 1.0' in metrics
    wait_until(
        lambda: all(d.worker.kv_blocks_used == 0 for d in snapshot(server).devices),
        10,
        "every KV block free again",
    )


def test_without_a_profile_the_planner_says_what_to_do(tmp_path: Path) -> None:
    settings = load_settings(device="cpu", cpu_devices=2, cache_dir=tmp_path)
    supervisor = Supervisor(settings)
    autopilot = Autopilot(supervisor, PoolMover(supervisor, 10.0), settings)

    async def started_without_a_profile() -> None:
        autopilot.start()  # no profile: it looks all the same, learning from the steps
        try:
            view = autopilot.view()
            assert "learning the step costs" in view.status
            assert "run `appliance profile`" in view.status
            assert view.decisions == [] and view.next_move is None
            assert view.current == [None, None]
            with pytest.raises(MoveError, match="has not looked at any traffic"):
                autopilot.apply()
        finally:
            await autopilot.stop()

    asyncio.run(started_without_a_profile())
