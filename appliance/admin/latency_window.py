"""Recent request latencies for the console: the requests that finished in the last
minute, as percentiles and rates."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from appliance.admin.schema import Latency, Percentiles
from appliance.core.goodput import percentile


@dataclass(frozen=True)
class Finished:
    at: float  # monotonic seconds when its last token reached the server
    ttft: float  # seconds
    tpot: float | None  # seconds per token after the first; None for one token
    output_tokens: int


class LatencyWindow:
    """Finished requests of the last `window_s` seconds (monotonic clock)."""

    def __init__(self, window_s: float = 60.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        self._finished: deque[Finished] = deque()

    def record(self, finished: Finished) -> None:
        self._finished.append(finished)

    def summary(self, now: float) -> Latency:
        """Percentiles (ms) and rates over what finished in (now - window_s, now]."""
        self._forget_before(now - self.window_s)
        kept = list(self._finished)
        tpots = [f.tpot for f in kept if f.tpot is not None]
        return Latency(
            window_s=self.window_s,
            finished=len(kept),
            ttft_ms=_percentiles([f.ttft for f in kept]),
            tpot_ms=_percentiles(tpots),
            requests_per_s=len(kept) / self.window_s,
            output_tokens_per_s=sum(f.output_tokens for f in kept) / self.window_s,
        )

    def _forget_before(self, oldest: float) -> None:
        while self._finished and self._finished[0].at <= oldest:
            self._finished.popleft()


def _percentiles(seconds: list[float]) -> Percentiles:
    if not seconds:
        return Percentiles()
    ms = [s * 1000 for s in seconds]
    return Percentiles(p50=percentile(ms, 50), p99=percentile(ms, 99))
