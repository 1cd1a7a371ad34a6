"""The request flow's SLO admission (planner.scheduling_policy slo): prompts held in the
supervisor while the worker that would decode them is predicted over the TPOT limit,
sent oldest first once a step makes room or their wait is up. Hand-made table
transitions and a recording pool, no processes."""

from __future__ import annotations

import time
from typing import Any, cast

from table_messages import tokens

from appliance.core.admission_queue import ModelCache
from appliance.core.request_table import Phase, RequestTable
from appliance.core.roles import Role
from appliance.core.router import Router
from appliance.core.tuning import initial_tuning
from appliance.engine.sequence import SamplingParams
from appliance.planner.profile import StepCost
from appliance.pools.request_flow import RequestFlow
from appliance.pools.worker_handle import WorkerHandle
from appliance.settings.config import Settings
from appliance.workers.messages import Submit, ToWorker

# 6 ms a step, 4 ms a sequence, 3 us a key: with 300-token prompts, 8 sequences step in
# 45.2 ms and 9 in 50.3 ms, over 80% of a 60 ms TPOT limit.
COST = StepCost(base_s=0.006, per_seq_s=0.004, per_context_s=3e-6)
PROMPT = list(range(300))
SLO_SET = {"slo_ttft_ms": 8000, "slo_tpot_ms": 60}  # a prompt is held at most 6 s


class Pool:
    """The flow's view of the pools: one colocated worker, every message recorded."""

    def __init__(self, role: Role = "colocated") -> None:
        unused = cast(Any, None)
        worker = WorkerHandle(0, role, 0, "cpu:0", (0,), unused, unused, ready=True)
        self.workers = {0: worker}
        self.sent: list[tuple[int | None, ToWorker]] = []

    def send(self, worker_id: int | None, message: ToWorker, /) -> None:
        self.sent.append((worker_id, message))

    def may_come_back(self, role: Role, /) -> bool:
        return False

    def submitted(self) -> list[int]:
        return [m.request_id for _, m in self.sent if isinstance(m, Submit)]


def flow_with(settings: Settings) -> tuple[RequestFlow, RequestTable, Pool]:
    table, pool = RequestTable(), Pool()
    unused = cast(Any, None)
    router = Router(settings.kv.block_size, settings.kv.prefix_caching)
    tuning = initial_tuning(settings.batch)
    flow = RequestFlow(
        settings, table, router, cast(Any, pool), lambda: tuning, unused, unused, unused
    )
    flow._models = ModelCache(lambda unit: COST)  # this worker size's fitted decode cost
    return flow, table, pool


def arrive(flow: RequestFlow, table: RequestTable, ago_s: float = 0.0) -> int:
    request = table.add(PROMPT, SamplingParams(max_tokens=64), time.monotonic() - ago_s)
    flow.submit(request)
    return request.request_id


def test_prompts_past_the_tpot_headroom_wait_and_go_oldest_first_as_room_comes() -> None:
    flow, table, pool = flow_with(Settings(planner=SLO_SET))
    ids = [arrive(flow, table) for _ in range(10)]
    assert len(pool.submitted()) == 8  # a ninth would step in 50 ms, over 48 ms
    assert flow.admission.held == ids[8:]
    assert table.requests[ids[8]].phase is Phase.WAITING
    # The first request's stream ends: its slot goes to the oldest held prompt.
    first = table.requests[ids[0]]
    assert first.wire_id is not None
    table.on_started([first.wire_id], step_started_at=time.monotonic())
    table.on_output(0, tokens(first.wire_id, [7], finished=True), time.monotonic(), 0.0)
    flow.admit_held()
    assert len(pool.submitted()) == 9
    assert flow.admission.held == ids[9:]
    assert table.requests[ids[8]].phase is Phase.QUEUED


def test_a_held_prompt_goes_once_its_wait_is_up_and_a_late_one_waits_behind_it() -> None:
    flow, table, pool = flow_with(Settings(planner=SLO_SET))
    for _ in range(8):
        arrive(flow, table)
    late = arrive(flow, table, ago_s=7.0)  # arrived 7 s ago (a rerun keeps its arrival)
    assert late not in flow.admission.held  # past the 6 s bound: sent however full
    assert len(pool.submitted()) == 9
    held = arrive(flow, table)
    behind = arrive(flow, table, ago_s=7.0)
    assert flow.admission.held == [held, behind]  # first come, first served among the held


def test_without_a_configured_slo_every_prompt_goes_at_once() -> None:
    flow, table, pool = flow_with(Settings())
    for _ in range(20):
        arrive(flow, table)
    assert len(pool.submitted()) == 20
    assert flow.admission.held == []


def test_a_held_prompt_whose_consumer_leaves_is_held_no_more() -> None:
    flow, table, _ = flow_with(Settings(planner=SLO_SET))
    ids = [arrive(flow, table) for _ in range(9)]
    assert flow.admission.held == [ids[8]]
    table.fail(ids[8])
    flow.admit_held()
    assert flow.admission.held == []
