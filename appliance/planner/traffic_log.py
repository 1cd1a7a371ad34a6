"""The traffic the appliance served lately, as the rebalancer reads it: each request's
arrival, prompt and output lengths, prefix-cache hit, and whether it met the SLO.

Pure: the supervisor records each request when its consumer is done with it; `window`
turns the last seconds of it into the simulator's requests (appliance/planner/rebalance.py),
with the requests still running: when the traffic shifts toward long answers, the first
ones finish only many seconds later, and a window of finished requests alone would show
the old traffic meanwhile. Each request comes with its measured latencies (as it ended,
or as it stands), by which the rebalancer sees how close to the SLO the box runs and how
much slower than simulated (appliance/planner/headroom.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from appliance.core.goodput import SLO, RequestResult
from appliance.core.request_table import Phase, Request
from appliance.planner.headroom import Latency
from appliance.planner.rebalance import TrafficWindow
from appliance.planner.simulator import SimRequest


@dataclass(frozen=True)
class Served:
    """One request as it ended: when it arrived (monotonic seconds), its prefix-cache
    hit, and its result as the bench records one (ok: it ran to its end, not failed nor
    left by its consumer), so the SLO judges it as it judges the bench's."""

    arrival: float
    cached_tokens: int
    result: RequestResult
    running: bool = False  # still running: its result as it stands (`so_far`)
    first_token: bool = True  # it has its first token (a running one may not)

    def latency(self) -> Latency:
        """Its measured latencies, as the rebalancer's window carries them."""
        result = self.result
        return Latency(
            ttft=max(0.0, result.ttft),
            tpot=result.tpot if result.ok else None,
            running=self.running,
            ok=result.ok,
            first_token=self.first_token,
        )


def served(request: Request) -> Served | None:
    """What the log keeps of a request; None for one that never arrived (no timing)."""
    timing = request.timing
    arrival, first, last = timing.arrival, timing.first_token, timing.finished
    if arrival is None:
        return None
    ok = request.phase is Phase.FINISHED and first is not None and last is not None
    result = RequestResult(
        prompt_tokens=len(request.prompt),
        output_tokens=len(request.output_ids),
        ok=ok,
        ttft=first - arrival if ok and first is not None else 0.0,
        latency=last - arrival if ok and last is not None else 0.0,
    )
    return Served(arrival, request.cached_tokens, result)


def so_far(request: Request, now: float) -> Served | None:
    """A running request as it stands at `now` (its output so far; latency up to now);
    None for one that ended or never arrived. The SLO judges it as if it ended now: one
    it fails has missed already (no first token within the TTFT limit, or its tokens so
    far slower than the TPOT limit)."""
    arrival, first = request.timing.arrival, request.timing.first_token
    if arrival is None or request.phase.terminal:
        return None
    result = RequestResult(
        prompt_tokens=len(request.prompt),
        output_tokens=len(request.output_ids),
        ok=True,
        ttft=(now if first is None else first) - arrival,
        latency=now - arrival,
    )
    return Served(
        arrival, request.cached_tokens, result, running=True, first_token=first is not None
    )


class TrafficLog:
    """Requests that arrived within the last `kept_s` seconds, oldest arrival first."""

    def __init__(self, kept_s: float) -> None:
        if kept_s <= 0:
            raise ValueError(f"kept_s must be positive, got {kept_s}")
        self.kept_s = kept_s
        self._served: deque[Served] = deque()

    def record(self, request: Request) -> None:
        """Note a request its consumer is done with."""
        item = served(request)
        if item is not None:
            self._served.append(item)

    def window(
        self, now: float, seconds: float, slo: SLO, running: Iterable[Request] = ()
    ) -> TrafficWindow:
        """The requests that arrived in (now - seconds, now], ended or `running`, as the
        simulator's requests (arrivals from the window's start; a running one with the
        output it has so far, a lower bound). Attainment is over those that ran to an end
        or failed, and the running ones that have missed the SLO already; each request's
        latencies (ended, or so far), in the same order. A request with
        cached prompt tokens shares that prefix with the others that had one (the log does
        not know which prefix it was)."""
        self._forget_before(now - max(seconds, self.kept_s))
        start = now - seconds
        ended = [s for s in self._served if s.arrival > start]
        going = [g for r in running if (g := so_far(r, now)) is not None and g.arrival > start]
        both = sorted(ended + going, key=lambda s: s.arrival)
        requests = tuple(_sim_request(s, start) for s in both)
        judged = [slo.met_by(s.result) for s in ended]
        judged += [False for g in going if not slo.met_by(g.result)]
        attainment = sum(judged) / len(judged) if judged else None
        latencies = tuple(s.latency() for s in both)
        return TrafficWindow(seconds, requests, attainment, latencies)

    def _forget_before(self, oldest: float) -> None:
        # Requests are recorded as they end, so arrivals are not in order: scan them all.
        if self._served and min(s.arrival for s in self._served) <= oldest:
            self._served = deque(s for s in self._served if s.arrival > oldest)


def _sim_request(item: Served, start: float) -> SimRequest:
    prompt = item.result.prompt_tokens
    cached = min(item.cached_tokens, prompt)
    return SimRequest(
        arrival_s=item.arrival - start,
        prompt_tokens=prompt,
        output_tokens=max(1, item.result.output_tokens),
        prefix_id=0 if cached else None,
        prefix_tokens=cached,
    )
