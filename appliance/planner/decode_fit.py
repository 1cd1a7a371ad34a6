"""A quick fit of a worker size's decode step cost from its newest decode steps, for SLO
admission (core/admission.py), which the supervisor asks on its loop.

OnlineProfile.step_costs fits every kind over up to 2000 steps each (over 0.1 s of pure
Python on a busy 2-core box): too long to stall the loop for every few seconds. Admission
needs the decode kind alone (a step's sequences and keys), so this fits only that, over
the newest `RECENT` decode steps, with the profile's conditions (at least MIN_SAMPLES
steps, each feature spread at least MIN_SPREAD times) and its step-cost fit; a few
milliseconds. A speculating worker's verify steps are counted as their decode rows.
"""

from __future__ import annotations

from appliance.planner.fitting import fit_step_cost
from appliance.planner.online_profile import MIN_SAMPLES, MIN_SPREAD, OnlineProfile
from appliance.planner.profile import StepCost

RECENT = 300  # the newest decode steps fitted: a few seconds of a busy worker's steps
FEATURES = ("seqs", "context")


def recent_decode_cost(online: OnlineProfile, unit: str, recent: int = RECENT) -> StepCost | None:
    """Worker size `unit`'s decode step cost over its newest `recent` decode steps; None
    while they are too few or too alike to fit."""
    steps = online.steps(unit, "decode")[-recent:]
    if len(steps) < MIN_SAMPLES:
        return None
    for feature in FEATURES:
        values = [getattr(s, feature) for s in steps]
        if min(values) <= 0 or max(values) < MIN_SPREAD * min(values):
            return None
    samples = [{"seqs": s.seqs, "context": s.context, "seconds": s.seconds} for s in steps]
    return fit_step_cost(samples, FEATURES)
