"""How close the box runs to its SLO, and how much slower it runs than simulated: the two
signals the rebalancer's `at-target` rule was blind to (issue 35, mix 1).

Attainment is a cliff: a request 1 ms inside a limit counts as fully as one served in a
tenth of it. On the recorded mix-1 run the split measured 1.00 for 70 s of a chat phase,
then 0.46 ten seconds later: the decode worker ran near its limit, a burst of arrivals
pushed its steps past it, and every running request missed at once. Two measures see the
edge before the fall:

- Headroom: the fraction of the window's requests that meet the SLO with every limit
  scaled by `factor` (0.8: within 80% of each). A box at target without headroom is not
  at rest; the rebalancer then compares layouts on that tighter SLO (who keeps a margin),
  not on the cliff where every layout that still copes ties.
- Slowdown: the box's measured TTFT and time per token over the simulator's, on the
  window's own requests run on the current layout (ratio of sums, at least 1). The
  profile times workers alone; the server, the clients and the queue the window started
  with share the cores and slow every step (on mix 1 colocated x2 measured TPOT p50 28 ms
  where its profile simulates 15 ms). Limits divided by it judge simulated requests as
  the box would serve them. Below 1 (the box faster than simulated) the simulator's
  figures stand: a move is judged on the more cautious view, as `current_goodput` does.

Pure: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from appliance.core.goodput import SLO, RequestResult


@dataclass(frozen=True)
class Latency:
    """One window request's measured latencies: its TTFT (seconds; a running request
    without a first token: its wait so far) and time per output token after the first
    (None under two tokens), as ended or as they stand now (`running`). `ok`: it ended
    without failing (a running one: True). `first_token`: it has one."""

    ttft: float
    tpot: float | None
    running: bool = False
    ok: bool = True
    first_token: bool = True

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ttft) and self.ttft >= 0):
            raise ValueError(f"ttft must be a finite number >= 0, got {self.ttft}")
        if self.tpot is not None and not (math.isfinite(self.tpot) and self.tpot >= 0):
            raise ValueError(f"tpot must be None or a finite number >= 0, got {self.tpot}")


@dataclass(frozen=True)
class Slowdown:
    """The box's measured latencies over the simulator's (each >= 1), and on how many
    requests each was measured (0: not measured, the factor is 1)."""

    ttft: float = 1.0
    tpot: float = 1.0
    ttft_requests: int = 0
    tpot_requests: int = 0


def scaled(slo: SLO, factor: float) -> SLO:
    """The SLO with every limit multiplied by `factor` (0.8: 80% of each)."""
    if not factor > 0:
        raise ValueError(f"factor must be > 0, got {factor}")

    def times(limit: float | None) -> float | None:
        return None if limit is None else limit * factor

    return SLO(ttft=times(slo.ttft), tpot=times(slo.tpot), latency=times(slo.latency))


def met(latency: Latency, slo: SLO) -> bool:
    """Whether a measured request meets `slo` (ended) or has not missed it yet (running:
    judged as if it ended now, as the window's attainment judges it)."""
    if not latency.ok:
        return False
    checks = ((slo.ttft, latency.ttft), (slo.tpot, latency.tpot or 0.0))
    return all(limit is None or value <= limit for limit, value in checks)


def headroom_attainment(latencies: Sequence[Latency], slo: SLO, factor: float) -> float | None:
    """The fraction of the window's judged requests that meet the SLO with its limits
    scaled by `factor`, judged as the window's attainment is: every ended request, and
    the running ones that are already past the scaled limits (a running request still
    inside them may stay there). None when nothing is judged."""
    tight = scaled(slo, factor)
    judged = [met(m, tight) for m in latencies if not m.running]
    judged += [False for m in latencies if m.running and not met(m, tight)]
    return sum(judged) / len(judged) if judged else None


def slowdown(
    latencies: Sequence[Latency], simulated: Sequence[RequestResult], min_requests: int
) -> Slowdown:
    """How much slower the box served the window's requests than the simulator serves the
    same requests (`simulated`, in the same order) on the current layout: the sum of the
    measured TTFTs over the sum of the simulated ones, likewise for the time after the
    first token (TPOT times the tokens after the first, so long answers weigh as they
    load the box). Only requests both served (ended ok, or running with a first token
    and, for TPOT, two tokens); a factor with fewer than `min_requests` such requests,
    or under 1, is 1."""
    if latencies and len(latencies) != len(simulated):
        raise ValueError(f"{len(latencies)} latencies for {len(simulated)} simulated requests")
    ttft_pairs = [
        (m.ttft, s.ttft)
        for m, s in zip(latencies, simulated, strict=False)
        if m.ok and m.first_token and s.ok
    ]
    tpot_pairs = [
        (m.tpot * (s.output_tokens - 1), s.tpot * (s.output_tokens - 1))
        for m, s in zip(latencies, simulated, strict=False)
        if m.ok and m.tpot is not None and s.ok and s.tpot is not None
    ]
    return Slowdown(
        ttft=_ratio(ttft_pairs, min_requests),
        tpot=_ratio(tpot_pairs, min_requests),
        ttft_requests=len(ttft_pairs),
        tpot_requests=len(tpot_pairs),
    )


def calibrated(slo: SLO, slow: Slowdown, factor: float = 1.0) -> SLO:
    """The SLO to judge simulated requests by on a box `slow` times slower than
    simulated (each limit divided by its factor; end-to-end latency by the larger), its
    limits scaled by `factor` besides (headroom)."""

    def over(limit: float | None, by: float) -> float | None:
        return None if limit is None else limit * factor / by

    return SLO(
        ttft=over(slo.ttft, slow.ttft),
        tpot=over(slo.tpot, slow.tpot),
        latency=over(slo.latency, max(slow.ttft, slow.tpot)),
    )


def _ratio(pairs: list[tuple[float, float]], min_requests: int) -> float:
    """Sum of measured over sum of simulated, at least 1; 1 on too few pairs."""
    if len(pairs) < max(1, min_requests):
        return 1.0
    measured = sum(m for m, _ in pairs)
    simulated = sum(s for _, s in pairs)
    if simulated <= 0:
        return 1.0
    return max(1.0, measured / simulated)
