"""The benchmark's metric maths on hand-made timings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from appliance.bench.report import phase_compare_table, phase_table, write_json
from appliance.bench.shift import Phase
from appliance.core.goodput import (
    SLO,
    RequestResult,
    percentile,
    phase_summaries,
    shift_total,
    summarize,
)


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


def in_phase(phase: int | None, ttft: float, latency: float, ok: bool = True) -> RequestResult:
    r = result(ttft, latency, 11, ok)  # 10 gaps: tpot = (latency - ttft) / 10
    r.phase = phase
    return r


def test_phase_summaries_count_goodput_per_phase_second() -> None:
    phases = [Phase("chat", 2.0, 4.0), Phase("long-burst", 0.5, 10.0), Phase("fixed", 1.0, 2.0)]
    results = [
        in_phase(0, 0.1, 1.1),  # good: ttft 100 ms, tpot 100 ms
        in_phase(0, 0.2, 1.2),  # good
        in_phase(0, 0.9, 1.9),  # ttft too slow
        in_phase(1, 0.1, 3.1),  # tpot 300 ms: too slow
        in_phase(1, 0.3, 1.3),  # good
        in_phase(1, 0.1, 0.1, ok=False),  # failed: sent, never good
        in_phase(None, 0.1, 1.1),  # not of this shift: counted nowhere
    ]
    slo = SLO.parse(["ttft:500", "tpot:150"])
    first, second, third = phase_summaries(results, phases, slo)
    assert (first.phase, first.label, first.seconds) == (0, "1 chat @2.0/s", 4.0)
    assert (first.requests, first.failed) == (3, 0)
    assert first.goodput == 2 / 4 and first.attainment == pytest.approx(2 / 3)
    assert first.ttft_p50 == pytest.approx(0.2) and first.ttft_p90 == pytest.approx(0.76)
    assert first.tpot_p50 == pytest.approx(0.1) and first.tpot_p90 == pytest.approx(0.1)
    assert second.label == "2 long-burst @0.5/s"
    assert (second.requests, second.failed) == (3, 1)
    assert second.goodput == 1 / 10 and second.attainment == pytest.approx(1 / 3)
    assert second.tpot_p50 == pytest.approx(0.2)  # of the completed ones only
    assert (third.requests, third.goodput) == (0, 0.0)
    assert math.isnan(third.attainment) and math.isnan(third.ttft_p50)
    total = shift_total(results, phases, slo)
    assert (total.phase, total.label, total.seconds, total.requests) == (None, "all", 16.0, 6)
    assert total.goodput == 3 / 16 and total.attainment == pytest.approx(3 / 6)


def test_phase_tables_show_each_phase_and_the_whole_run() -> None:
    phases = [Phase("chat", 2.0, 4.0), Phase("fixed", 1.0, 2.0)]
    results = [in_phase(0, 0.1, 1.1), in_phase(0, 0.9, 1.9)]
    slo = SLO.parse(["ttft:500"])
    summaries, total = phase_summaries(results, phases, slo), shift_total(results, phases, slo)
    lines = phase_table(summaries, total).splitlines()
    assert lines[0].startswith("| phase | requests | failed | goodput req/s | attainment |")
    assert lines[2] == "| 1 chat @2.0/s | 2 | 0 | 0.250 | 50% | 500 | 820 | 100 | 100 |"
    assert lines[3] == "| 2 fixed @1.0/s | 0 | 0 | 0.000 | - | - | - | - | - |"
    assert lines[4].startswith("| all | 2 | 0 | 0.167 | 50% |")
    rows = phase_compare_table([("a", summaries, total), ("b", summaries, total)])
    header, _, first, _ = rows.splitlines()
    assert header == "| config | 1 chat @2.0/s goodput | 2 fixed @1.0/s goodput | all goodput |"
    assert first == "| a | 0.250 (50%) | 0.000 (-) | 0.167 (50%) |"


def test_results_round_trip_through_json_with_and_without_a_phase(tmp_path: Path) -> None:
    results = [in_phase(1, 0.1, 1.1), in_phase(None, 0.2, 0.9, ok=False)]
    results[0].itl = [0.1] * 10
    results[1].error = "HTTP 503: busy"
    write_json(tmp_path / "r.json", {"results": results})
    saved = json.loads((tmp_path / "r.json").read_text())["results"]
    assert [item["phase"] for item in saved] == [1, None]
    assert [RequestResult.from_dict(item) for item in saved] == results
    old = {k: v for k, v in saved[0].items() if k != "phase"}  # written before shift runs
    assert RequestResult.from_dict(old | {"later_field": 3}).phase is None
