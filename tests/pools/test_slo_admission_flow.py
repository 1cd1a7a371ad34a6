"""The request flow's SLO admission (planner.scheduling_policy slo): prompts held in the
supervisor while the worker that would decode them is predicted over the TPOT limit,
sent oldest first once a step makes room or their wait is up. Hand-made table
transitions and a recording pool, no processes."""

from __future__ import annotations

import time
from typing import Any, cast

import pytest
from table_messages import tokens

from appliance.core.admission import DecodeLoad, pool_load
from appliance.core.admission_queue import ModelCache, StepPace
from appliance.core.events import EventLog
from appliance.core.request_table import Phase, RequestTable
from appliance.core.roles import Role
from appliance.core.router import Router
from appliance.core.tuning import initial_tuning
from appliance.engine.sequence import SamplingParams
from appliance.planner.profile import StepCost
from appliance.pools.request_flow import RequestFlow
from appliance.pools.worker_handle import WorkerHandle
from appliance.settings.config import Settings
from appliance.workers.messages import HandoffResult, Submit, ToWorker

# 6 ms a step, 4 ms a sequence, 3 us a key: with 300-token prompts, 8 sequences step in
# 45.2 ms and 9 in 50.3 ms, over 80% of a 60 ms TPOT limit.
COST = StepCost(base_s=0.006, per_seq_s=0.004, per_context_s=3e-6)
PROMPT = list(range(300))
SLO_SET = {"slo_ttft_ms": 8000, "slo_tpot_ms": 60}  # a prompt is held at most 6 s


class Pool:
    """The flow's view of the pools: colocated workers, every message recorded."""

    def __init__(self, count: int = 1) -> None:
        unused = cast(Any, None)
        role: Role = "colocated"
        self.workers = {
            i: WorkerHandle(i, role, i, f"cpu:{i}", (i,), unused, unused, ready=True)
            for i in range(count)
        }
        self.sent: list[tuple[int | None, ToWorker]] = []

    def send(self, worker_id: int | None, message: ToWorker, /) -> None:
        self.sent.append((worker_id, message))

    def may_come_back(self, role: Role, /) -> bool:
        return False

    def submitted(self, worker_id: int | None = None) -> list[int]:
        return [
            m.request_id for to, m in self.sent if isinstance(m, Submit) and worker_id in (None, to)
        ]


def flow_with(settings: Settings, workers: int = 1) -> tuple[RequestFlow, RequestTable, Pool]:
    table, pool = RequestTable(), Pool(workers)
    unused = cast(Any, None)
    router = Router(settings.kv.block_size, settings.kv.prefix_caching)
    tuning = initial_tuning(settings.batch)
    flow = RequestFlow(
        settings, table, router, cast(Any, pool), lambda: tuning, EventLog(), unused, unused
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
    notes = [e.message for e in flow.log.events if e.kind == "admission"]
    assert len(notes) == 1 and "9 sequences would take 50 ms a step, over 48 ms" in notes[0]


def test_a_worker_stepping_slower_than_its_model_holds_sooner() -> None:
    flow, table, pool = flow_with(Settings(planner=SLO_SET))
    # Its steps come every 2 model steps' time (the worker's own work between them).
    for step in range(10):
        flow.pace.record(0, 100.0 + 0.04 * step, 0.02, running=4)
    assert flow.pace.of(0) == pytest.approx(2.0)
    for _ in range(6):
        arrive(flow, table)
    assert len(pool.submitted()) == 3  # 4 sequences: 2 x 21.2 ms, over 48 ms


def test_the_pace_counts_only_back_to_back_steps() -> None:
    pace = StepPace()
    pace.record(0, 10.0, 0.02, running=0)  # it went idle after this step
    pace.record(0, 15.0, 0.02, running=2)  # an idle gap: no period
    assert pace.of(0) == 1.0
    pace.record(0, 15.03, 0.02, running=2)
    pace.record(0, 15.06, 0.02, running=2)
    assert pace.of(0) == pytest.approx(1.5)
    pace.forget(0)
    assert pace.of(0) == 1.0


def test_an_untimed_step_ends_a_period_but_starts_none() -> None:
    """On CUDA a prefill chunk that samples nothing is not timed. Here each timed step
    (20 ms of model time, 30 ms from its start to the next step's) alternates with an
    untimed one: the worker's pace is 1.5. Leaving the untimed steps out would count
    each timed step's start to the next timed one's (two steps, 60 ms) over 20 ms."""
    pace, timed_only = StepPace(), StepPace()
    for step in range(8):
        start = 10.0 + 0.06 * step
        pace.record(0, start, 0.02, running=2)
        pace.record(0, start + 0.03, None, running=2)
        timed_only.record(0, start, 0.02, running=2)
    assert pace.of(0) == pytest.approx(1.5)
    assert timed_only.of(0) == pytest.approx(3.0)  # what the flow measured before


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


def test_a_prompt_goes_to_a_worker_with_room_though_another_holds_its_prefix() -> None:
    """The router weighs a worker's prefix against its queue (of the tokens each prompt
    computes there): the same 300-token prompt, cached on the first worker after the first
    time, still goes to the second once the first's queue outweighs the 288 tokens it saves
    (before, within a step budget of 8192 queued tokens, all 16 went to the first).
    Admission keeps one from a worker over the limit while another is not."""
    batch = {"max_num_batched_tokens": 8192}
    fcfs = {**SLO_SET, "scheduling_policy": "fcfs"}
    flow, table, pool = flow_with(Settings(planner=fcfs, batch=batch), workers=2)
    for _ in range(16):
        arrive(flow, table)
    assert len(pool.submitted(0)) == 8 and len(pool.submitted(1)) == 8  # the router spreads
    flow, table, pool = flow_with(Settings(planner=SLO_SET, batch=batch), workers=2)
    for _ in range(16):
        arrive(flow, table)
    assert len(pool.submitted(0)) == 8 and len(pool.submitted(1)) == 8
    held = arrive(flow, table)  # both over: held
    assert flow.admission.held == [held]


def test_a_prefill_workers_prompt_is_judged_as_the_simulator_judges_it() -> None:
    """A split pool (0 prefill, 1 and 2 decode): both decode workers run one sequence, the
    second fewer keys; one prompt is prefilled and its handoff waits for room, two are
    queued. The flow weighs them with pool_load (as the simulator does, see
    tests/planner/test_sim_admission.py): the second decode worker, with the three coming
    spread over the two."""
    flow, table, pool = flow_with(Settings(planner=SLO_SET), workers=3)
    roles: tuple[Role, ...] = ("prefill", "decode", "decode")
    for worker, role in zip(pool.workers.values(), roles, strict=True):
        worker.role = role
    now = time.monotonic()

    def prefilled(prompt: int, decode_worker: int | None) -> None:
        request = table.add(list(range(prompt)), SamplingParams(max_tokens=64), now)
        wire = table.submit(request.request_id, 0, prefill_only=True)
        table.on_output(0, tokens(wire, [7], blocks=[1]), now, now)  # parked
        if decode_worker is not None:
            table.send_handoff(request.request_id, decode_worker, now)
            table.on_handoff_result(HandoffResult(decode_worker, wire, True), now)

    prefilled(300, 1)  # decoding on worker 1: 301 keys
    prefilled(100, 2)  # decoding on worker 2: 101 keys
    prefilled(300, None)  # its handoff waits for room: 301 keys coming
    for prompt in (200, 100):  # queued at the prefill worker
        request = table.add(list(range(prompt)), SamplingParams(max_tokens=64), now)
        table.submit(request.request_id, 0, prefill_only=True)
    decoder, load = flow._decode_load(pool.workers[0])
    assert decoder is pool.workers[2]
    assert load == DecodeLoad(1 + 3 // 2, 101 + 601 // 2)
    assert load == pool_load([DecodeLoad(1, 301), DecodeLoad(1, 101)], DecodeLoad(3, 601))[1]
