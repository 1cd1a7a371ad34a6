"""A quick fit of a worker size's decode step cost from its newest decode steps, for SLO
admission (core/admission.py), which the supervisor asks on its loop.

OnlineProfile.step_costs fits every kind over up to 2000 steps each (over 0.1 s of pure
Python on a busy 2-core box): too long to stall the loop for every few seconds. Admission
needs the decode kind alone (a step's sequences and keys), so this fits only that, over
the newest `RECENT` decode steps, with the profile's conditions (at least MIN_SAMPLES
steps, each feature spread at least MIN_SPREAD times) and its step-cost fit; a few
milliseconds. A speculating worker's verify steps are counted as their decode rows.

RecentDecodeFits keeps each size's fit until a decode step of that size comes: an idle
box, or one that runs only prefills, fits nothing however often admission asks.
"""

from __future__ import annotations

from collections.abc import Sequence

from appliance.engine.step_timing import StepTiming
from appliance.planner.fitting import fit_step_cost
from appliance.planner.online_profile import MIN_SAMPLES, MIN_SPREAD, OnlineProfile
from appliance.planner.profile import StepCost

RECENT = 300  # the newest decode steps fitted: a few seconds of a busy worker's steps
FEATURES = ("seqs", "context")


def recent_decode_cost(online: OnlineProfile, unit: str, recent: int = RECENT) -> StepCost | None:
    """Worker size `unit`'s decode step cost over its newest `recent` decode steps; None
    while they are too few or too alike to fit."""
    return fit_decode_steps(online.steps(unit, "decode")[-recent:])


def fit_decode_steps(steps: Sequence[StepTiming]) -> StepCost | None:
    """The decode step cost of these steps; None while they are too few or too alike."""
    if len(steps) < MIN_SAMPLES:
        return None
    for feature in FEATURES:
        values = [getattr(s, feature) for s in steps]
        if min(values) <= 0 or max(values) < MIN_SPREAD * min(values):
            return None
    samples = [{"seqs": s.seqs, "context": s.context, "seconds": s.seconds} for s in steps]
    return fit_step_cost(samples, FEATURES)


class RecentDecodeFits:
    """recent_decode_cost per worker size, fitted again only once a decode step of that
    size came since its last fit (told by the newest step kept, and how many are kept: a
    worker reports each step as a new StepTiming). `fitted` counts the fits made."""

    def __init__(self, online: OnlineProfile, recent: int = RECENT) -> None:
        self.online = online
        self.recent = recent
        self.fitted = 0
        # unit -> its newest decode step and the count kept at the last fit, and the fit
        self._fits: dict[str, tuple[StepTiming | None, int, StepCost | None]] = {}

    def cost(self, unit: str) -> StepCost | None:
        """Worker size `unit`'s decode step cost over its newest `recent` decode steps
        (None: too few or too alike), the last fit's while no decode step came since."""
        steps = self.online.steps(unit, "decode")
        newest, kept = (steps[-1] if steps else None), len(steps)
        cached = self._fits.get(unit)
        if cached is not None and cached[0] is newest and cached[1] == kept:
            return cached[2]
        cost = fit_decode_steps(steps[-self.recent :])
        self.fitted += 1
        self._fits[unit] = (newest, kept, cost)
        return cost
