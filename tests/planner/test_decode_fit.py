"""The quick decode fit SLO admission reads (planner/decode_fit.py): it recovers a known
decode step cost from recorded steps, newest first, and declines too few or too alike."""

from __future__ import annotations

import random

import pytest

from appliance.engine.step_timing import StepTiming
from appliance.planner.decode_fit import recent_decode_cost
from appliance.planner.online_profile import OnlineProfile


def decode_step(rng: random.Random, base: float, per_seq: float, per_key: float) -> StepTiming:
    seqs = rng.randint(1, 16)
    context = seqs * rng.randint(100, 600)
    seconds = (base + per_seq * seqs + per_key * context) * rng.uniform(0.97, 1.03)
    return StepTiming("decode", seqs, seqs, 0, context, seconds)


def test_it_recovers_the_decode_cost_of_the_newest_steps() -> None:
    online, rng = OnlineProfile(), random.Random(0)
    for _ in range(500):  # an older, faster regime the newest steps replace
        online.record("1x1", decode_step(rng, 0.003, 0.002, 1e-6))
    for _ in range(300):
        online.record("1x1", decode_step(rng, 0.006, 0.004, 3e-6))
    cost = recent_decode_cost(online, "1x1")
    assert cost is not None
    assert cost.base_s == pytest.approx(0.006, rel=0.25)
    assert cost.per_seq_s == pytest.approx(0.004, rel=0.1)
    assert cost.per_context_s == pytest.approx(3e-6, rel=0.2)


def test_too_few_or_too_alike_steps_give_no_cost() -> None:
    online, rng = OnlineProfile(), random.Random(1)
    for _ in range(10):
        online.record("1x1", decode_step(rng, 0.006, 0.004, 3e-6))
    assert recent_decode_cost(online, "1x1") is None  # 10 steps
    assert recent_decode_cost(online, "2x1") is None  # none of that size
    alike = StepTiming("decode", 4, 4, 0, 1200, 0.03)
    for _ in range(100):
        online.record("4x1", alike)
    assert recent_decode_cost(online, "4x1") is None  # one batch size: no slope to fit
