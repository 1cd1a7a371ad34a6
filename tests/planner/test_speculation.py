"""The planner's model of speculative decoding (planner/speculation.py), on plain data:
tokens per step at an acceptance and the acceptance measured counts imply, a decode
step's time with the verify rows' cost, and the simulator and the plan with it: at
acceptance 0 everything is as without speculation, at high acceptance decode-bound
layouts gain (and past disable_by_batch_size nothing changes), at a given acceptance
and at one the workers measured (planner/measured_acceptance.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import median

import pytest
from hand_profiles import hand_profile

from appliance.core.goodput import SLO
from appliance.engine.speculative.acceptance import AcceptanceCounts
from appliance.planner.layout import Layout, Pool
from appliance.planner.measured_acceptance import MovingAcceptance
from appliance.planner.plan import PlanSpec, make_plan
from appliance.planner.plan_cli import main
from appliance.planner.profile import Profile, StepCost, WorkerCost
from appliance.planner.simulator import Policy, SimRequest, simulate
from appliance.planner.speculation import (
    Speculation,
    acceptance_for,
    tokens_per_step,
    verify_seconds,
)
from appliance.settings.engine import SpeculativeSettings

PREFILL = StepCost(base_s=0.010, per_token_s=0.0005, per_seq_s=0.0005, per_attended_s=1e-7)
# Decode is memory-bound: a step's base (reading the weights) dominates its rows.
DECODE = StepCost(base_s=0.030, per_token_s=0.0004, per_seq_s=0.0005, per_context_s=1e-7)
MIXED = StepCost(base_s=0.035, per_token_s=0.0005, per_seq_s=0.0005, per_context_s=1e-7)
ONE_PLUS_ONE = Layout(mode="disaggregated", prefill=Pool(workers=1), decode=Pool(workers=1))
COLOCATED = Layout(mode="colocated", prefill=Pool(workers=1))
COLOCATED_X2 = Layout(mode="colocated", prefill=Pool(workers=2))


def profile() -> Profile:
    worker = WorkerCost(prefill=PREFILL, decode=DECODE, mixed=MIXED, kv_blocks=4096)
    return hand_profile({"1x1": worker}, atoms=2)


def decode_bound(count: int = 12, gap: float = 0.5) -> list[SimRequest]:
    """Short prompts, long answers, arriving apart: the time is the decode steps'."""
    return [
        SimRequest(arrival_s=i * gap, prompt_tokens=40, output_tokens=120) for i in range(count)
    ]


def tpot(results: list) -> float:
    gaps = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in results if r.ok]
    return median(gaps)


def test_tokens_per_step_and_the_acceptance_measured_counts_imply() -> None:
    assert tokens_per_step(0.0, 4) == 1.0
    assert tokens_per_step(1.0, 4) == 5.0
    assert tokens_per_step(0.5, 2) == pytest.approx(1.75)
    # 100 verify steps of 2 drafts keeping 0.75 a step on average: a = 0.5.
    counts = AcceptanceCounts(verify_steps=100, drafted=200, accepted=75)
    assert Speculation.from_counts(counts).acceptance == pytest.approx(0.5, abs=1e-9)
    assert acceptance_for(0.0, 4) == 0.0 and acceptance_for(4.0, 4) == 1.0
    for a in (0.1, 0.6, 0.95):
        assert acceptance_for(tokens_per_step(a, 5) - 1, 5) == pytest.approx(a, abs=1e-9)
    with pytest.raises(ValueError, match="no verify steps"):
        Speculation.from_counts(AcceptanceCounts())
    with pytest.raises(ValueError, match="acceptance"):
        Speculation(1.5)
    with pytest.raises(ValueError, match="draft_tokens_min"):
        Speculation(0.5, draft_tokens=2, draft_tokens_min=3)


def test_a_decode_step_with_speculation_costs_its_verify_rows_over_its_tokens() -> None:
    plain = DECODE.seconds(4, 4, 0, 2000, 0)
    assert Speculation(0.0).step_seconds(DECODE, 4, 2000, 4) == plain  # exactly the plain step
    # k drafts a sequence: k more rows (each a query token, reading the sequence's keys).
    expected = DECODE.seconds(4, 4, 0, 2000 * 4, 0) + DECODE.per_token_s * 4 * 3
    assert verify_seconds(DECODE, 4, 2000, 4, 3) == pytest.approx(expected)
    fast = Speculation(0.9, draft_tokens=4)
    best = min(verify_seconds(DECODE, 4, 2000, 4, k) / tokens_per_step(0.9, k) for k in range(1, 5))
    assert fast.step_seconds(DECODE, 4, 2000, 4) == pytest.approx(best)
    assert best < plain / 3
    # Past disable_by_batch_size nobody drafts; where verifying costs more than it makes,
    # the step stays plain (the adaptive policy pauses there).
    assert fast.step_seconds(DECODE, 17, 9000, 17) == DECODE.seconds(17, 17, 0, 9000, 0)
    costly = DECODE.model_copy(update={"per_draft_s": 0.05})  # a draft row dearer than a step
    assert fast.step_seconds(costly, 4, 2000, 4) == plain


@pytest.mark.parametrize(
    "layout", [ONE_PLUS_ONE, COLOCATED, COLOCATED_X2], ids=lambda lay: lay.label
)
def test_at_acceptance_zero_the_simulation_is_the_one_without(layout: Layout) -> None:
    requests = decode_bound()
    without = simulate(profile(), layout, requests, Policy())
    at_zero = simulate(profile(), layout, requests, Policy(speculation=Speculation(0.0)))
    assert at_zero == without


def test_at_high_acceptance_decode_bound_layouts_gain() -> None:
    requests = decode_bound()
    policy = Policy(speculation=Speculation(0.8, draft_tokens=4))
    for layout in (ONE_PLUS_ONE, COLOCATED):
        without = simulate(profile(), layout, requests, Policy())
        faster = simulate(profile(), layout, requests, policy)
        assert all(r.ok for r in faster)
        assert tpot(faster) < tpot(without) / 2  # ~3.4 tokens a step for one step's cost
        # Prompts cost what they cost: the first token comes no later.
        assert median(r.ttft for r in faster) <= median(r.ttft for r in without) + 1e-9


def test_past_disable_by_batch_size_the_decode_pool_does_not_gain() -> None:
    """Forty streams decoding at once on one decode worker: over the cut-off nobody
    drafts, so the decode steps (and TPOT) are the plain ones."""
    crowd = [SimRequest(arrival_s=0.0, prompt_tokens=40, output_tokens=60) for _ in range(40)]
    policy = Policy(speculation=Speculation(0.9, disable_by_batch_size=16))
    without = simulate(profile(), ONE_PLUS_ONE, crowd, Policy())
    crowded = simulate(profile(), ONE_PLUS_ONE, crowd, policy)
    assert tpot(crowded) == pytest.approx(tpot(without), rel=0.05)
    assert tpot(crowded) > 0.9 * tpot(without)


def plan_of(policy: Policy, requests: list[SimRequest]) -> list[tuple[str, float, float]]:
    spec = PlanSpec(rate=2.0, slo=SLO(tpot=0.02), steps=2, span=2, plot_best=1)
    plan = make_plan(profile(), requests, spec, "test", policy)
    return [(lp.label, lp.max_rate, lp.at_rate.attainment) for lp in plan.ranked]


def test_the_plan_ranks_as_without_at_acceptance_zero_and_sees_the_gain_at_high() -> None:
    requests = decode_bound(count=16, gap=0.5)
    without = plan_of(Policy(), requests)
    assert plan_of(Policy(speculation=Speculation(0.0)), requests) == without
    # A 20 ms TPOT: plain decode steps (30 ms) miss it on every layout; with drafts kept
    # at 0.8 the decode-bound layouts meet it.
    assert all(attainment < 0.9 for _, _, attainment in without)
    fast = plan_of(Policy(speculation=Speculation(0.8)), requests)
    _, best_rate, best_attainment = fast[0]
    assert best_attainment >= 0.9 and best_rate > 0 and math.isfinite(best_rate)
    assert {label for label, _, _ in fast} == {label for label, _, _ in without}


def measured(drafted: int, accepted: int) -> Policy:
    """The policy the autopilot simulates with after its decode worker reported these
    totals over 100 verify steps (planner/measured_acceptance.py)."""
    moving = MovingAcceptance(window_s=60.0)
    moving.observe(0.0, {1: AcceptanceCounts(0, 0, 0)})
    moving.observe(30.0, {1: AcceptanceCounts(100, drafted, accepted)})
    # The batch limit of a GPU-like box (the CPU default, 8, stops drafting at this rate).
    spec = SpeculativeSettings(method="ngram", disable_by_batch_size=16)
    return Policy(speculation=moving.speculation(spec))


def test_a_measured_acceptance_ranks_the_layouts() -> None:
    """Prompts of 600 tokens with short answers between chat turns of long answers. At a
    measured acceptance of 0 (every draft rejected) the plan is the one without. Where 3
    of 4 drafts are kept, the layout whose decode steps are decode-only (1P+1D: they
    speculate) meets the 20 ms TPOT at the highest rate, well above colocated x2 (its
    steps carry prompt chunks beside the decodes, modelled plain)."""
    requests = [
        SimRequest(
            arrival_s=i * 0.25,
            prompt_tokens=600 if i % 2 else 40,
            output_tokens=20 if i % 2 else 150,
        )
        for i in range(30)
    ]
    without = plan_of(Policy(), requests)
    assert plan_of(measured(400, 0), requests) == without
    ranked = plan_of(measured(400, 300), requests)
    assert [label for label, _, _ in ranked] == ["1P+1D", "colocated x2"]
    (_, decode_bound_rate, attainment), (_, colocated_rate, _) = ranked
    assert attainment >= 0.9 and decode_bound_rate > 2 * colocated_rate
    assert all(rate == 0.0 for _, rate, _ in without)  # plain decode misses the TPOT


PLAN_ARGS = ["plan", "--workload", "sharegpt-like", "--rate", "2", "--num-requests", "15"]


def planned_tpot(
    args: list[str], path: Path, capsys: pytest.CaptureFixture[str]
) -> dict[str, float]:
    assert main([*PLAN_ARGS, "--goodput", "tpot:20", "--profile", str(path), "--json", *args]) == 0
    layouts = json.loads(capsys.readouterr().out)["layouts"]
    return {item["label"]: item["summary"]["tpot"]["median"] for item in layouts}


def test_the_command_plans_with_speculation_at_the_acceptance_it_is_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = profile().save(tmp_path)
    without = planned_tpot([], path, capsys)
    monkeypatch.setenv("APPLIANCE_SPECULATIVE__METHOD", "ngram")
    assert planned_tpot(["--spec-acceptance", "0"], path, capsys) == without
    faster = planned_tpot(["--spec-acceptance", "0.8"], path, capsys)
    assert faster.keys() == without.keys()
    assert all(faster[label] < without[label] for label in without)
    settings = SpeculativeSettings(method="ngram", num_speculative_tokens=6)
    made = Speculation.from_settings(settings, 0.7)
    assert (made.acceptance, made.draft_tokens) == (0.7, 6)
    with pytest.raises(ValueError, match="acceptance must be in"):
        Speculation.from_settings(settings, 1.2)


def test_planning_with_speculation_on_a_server_without_it_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("APPLIANCE_SPECULATIVE__METHOD", "off")
    path = profile().save(tmp_path)
    args = [*PLAN_ARGS, "--goodput", "tpot:20", "--profile", str(path), "--spec-acceptance", "0.5"]
    assert main(args) == 2
    assert "set speculative.method" in capsys.readouterr().err
