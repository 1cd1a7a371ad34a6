"""The speculative acceptance the box measures, moving with its traffic, for the planner.

Each worker reports its speculative decoding totals since its process started (the
scheduler's AcceptanceCounts, the same figures /metrics shows). The rebalancer looks at
the last `window_s` of traffic; the acceptance it simulates with should be that
traffic's too, not the totals since start: grounded requests keep most n-gram drafts,
chat few, and a box's mix changes. So each look observes every worker's totals, and the
acceptance of the window is what the totals grew by since the last observation at or
before the window's start (a worker restarted since counts from 0 again: its whole
totals; a worker new since then, likewise). The first look, with nothing older, counts
everything since the workers started.

`speculation` turns the window's counts into planner/speculation.py's model (the
per-draft acceptance whose expected accepted run matches the measured one), with the
server's draft length range; None where the server does not speculate or no draft was
verified in the window (the planner then simulates plain decoding). The adaptive rule
drafts only where drafts pay, so the figure is the acceptance of the steps that drafted:
the model applies it to every decode step that its own cost rule lets speculate.

Pure (no torch).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from appliance.engine.speculative.acceptance import AcceptanceCounts
from appliance.planner.speculation import Speculation

if TYPE_CHECKING:
    from appliance.settings.engine import SpeculativeSettings


@dataclass(frozen=True)
class _Observed:
    """Every worker's totals at one look."""

    at: float
    totals: Mapping[int, AcceptanceCounts]


class MovingAcceptance:
    """The decoding workers' verify steps over the last `window_s` seconds of looks."""

    def __init__(self, window_s: float) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._looks: deque[_Observed] = deque()  # oldest first

    def observe(self, now: float, totals: Mapping[int, AcceptanceCounts]) -> None:
        """Every worker's totals since its process started, by worker id, as of `now`
        (copied: a worker's report object may change after)."""
        if self._looks and now < self._looks[-1].at:
            raise ValueError(f"looks go forward in time: {now} after {self._looks[-1].at}")
        self._looks.append(_Observed(now, {w: replace(c) for w, c in totals.items()}))
        # The newest look at or before the window's start stays: the baseline.
        start = now - self.window_s
        while len(self._looks) > 1 and self._looks[1].at <= start:
            self._looks.popleft()

    def counts(self) -> AcceptanceCounts:
        """What the workers verified between the baseline and the latest look (all their
        totals where only one look was made)."""
        if not self._looks:
            return AcceptanceCounts()
        latest = self._looks[-1].totals
        before = self._looks[0].totals if len(self._looks) > 1 else {}
        grown = AcceptanceCounts()
        for worker, now in latest.items():
            then = before.get(worker, AcceptanceCounts())
            if not _grew(then, now):
                then = AcceptanceCounts()  # restarted: its counts begin again at 0
            grown.verify_steps += now.verify_steps - then.verify_steps
            grown.drafted += now.drafted - then.drafted
            grown.accepted += now.accepted - then.accepted
        return grown

    def speculation(self, settings: SpeculativeSettings) -> Speculation | None:
        """The window's acceptance as the simulator's model, with the server's draft
        lengths and batch-size cut-off; None without speculation or verify steps."""
        counts = self.counts()
        if settings.method == "off" or counts.verify_steps == 0:
            return None
        return Speculation.from_counts(
            counts,
            settings.num_speculative_tokens,
            settings.num_speculative_tokens_min,
            settings.disable_by_batch_size,
        )


def _grew(then: AcceptanceCounts, now: AcceptanceCounts) -> bool:
    """Whether `now` can follow `then` in one process (totals only grow)."""
    return (
        now.verify_steps >= then.verify_steps
        and now.drafted >= then.drafted
        and now.accepted >= then.accepted
    )
