"""The serving metrics, as the field reports them (vLLM's benchmark_serving conventions),
computed from per-request timings. Pure Python: tested on hand-made numbers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol


class Phase(Protocol):
    """A stretch of a run summed on its own (bench/shift.py's Phase is one)."""

    @property
    def seconds(self) -> float: ...

    def label(self, index: int) -> str: ...


@dataclass
class RequestResult:
    """One request as the load generator saw it; times in seconds."""

    prompt_tokens: int
    output_tokens: int = 0
    ok: bool = False
    error: str = ""
    start: float = 0.0  # when it was sent, from the run's start
    ttft: float = 0.0  # sent -> first token
    latency: float = 0.0  # sent -> last token
    itl: list[float] = field(default_factory=list)  # gaps between successive chunks
    phase: int | None = None  # 0-based phase of a shift run; None outside one

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None with a single token)."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestResult:
        """A result as a bench JSON holds it; fields it lacks (`phase` in files written
        before shift runs) take their defaults, keys it does not know are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class SLO:
    """Service-level objectives a request must meet to count toward goodput (None: any)."""

    ttft: float | None = None
    tpot: float | None = None
    latency: float | None = None

    def met_by(self, result: RequestResult) -> bool:
        tpot = result.tpot or 0.0  # one token: nothing to pace
        checks = [(self.ttft, result.ttft), (self.tpot, tpot), (self.latency, result.latency)]
        return result.ok and all(limit is None or value <= limit for limit, value in checks)

    @classmethod
    def parse(cls, specs: list[str]) -> SLO:
        """From 'ttft:500 tpot:50' style pairs, milliseconds."""
        names = {"ttft": "ttft", "tpot": "tpot", "e2el": "latency", "latency": "latency"}
        values: dict[str, float] = {}
        for spec in specs:
            name, _, ms = spec.partition(":")
            if name not in names:
                raise ValueError(f"unknown goodput metric {name!r}; use ttft, tpot or e2el")
            try:
                limit = float(ms)
            except ValueError:
                raise ValueError(f"goodput {name} needs milliseconds, got {ms!r}") from None
            if not limit > 0:
                raise ValueError(f"goodput {name} must be positive, got {ms!r}")
            values[names[name]] = limit / 1000
        return cls(**values)


@dataclass
class Distribution:
    """Mean and percentiles of one latency, in seconds (NaN when nothing completed)."""

    mean: float
    median: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> Distribution:
        if not values:
            return cls(math.nan, math.nan, math.nan, math.nan)
        return cls(
            sum(values) / len(values),
            percentile(values, 50),
            percentile(values, 90),
            percentile(values, 99),
        )


@dataclass
class Summary:
    """What one run of a workload against one endpoint measured."""

    completed: int
    failed: int
    duration: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    goodput: float  # requests meeting the SLO / s
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    latency: Distribution


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics (numpy's
    default), so p50 of [1, 2, 3, 4] is 2.5."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(results: list[RequestResult], duration: float, slo: SLO) -> Summary:
    """Failed requests count as failed, never vanish; latencies are over completed ones."""
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    done = [r for r in results if r.ok]
    return Summary(
        completed=len(done),
        failed=len(results) - len(done),
        duration=duration,
        request_throughput=len(done) / duration,
        output_throughput=sum(r.output_tokens for r in done) / duration,
        goodput=sum(slo.met_by(r) for r in done) / duration,
        ttft=Distribution.of([r.ttft for r in done]),
        tpot=Distribution.of([t for r in done if (t := r.tpot) is not None]),
        itl=Distribution.of([gap for r in done for gap in r.itl]),
        latency=Distribution.of([r.latency for r in done]),
    )


@dataclass
class PhaseSummary:
    """One phase of a shift run (or, with phase None, the whole run): its requests,
    goodput (requests within the SLO / the phase's seconds), attainment (the share of
    its requests within the SLO) and latency percentiles over its completed requests."""

    phase: int | None
    label: str
    seconds: float
    requests: int
    failed: int
    goodput: float
    attainment: float  # NaN when the phase sent nothing
    ttft_p50: float
    ttft_p90: float
    tpot_p50: float
    tpot_p90: float


def phase_summaries(
    results: list[RequestResult], phases: Sequence[Phase], slo: SLO
) -> list[PhaseSummary]:
    """One summary per phase, of the results whose `phase` is its index."""
    return [
        _phase_summary(index, phase.label(index), phase.seconds, results, slo)
        for index, phase in enumerate(phases)
    ]


def shift_total(results: list[RequestResult], phases: Sequence[Phase], slo: SLO) -> PhaseSummary:
    """The whole shift run as one row, 'all': every phase's requests, goodput over the
    phases' total seconds (not the wall time, which the last slow answers stretch)."""
    seconds = sum(phase.seconds for phase in phases)
    return _phase_summary(None, "all", seconds, [r for r in results if r.phase is not None], slo)


def _phase_summary(
    index: int | None, label: str, seconds: float, results: list[RequestResult], slo: SLO
) -> PhaseSummary:
    mine = [r for r in results if index is None or r.phase == index]
    done = [r for r in mine if r.ok]
    good = sum(slo.met_by(r) for r in done)
    ttft = Distribution.of([r.ttft for r in done])
    tpot = Distribution.of([t for r in done if (t := r.tpot) is not None])
    return PhaseSummary(
        phase=index,
        label=label,
        seconds=seconds,
        requests=len(mine),
        failed=len(mine) - len(done),
        goodput=good / seconds,
        attainment=good / len(mine) if mine else math.nan,
        ttft_p50=ttft.median,
        ttft_p90=ttft.p90,
        tpot_p50=tpot.median,
        tpot_p90=tpot.p90,
    )
