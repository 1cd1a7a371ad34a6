"""The benchmark's metric maths on hand-made timings."""

from __future__ import annotations

import math

import pytest

from appliance.bench.metrics import SLO, RequestResult, percentile, summarize


def result(ttft: float, latency: float, tokens: int, ok: bool = True) -> RequestResult:
    return RequestResult(prompt_tokens=10, output_tokens=tokens, ok=ok, ttft=ttft, latency=latency)


def test_percentiles_interpolate_like_numpy() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([4, 1, 3, 2], 0) == 1 and percentile([4, 1, 3, 2], 100) == 4
    assert percentile(list(range(1, 101)), 90) == pytest.approx(90.1)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_tpot_excludes_the_first_token() -> None:
    # First token at 0.5 s, 10 tokens by 1.4 s: 9 gaps of 0.1 s.
    assert result(0.5, 1.4, 10).tpot == pytest.approx(0.1)
    assert result(0.5, 0.5, 1).tpot is None


def test_summary_counts_failures_and_uses_only_completed_latencies() -> None:
    results = [
        result(0.1, 1.1, 11),  # tpot 0.1
        result(0.3, 0.7, 5),  # tpot 0.1
        result(9.0, 9.0, 0, ok=False),
    ]
    results[0].itl = [0.1] * 10
    s = summarize(results, duration=2.0, slo=SLO())
    assert (s.completed, s.failed) == (2, 1)
    assert s.request_throughput == 1.0 and s.output_throughput == 8.0
    assert s.ttft.mean == pytest.approx(0.2) and s.ttft.median == pytest.approx(0.2)
    assert s.tpot.p99 == pytest.approx(0.1)
    assert s.itl.mean == pytest.approx(0.1)
    assert s.latency.p90 == pytest.approx(0.7 + 0.9 * 0.4)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    results = [
        result(0.1, 1.1, 11),  # ttft 100 ms, tpot 100 ms
        result(0.6, 1.1, 11),  # ttft too slow
        result(0.1, 2.1, 11),  # tpot 200 ms: too slow
        result(0.2, 0.2, 1),  # one token: no tpot to miss
        result(0.1, 0.1, 0, ok=False),  # failed never counts
    ]
    slo = SLO.parse(["ttft:500", "tpot:150"])
    assert (slo.ttft, slo.tpot) == (0.5, 0.15)
    s = summarize(results, duration=4.0, slo=slo)
    assert s.goodput == 2 / 4
    assert summarize(results, 4.0, SLO()).goodput == 4 / 4  # no SLO: every completed one


def test_slo_specs_are_checked() -> None:
    for bad in (["ttfb:5"], ["tpot:fast"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            SLO.parse(bad)
    assert SLO.parse(["e2el:2000"]).latency == 2.0


def test_no_completed_requests_gives_nan_not_a_crash() -> None:
    s = summarize([result(1, 1, 0, ok=False)], 1.0, SLO())
    assert s.failed == 1 and math.isnan(s.ttft.p99)
