"""SLO admission on plain data: the decision (core/admission.py), the supervisor's queue of
held prompts (core/admission_queue.py) and the settings that turn it on."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from appliance.core.admission import (
    AdmissionLimits,
    DecodeLoad,
    admission_limits,
    decide,
    lightest,
    pool_load,
)
from appliance.core.admission_queue import AdmissionQueue, ModelCache, load_of
from appliance.planner.profile import StepCost
from appliance.settings.planner import PlannerSettings

# 6 ms a step, 4 ms a sequence, 3 us a key: 4 sequences of 300 keys take 25.6 ms.
COST = StepCost(base_s=0.006, per_seq_s=0.004, per_context_s=3e-6)
LIMITS = AdmissionLimits(tpot_s=0.060, max_wait_s=4.0)  # admits up to 48 ms a step


def test_a_prompt_joins_while_the_step_with_it_stays_within_the_headroom() -> None:
    verdict = decide(DecodeLoad(4, 1200), 300, COST, LIMITS, waited_s=0.0)
    assert verdict.admit
    assert verdict.predicted_s == pytest.approx(0.006 + 0.004 * 5 + 3e-6 * 1500)


def test_a_prompt_that_would_push_the_step_over_the_headroom_is_held() -> None:
    # 9 sequences of 300 keys: 6 + 36 + 8.1 = 50.1 ms > 48 ms.
    verdict = decide(DecodeLoad(8, 2400), 300, COST, LIMITS, waited_s=1.0)
    assert not verdict.admit
    assert verdict.predicted_s is not None and verdict.predicted_s > 0.8 * LIMITS.tpot_s
    assert "over 48 ms" in verdict.reason


def test_a_held_prompt_joins_once_it_waited_the_most_a_prompt_is_held() -> None:
    assert not decide(DecodeLoad(20, 6000), 300, COST, LIMITS, waited_s=3.9).admit
    assert decide(DecodeLoad(20, 6000), 300, COST, LIMITS, waited_s=4.0).admit


def test_holding_never_happens_where_it_cannot_help() -> None:
    busy = DecodeLoad(20, 6000)
    assert decide(busy, 300, None, LIMITS, 0.0).reason == "no step-cost model yet"
    assert decide(DecodeLoad(0, 0), 300, COST, LIMITS, 0.0).admit  # an idle worker
    slow = StepCost(base_s=0.050)  # one sequence alone misses 48 ms: waiting gains nothing
    assert decide(busy, 300, slow, LIMITS, 0.0).admit


def test_limits_come_from_a_configured_slo_only() -> None:
    assert admission_limits(PlannerSettings()) is None  # the defaults are not a promise
    limits = admission_limits(PlannerSettings(slo_ttft_ms=8000, slo_tpot_ms=60))
    assert limits == AdmissionLimits(tpot_s=0.060, max_wait_s=6.0)
    assert admission_limits(PlannerSettings(slo_tpot_ms=60)) is not None
    fcfs = PlannerSettings(slo_tpot_ms=60, scheduling_policy="fcfs")
    assert admission_limits(fcfs) is None


def test_bad_limits_and_loads_are_refused() -> None:
    with pytest.raises(ValueError, match="tpot_s > 0"):
        AdmissionLimits(tpot_s=0.0, max_wait_s=1.0)
    with pytest.raises(ValueError, match="never negative"):
        DecodeLoad(-1, 0)
    with pytest.raises(ValueError, match="no load"):
        lightest([])


def test_the_lightest_worker_is_judged() -> None:
    assert lightest([DecodeLoad(9, 2700), DecodeLoad(2, 900), DecodeLoad(2, 600)]) == 2


def test_a_prefill_workers_prompt_is_judged_on_the_pools_lightest_worker_and_whats_coming() -> None:
    """The decode pool's worker with fewest sequences, then fewest keys (the flow's and
    the simulator's choice alike), plus the prompts coming to the pool spread over it;
    tokens left are dropped (never futile: held to its wait's end)."""
    pool = [DecodeLoad(2, 900, (10, 10)), DecodeLoad(2, 400, (5, 5)), DecodeLoad(3, 300)]
    index, load = pool_load(pool, DecodeLoad(4, 1201, (7, 7, 7, 7)))
    assert index == 1
    assert load == DecodeLoad(2 + 4 // 3, 400 + 1201 // 3)
    assert pool_load([DecodeLoad(0, 0)], DecodeLoad(0, 0)) == (0, DecodeLoad(0, 0))


@dataclass
class Params:
    max_tokens: int = 64


@dataclass
class Req:
    prompt: list[int]
    output_ids: list[int] = field(default_factory=list)
    params: Params = field(default_factory=Params)


def test_the_load_of_requests_counts_their_prompts_outputs_and_tokens_left() -> None:
    load = load_of([Req([1] * 100, [2] * 20), Req([1] * 50)])
    assert load == DecodeLoad(2, 170, (44, 64))


def test_a_prompt_is_not_held_where_no_room_comes_within_its_wait() -> None:
    # 12 sequences of 300 keys step in 64.8 ms; 5 must end before a 13th fits 48 ms. The
    # 5th to end has 200 tokens left: 13 s away, past the 4 s a prompt may wait.
    far = DecodeLoad(12, 3600, (200,) * 12)
    verdict = decide(far, 300, COST, LIMITS, waited_s=0.0)
    assert not verdict.admit and verdict.futile
    assert "no room within its wait" in verdict.reason
    near = DecodeLoad(12, 3600, (5, 5, 5, 5, 5, *(200,) * 7))  # 5 end within 0.4 s
    assert not decide(near, 300, COST, LIMITS, waited_s=0.0).futile
    queue = AdmissionQueue(LIMITS)
    assert queue.admits(1, 300, 0.0, [far, far], [COST, COST]) == [0, 1]  # holding is futile
    assert queue.admits(2, 300, 0.0, [far, near], [COST, COST]) == []  # room comes: held


def test_the_queue_admits_in_arrival_order_and_each_within_its_wait_bound() -> None:
    queue = AdmissionQueue(LIMITS)
    full = [DecodeLoad(12, 3600)] * 2  # both workers over the headroom
    models = [COST, COST]
    assert not queue.admits(1, 300, 0.0, full, models)
    # A later prompt is held behind it even where it would fit: first come, first served.
    light = [DecodeLoad(1, 300)] * 2
    assert not queue.admits(2, 300, 0.0, light, models)
    assert queue.held == [1, 2]
    assert not queue.admits(1, 300, 3.0, full, models)  # still over, still within its wait
    assert queue.admits(1, 300, 4.0, full, models)  # its wait is up: it joins regardless
    assert queue.held == [2]
    assert queue.admits(2, 300, 0.5, light, models)
    assert queue.held == []


def test_a_queue_without_limits_admits_everything_and_holds_nothing() -> None:
    queue = AdmissionQueue(None)
    assert queue.admits(1, 300, 0.0, [DecodeLoad(500, 10**6)], [COST])
    assert queue.held == [] and queue.last is None


def test_a_prompt_that_leaves_is_held_no_more() -> None:
    queue = AdmissionQueue(LIMITS)
    assert not queue.admits(1, 300, 0.0, [DecodeLoad(12, 3600)], [COST])
    queue.forget(1)
    assert queue.head() is None


def test_the_model_cache_fetches_a_size_at_most_once_a_refresh() -> None:
    fetched: list[str] = []

    def fetch(unit: str) -> StepCost:
        fetched.append(unit)
        return COST

    cache = ModelCache(fetch, every_s=1.0)
    assert cache.get("1x1", 10.0) is COST
    cache.get("1x1", 10.5)
    cache.get("2x1", 10.5)
    cache.get("1x1", 11.0)
    assert fetched == ["1x1", "2x1", "1x1"]


def test_the_queue_names_the_workers_with_room_for_the_router_to_pick_among() -> None:
    queue = AdmissionQueue(LIMITS)
    loads = [DecodeLoad(12, 3600), DecodeLoad(2, 600), DecodeLoad(8, 2400)]
    assert queue.admits(1, 300, 0.0, loads, [COST] * 3) == [1]
    # A worker stepping twice as slow as its model predicts has less room.
    assert queue.admits(2, 300, 0.0, [DecodeLoad(5, 1500)], [COST], paces=[2.0]) == []
    assert queue.admits(2, 300, 6.0, [DecodeLoad(5, 1500)], [COST], paces=[2.0]) == [0]
