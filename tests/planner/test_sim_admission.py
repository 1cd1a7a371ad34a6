"""SLO admission in the simulator (Policy.admission: the supervisor's queue and
core/admission.py's decision, as the flow runs them) and layout moves during a run.

The profile is this box's (tests/data/autopilot_mix1/profile.json) with every step 1.3x
slower, as the box served in issue 35's seeded runs; the traffic is chat-like (seeded
Poisson arrivals, prompts 50-400 tokens, answers 20-250)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from appliance.core.admission import AdmissionLimits, DecodeLoad, pool_load
from appliance.core.goodput import SLO, RequestResult
from appliance.planner.layout import layout_of_roles
from appliance.planner.profile import Profile, StepCost, WorkerCost, load_profile
from appliance.planner.sim_pool import SimSeq
from appliance.planner.sim_run import Move, Simulation
from appliance.planner.simulator import Policy, SimRequest, simulate

PROFILE = Path(__file__).parents[1] / "data" / "autopilot_mix1" / "profile.json"
SLOW = ("base_s", "per_token_s", "per_seq_s", "per_attended_s", "per_context_s")
SPLIT = ("prefill", "decode")
COLOCATED = ("colocated", "colocated")
MIX15 = SLO(ttft=8.0, tpot=0.060)
LIMITS = AdmissionLimits.from_slo(8.0, 0.060)  # held at most 6 s


def slowed(profile: Profile, factor: float) -> Profile:
    def step(cost: StepCost) -> StepCost:
        return cost.model_copy(update={f: getattr(cost, f) * factor for f in SLOW})

    def worker(cost: WorkerCost) -> WorkerCost:
        return cost.model_copy(
            update={k: step(getattr(cost, k)) for k in ("prefill", "decode", "mixed")}
        )

    workers = {unit: worker(cost) for unit, cost in profile.workers.items()}
    return profile.model_copy(update={"workers": workers})


@pytest.fixture(scope="module")
def box() -> Profile:
    return slowed(load_profile(PROFILE), 1.3)


def chat(rate: float, seconds: float, seed: int = 0) -> list[SimRequest]:
    rng = random.Random(seed)
    requests, at = [], 0.0
    while at < seconds:
        requests.append(SimRequest(at, rng.randint(50, 400), rng.randint(20, 250)))
        at += rng.expovariate(rate)
    return requests


def attainment(results: list[RequestResult]) -> float:
    return sum(MIX15.met_by(r) for r in results) / len(results)


def test_a_saturated_phase_reached_late_keeps_its_slo_with_admission(box: Profile) -> None:
    """Mix 15's first phase: the split for its first 30/40 s, then colocated x2 (in
    place: the split's backlog goes on there). First come, first served, the backlog keeps
    every decode step over the TPOT limit; held prompts let it drain."""
    requests = chat(1.3, 100)
    moves = [Move(30.0, 0, "colocated"), Move(40.0, 1, "colocated")]
    split = layout_of_roles(SPLIT)
    fcfs = simulate(box, split, requests, Policy(), moves=moves)
    slo = simulate(box, split, requests, Policy(admission=LIMITS), moves=moves)
    fresh = simulate(box, layout_of_roles(COLOCATED), requests, Policy())
    assert all(r.ok for r in fcfs + slo)
    assert attainment(fresh) > 0.8  # colocated x2 from the start copes
    assert attainment(fcfs) < 0.5  # reached late, it does not
    assert attainment(slo) > 0.8


def test_a_burst_above_capacity_completes_and_no_prompt_waits_past_its_bound(
    box: Profile,
) -> None:
    """Three times what colocated x2 serves, for 30 s: every request completes, and none
    waits in the queue much past the bound (6 s, judged at the next step end) before its
    prefill starts."""
    requests = chat(4.0, 30, seed=1)
    policy = Policy(admission=LIMITS)
    results = simulate(box, layout_of_roles(COLOCATED), requests, policy)
    assert all(
        r.ok and r.output_tokens == q.output_tokens for r, q in zip(results, requests, strict=True)
    )
    fcfs = simulate(box, layout_of_roles(COLOCATED), requests, Policy())
    # A held prompt's first token: its wait (at most 6 s and a step), then its prefill in
    # a batch that every admitted prompt has joined; first come, first served shows the
    # prefill part of it.
    worst_fcfs = max(r.ttft for r in fcfs)
    assert max(r.ttft for r in results) <= LIMITS.max_wait_s + worst_fcfs + 1.0


def test_without_limits_the_simulation_is_unchanged(box: Profile) -> None:
    requests = chat(1.4, 40, seed=2)
    layout = layout_of_roles(COLOCATED)
    plain = simulate(box, layout, requests, Policy())
    loose = simulate(box, layout, requests, Policy(admission=AdmissionLimits(10.0, 4.0)))
    assert [r.ttft for r in plain] == [r.ttft for r in loose]  # never over a 10 s step


def test_a_move_turns_a_worker_in_place_and_its_requests_go_on(box: Profile) -> None:
    requests = chat(0.8, 20, seed=3)
    moved = simulate(
        box, layout_of_roles(SPLIT), requests, Policy(), moves=[Move(5.0, 0, "colocated")]
    )
    assert all(r.ok for r in moved)
    with pytest.raises(ValueError, match="the layout has 2"):
        simulate(box, layout_of_roles(SPLIT), requests, Policy(), moves=[Move(1.0, 2, "decode")])


def test_a_prefill_workers_prompt_is_judged_as_the_flow_judges_it(box: Profile) -> None:
    """The state of tests/pools/test_slo_admission_flow.py's split pool: decode workers
    with one sequence each (301 and 101 keys), a handoff waiting for room (301 keys) and
    two prompts queued at the prefill worker (200 and 100): the same load (pool_load), on
    the worker with fewer keys, where the simulator once took the first of equal counts
    and the flow the lighter."""
    layout = layout_of_roles(("prefill", "decode", "decode"))
    sim = Simulation(box, layout, [], Policy(admission=LIMITS))
    prefill, first, second = sim.workers

    def seq(prompt: int, made: int) -> SimSeq:
        made_seq = SimSeq(0, prompt, 64, [])
        made_seq.made = made
        return made_seq

    first.landed.append(seq(300, 1))
    second.landed.append(seq(100, 1))
    sim.handoffs.append((prefill, seq(300, 1)))
    prefill.waiting.extend([seq(200, 0), seq(100, 0)])
    expected = pool_load([DecodeLoad(1, 301), DecodeLoad(1, 101)], DecodeLoad(3, 601))[1]
    assert sim._decode_load(prefill) == expected == DecodeLoad(2, 101 + 300)
    # A handoff being copied counts on its decode worker, its keys too (the flow's table
    # has it there from the moment it is sent).
    sim._send(prefill, sim.handoffs.pop()[1], second, 0.0)
    assert sim._decode_load(prefill) == DecodeLoad(1 + 2 // 2, 301 + 300 // 2)
