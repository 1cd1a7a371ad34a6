"""The traffic log the rebalancer reads: requests as they ended, turned into the
simulator's requests for the last window, with the measured SLO attainment."""

from __future__ import annotations

import pytest

from appliance.core.goodput import SLO
from appliance.core.request_table import Phase, Request, Timing
from appliance.engine.sequence import SamplingParams
from appliance.planner.traffic_log import TrafficLog, served

SLO_1S = SLO(ttft=1.0, tpot=0.1)


def ended(
    arrival: float,
    prompt: int = 10,
    output: int = 5,
    ttft: float | None = 0.5,
    tpot: float = 0.05,
    phase: Phase = Phase.FINISHED,
    cached: int = 0,
) -> Request:
    first = None if ttft is None else arrival + ttft
    last = None if first is None else first + tpot * (output - 1)
    timing = Timing(arrival=arrival, first_token=first, finished=last)
    params = SamplingParams(max_tokens=output)
    request = Request(0, [1] * prompt, params, params, timing, phase=phase)
    request.output_ids = [2] * output
    request.cached_tokens = cached
    return request


def test_a_finished_request_keeps_its_lengths_and_latencies() -> None:
    item = served(ended(100.0, prompt=12, output=5, ttft=0.5, tpot=0.05, cached=8))
    assert item is not None
    result = item.result
    assert (result.prompt_tokens, result.output_tokens, item.cached_tokens) == (12, 5, 8)
    assert result.ttft == pytest.approx(0.5) and result.tpot == pytest.approx(0.05)
    assert SLO_1S.met_by(result) and not SLO(ttft=0.4, tpot=0.1).met_by(result)
    assert not SLO(ttft=1.0, tpot=0.04).met_by(result)


@pytest.mark.parametrize(
    "request_",
    [ended(0.0, phase=Phase.FAILED), ended(0.0, ttft=None, phase=Phase.FAILED)],
    ids=["failed", "no-first-token"],
)
def test_a_request_that_did_not_finish_misses_the_slo(request_: Request) -> None:
    item = served(request_)
    assert item is not None and not SLO_1S.met_by(item.result)


def test_the_window_holds_what_arrived_in_it_from_its_start() -> None:
    log = TrafficLog(kept_s=30)
    for arrival in (50.0, 75.0, 80.0, 99.0):
        log.record(ended(arrival, ttft=0.5 if arrival != 80.0 else 2.0))
    window = log.window(now=100.0, seconds=30.0, slo=SLO_1S)
    assert window.duration_s == 30.0
    assert [r.arrival_s for r in window.requests] == pytest.approx([5.0, 10.0, 29.0])
    assert window.attainment == pytest.approx(2 / 3)  # the 2 s TTFT missed


def test_requests_recorded_out_of_arrival_order_come_out_in_order() -> None:
    log = TrafficLog(kept_s=10)
    for arrival in (9.0, 3.0, 6.0):  # a long one ends after shorter later ones
        log.record(ended(arrival))
    assert [r.arrival_s for r in log.window(10.0, 10.0, SLO_1S).requests] == [3.0, 6.0, 9.0]


def test_cached_prompt_tokens_become_a_shared_prefix() -> None:
    log = TrafficLog(kept_s=10)
    log.record(ended(1.0, prompt=40, cached=32))
    log.record(ended(2.0, prompt=40))
    hit, miss = log.window(10.0, 10.0, SLO_1S).requests
    assert (hit.prefix_id, hit.prefix_tokens) == (0, 32)
    assert (miss.prefix_id, miss.prefix_tokens) == (None, 0)


def test_an_empty_window_has_no_attainment_and_old_requests_are_forgotten() -> None:
    log = TrafficLog(kept_s=5)
    log.record(ended(1.0))
    window = log.window(now=100.0, seconds=5.0, slo=SLO_1S)
    assert window.requests == () and window.attainment is None
    assert log.window(now=100.0, seconds=200.0, slo=SLO_1S).requests == ()  # gone for good


def test_the_log_refuses_a_nonsense_length() -> None:
    with pytest.raises(ValueError, match="kept_s must be positive"):
        TrafficLog(kept_s=0)


def running(arrival: float, output: int, first: float | None, prompt: int = 10) -> Request:
    timing = Timing(arrival=arrival, first_token=first)
    params = SamplingParams(max_tokens=256)
    request = Request(0, [1] * prompt, params, params, timing, phase=Phase.DECODING)
    request.output_ids = [2] * output
    return request


def test_running_requests_join_the_window_and_count_once_they_have_missed() -> None:
    log = TrafficLog(kept_s=30)
    log.record(ended(90.0))  # finished within the SLO
    slow = running(91.0, output=11, first=91.5)  # 11 tokens in 8.5 s: 0.85 s each
    on_pace = running(95.0, output=41, first=95.2)  # 41 tokens in 4.8 s: 0.12 s each
    fresh = running(99.5, output=0, first=None)  # 0.5 s without a first token: not yet
    waited = running(97.0, output=0, first=None, prompt=30)  # 3 s: missed its TTFT
    done = running(92.0, output=5, first=92.5)
    done.phase = Phase.FINISHED  # ended: the log has it, or will
    window = log.window(100.0, 30.0, SLO(ttft=1.0, tpot=0.15), [slow, on_pace, fresh, waited, done])
    # Every request that arrived in the window, running ones with their output so far.
    assert [(r.arrival_s, r.output_tokens) for r in window.requests] == [
        (20.0, 5), (21.0, 11), (25.0, 41), (27.0, 1), (29.5, 1),
    ]  # fmt: skip
    # Judged: the finished one (met), the slow and the waited one (missed already); the
    # one on pace and the fresh one may still meet it.
    assert window.attainment == pytest.approx(1 / 3)
    assert log.window(100.0, 30.0, SLO(ttft=1.0, tpot=0.15), [on_pace]).attainment == 1.0
