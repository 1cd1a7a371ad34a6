"""The quick decode fit SLO admission reads (planner/decode_fit.py): it recovers a known
decode step cost from recorded steps, newest first, declines too few or too alike, and
is fitted again only once a new decode step came."""

from __future__ import annotations

import random

import pytest

from appliance.engine.step_timing import StepTiming
from appliance.planner.decode_fit import RecentDecodeFits, recent_decode_cost
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


def test_the_fit_is_made_again_only_after_a_new_decode_step() -> None:
    online, rng = OnlineProfile(window=300), random.Random(2)  # a full window: no growth
    for _ in range(300):
        online.record("1x1", decode_step(rng, 0.006, 0.004, 3e-6))
    fits = RecentDecodeFits(online)
    first = fits.cost("1x1")
    assert first is not None and fits.fitted == 1
    assert fits.cost("1x1") is first and fits.fitted == 1  # no step since: the same fit
    online.record("1x1", StepTiming("prefill", 64, 1, 2080, 0, 0.05))
    assert fits.cost("1x1") is first and fits.fitted == 1  # a prefill is no decode step
    online.record("1x1", decode_step(rng, 0.006, 0.004, 3e-6))
    second = fits.cost("1x1")
    assert fits.fitted == 2 and second is not None and second is not first
    assert second.per_seq_s == pytest.approx(0.004, rel=0.1)
    assert fits.cost("2x1") is None and fits.cost("2x1") is None  # a size with no steps
    assert fits.fitted == 3
