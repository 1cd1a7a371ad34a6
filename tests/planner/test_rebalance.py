"""The autopilot's decision (planner/rebalance.py, rebalance_paths.py) and the roles it
moves between (planner/layout.py): a hand-made box where prompts are costly and decodes
cheap, so a prefill-starved split gains from one more prefill worker; and one where a
decode step beside a prompt chunk is so slow that two colocated workers lose to a
prefill/decode split two moves away. Then the rules that weigh what each layout measured
(hand-made windows and measurements): a simulator that sees no layout meeting the SLO,
a move that measured worse (rolled back once, held off), the dwell after a move."""

from __future__ import annotations

import random

import pytest
from hand_profiles import hand_profile

from appliance.core.goodput import SLO
from appliance.planner.layout import Layout, Pool, layout_of_roles, roles_problem
from appliance.planner.profile import (
    StepCost,
    WorkerCost,
)
from appliance.planner.rebalance import (
    Measurement,
    Move,
    RebalanceMemory,
    RebalanceRules,
    Roles,
    TrafficMix,
    TrafficWindow,
    Verdict,
    current_goodput,
    decide,
    mix_of,
    moves_from,
    predicted_goodput,
    shape,
)
from appliance.planner.rebalance_paths import (
    best_one,
    best_two,
    move_between,
    nearest,
    path_between,
)
from appliance.planner.simulator import Policy, SimRequest, simulate

# A prompt token costs 1 ms; a decode step 2 ms alone, 50 ms beside a prompt chunk.
SLOW_PROMPTS = WorkerCost(
    prefill=StepCost(base_s=0.001, per_token_s=0.001),
    decode=StepCost(base_s=0.002),
    mixed=StepCost(base_s=0.05, per_token_s=0.001),
    kv_blocks=10_000,
)
PROFILE = hand_profile({"1x1": SLOW_PROMPTS}, atoms=3)
SLO_ = SLO(ttft=1.5, tpot=0.05)
POLICY = Policy()
RULES = RebalanceRules()  # the defaults
STARVED = ("prefill", "decode", "decode")  # one prefill worker: 2.5 prompts/s at most


def long_prompts(seed: int, rate: float = 4.0, duration: float = 20.0) -> tuple[SimRequest, ...]:
    """Poisson arrivals of 400-token prompts asking for 16 tokens."""
    rng = random.Random(seed)
    requests, at = [], rng.expovariate(rate)
    while at < duration:
        requests.append(SimRequest(at, 400, 16))
        at += rng.expovariate(rate)
    return tuple(requests)


def measured(roles: tuple[str | None, ...], requests: tuple[SimRequest, ...]) -> float:
    """What the box would measure: the fraction of the requests within the SLO."""
    results = simulate(PROFILE, layout_of_roles(roles), requests, POLICY)
    return sum(1 for r in results if SLO_.met_by(r)) / len(results)


def look(
    roles: tuple[str | None, ...],
    window: TrafficWindow,
    memory: RebalanceMemory,
    now: float = 1000.0,
    rules: RebalanceRules = RULES,
) -> Verdict:
    return decide(window, PROFILE, roles, POLICY, SLO_, rules, memory, now)


# ---------------------------------------------------------------- roles and layouts


def test_roles_build_the_layouts_they_name() -> None:
    assert layout_of_roles(["colocated", "colocated"]).label == "colocated x2"
    assert layout_of_roles(["prefill", None, "decode"]).label == "1P+1D"
    assert layout_of_roles(["decode", "colocated"]).label == "1D+1C"
    assert layout_of_roles(["colocated", "decode", "prefill"]).label == "1P+1D+1C"
    assert layout_of_roles(["prefill"] * 2 + ["decode", "colocated"], 2).label == "2P+1D+1C/2c"
    mixed = layout_of_roles(["colocated", "decode", "prefill", "prefill"])
    assert (mixed.mode, mixed.devices, mixed.colocated_workers) == ("mixed", 4, 1)
    assert mixed.settings() == {
        "mode": "disaggregated",
        "prefill_tp": 1,
        "prefill_devices": (0, 1),
        "decode_devices": (2,),
        "decode_tp": 1,
        "colocated_devices": (3,),
    }
    assert Layout.model_validate(mixed.model_dump()) == mixed
    assert "colocated" not in layout_of_roles(["colocated"]).model_dump()  # as before


def test_roles_that_cannot_serve_say_why() -> None:
    assert roles_problem(["colocated", "decode"]) is None  # the decode worker idles
    assert roles_problem(["prefill", "decode", "colocated"]) is None
    assert roles_problem(["decode", None]) == "no worker can prefill"
    assert roles_problem(["prefill", "prefill"]) == "no worker can decode"
    assert (
        roles_problem(["prefill", "colocated"])
        == "prefill workers need a decode worker to hand off to"
    )
    assert "'router'" in (roles_problem(["router"]) or "")
    with pytest.raises(ValueError, match="hand off"):
        layout_of_roles(["prefill", "colocated"])


def test_mixed_layouts_are_checked() -> None:
    split = {"prefill": Pool(workers=1), "decode": Pool(workers=1)}
    with pytest.raises(ValueError, match="colocated worker"):
        Layout(mode="mixed", colocated=Pool(workers=0), **split)
    with pytest.raises(ValueError, match="tp 1"):
        Layout(mode="mixed", colocated=Pool(workers=1, tp=2), **split)
    with pytest.raises(ValueError, match="hand off"):
        Layout(mode="mixed", prefill=Pool(workers=1), decode=Pool(workers=0),
               colocated=Pool(workers=1))  # fmt: skip
    with pytest.raises(ValueError, match="only when the mode is mixed"):
        Layout(mode="disaggregated", colocated=Pool(workers=1), **split)
    with pytest.raises(ValueError, match="at least one worker"):
        Layout(mode="colocated", prefill=Pool(workers=0))


def test_moves_from_two_colocated_workers_are_the_valid_ones() -> None:
    # To prefill leaves no decode worker to hand off to; to decode leaves C+D.
    assert moves_from(("colocated", "colocated")) == [(0, "decode"), (1, "decode")]
    assert moves_from(("colocated", "decode")) == [(0, "prefill"), (1, "colocated")]
    assert moves_from(("prefill", None, "decode")) == [(0, "colocated")]


# ---------------------------------------------------------------- decisions


def test_a_prefill_starved_split_moves_a_decode_device_to_prefill() -> None:
    window = TrafficWindow(20.0, long_prompts(1), attainment=0.3)
    verdict = look(STARVED, window, RebalanceMemory(), rules=RebalanceRules(confirm_windows=1))
    assert verdict.move == (1, "prefill")  # devices 1 and 2 tie: the lowest
    assert verdict.recommended == ("prefill", "prefill", "decode")
    assert verdict.predicted_current < verdict.predicted_recommended
    simulated = predicted_goodput(PROFILE, STARVED, window, POLICY, SLO_)
    assert verdict.predicted_current == current_goodput(window, simulated)
    assert "move device 1 from decode to prefill" in verdict.reason


def test_attainment_at_target_holds_whatever_a_move_would_gain() -> None:
    window = TrafficWindow(20.0, long_prompts(1), attainment=0.95)
    memory = RebalanceMemory(streak=(1, "prefill"), streak_count=1)
    verdict = look(STARVED, window, memory)
    assert verdict.move is None and verdict.recommended == STARVED
    assert verdict.reason == "attainment 0.95 >= target 0.90"
    assert memory.streak is None and memory.streak_count == 0
    few = TrafficWindow(20.0, long_prompts(1)[:3], attainment=0.0)
    assert look(STARVED, few, memory).reason == "3 requests in the window < 8"
    unknown = TrafficWindow(20.0, long_prompts(1), attainment=None)
    assert look(STARVED, unknown, memory).reason == "no request finished in the window"


def test_a_move_needs_confirming_looks_and_then_waits_out_the_cooldown() -> None:
    window = TrafficWindow(20.0, long_prompts(2), attainment=0.3)
    memory = RebalanceMemory()
    first = look(STARVED, window, memory, now=100.0)
    assert first.move is None and first.recommended == ("prefill", "prefill", "decode")
    assert first.reason == "1 of 2 looks recommend moving device 1 to prefill"
    second = look(STARVED, window, memory, now=110.0)
    assert second.move == (1, "prefill") and memory.last_move_at == 110.0
    third = look(STARVED, window, memory, now=130.0)  # as if the move had not happened
    assert third.move is None and third.reason == "cooldown: 40 s left"
    assert memory.streak == (1, "prefill") and memory.streak_count == 1


def test_a_small_gain_holds() -> None:
    window = TrafficWindow(20.0, long_prompts(1), attainment=0.3)
    verdict = look(STARVED, window, RebalanceMemory(), rules=RebalanceRules(margin=100.0))
    assert verdict.move is None and verdict.reason.endswith("< margin 10000%")
    assert verdict.recommended == ("prefill", "prefill", "decode")


def test_the_current_layout_counts_at_its_measured_goodput_where_that_is_lower() -> None:
    requests = long_prompts(1)
    window = TrafficWindow(20.0, requests, 0.3)
    simulated = predicted_goodput(PROFILE, STARVED, window, POLICY, SLO_)
    better = predicted_goodput(PROFILE, ("prefill", "prefill", "decode"), window, POLICY, SLO_)
    low = TrafficWindow(20.0, requests, attainment=0.02)
    measured = 0.02 * len(requests) / 20.0
    assert measured < simulated < better  # the box serves worse than simulated
    assert current_goodput(low, simulated) == measured
    assert current_goodput(TrafficWindow(20.0, requests, 1.0), simulated) == simulated
    assert current_goodput(TrafficWindow(20.0, requests, None), simulated) == simulated
    # A margin the simulated gain misses but the gain over the measured goodput clears.
    margin = (better / simulated - 1 + better / measured - 1) / 2
    rules = RebalanceRules(confirm_windows=1, margin=margin)
    verdict = look(STARVED, low, RebalanceMemory(), rules=rules)
    assert verdict.move == (1, "prefill") and verdict.predicted_current == measured
    assert verdict.predicted_recommended == better


def test_a_stationary_mix_moves_once_and_then_holds() -> None:
    roles, memory, moves = STARVED, RebalanceMemory(), []
    for number in range(20):
        requests = long_prompts(100 + number)
        window = TrafficWindow(20.0, requests, measured(roles, requests))
        verdict = look(roles, window, memory, now=20.0 * number)
        assert verdict.current == roles
        if verdict.move is not None:
            moves.append(verdict.move)
            roles = verdict.recommended
    assert moves == [(1, "prefill")]
    assert roles == ("prefill", "prefill", "decode")
    for number in range(20):  # missing the target, yet no move back or on is predicted to help
        window = TrafficWindow(20.0, long_prompts(200 + number), attainment=0.0)
        verdict = look(roles, window, memory, now=1000.0 + 20.0 * number)
        assert verdict.move is None and verdict.reason.startswith("no move is simulated to beat")


def test_bad_inputs_raise_value_errors() -> None:
    with pytest.raises(ValueError, match="duration_s"):
        TrafficWindow(0.0, (), None)
    with pytest.raises(ValueError, match="attainment"):
        TrafficWindow(1.0, (), 1.5)
    with pytest.raises(ValueError, match="after the window"):
        TrafficWindow(1.0, (SimRequest(2.0, 10, 1),), None)
    with pytest.raises(ValueError, match="confirm_windows"):
        RebalanceRules(confirm_windows=0)
    with pytest.raises(ValueError, match="two_move_max_devices"):
        RebalanceRules(two_move_max_devices=-1)
    with pytest.raises(ValueError, match="cannot serve"):
        look(("decode", "decode"), TrafficWindow(1.0, (), None), RebalanceMemory())


# ---------------------------------------------------------------- two moves

# A decode step costs 10 ms alone, 300 ms and more beside a prompt chunk; a 400-token
# prompt 0.2 s alone. With a 20 ms TPOT, a colocated worker misses it whenever a prompt
# lands mid-decode; a split never mixes.
MIXING_HURTS = PROFILE.model_copy(
    update={
        "workers": {
            "1x1": WorkerCost(
                prefill=StepCost(base_s=0.001, per_token_s=0.0005),
                decode=StepCost(base_s=0.01),
                mixed=StepCost(base_s=0.3, per_token_s=0.001),
                kv_blocks=10_000,
            )
        }
    }
)
TIGHT_SLO = SLO(ttft=1.5, tpot=0.02)
COLOCATED: Roles = ("colocated", "colocated")
MIDDLE: Roles = ("decode", "colocated")  # the first step: device 0 to decode (it idles)
SPLIT: Roles = ("decode", "prefill")  # the second: device 1 to prefill
FIRST: Move = (0, "decode")
SECOND: Move = (1, "prefill")


def chats(seed: int, rate: float = 2.0, output: int = 64) -> tuple[SimRequest, ...]:
    """Poisson arrivals over 20 s of 400-token prompts asking for `output` tokens."""
    rng = random.Random(seed)
    requests, at = [], rng.expovariate(rate)
    while at < 20.0:
        requests.append(SimRequest(at, 400, output))
        at += rng.expovariate(rate)
    return tuple(requests)


def chat_window(
    seed: int = 1, attainment: float | None = 0.3, rate: float = 2.0, output: int = 64
) -> TrafficWindow:
    return TrafficWindow(20.0, chats(seed, rate, output), attainment)


def goodput(roles: tuple[str | None, ...], window: TrafficWindow) -> float:
    return predicted_goodput(MIXING_HURTS, roles, window, POLICY, TIGHT_SLO)


def mix_look(
    roles: tuple[str | None, ...],
    window: TrafficWindow,
    memory: RebalanceMemory,
    now: float,
    rules: RebalanceRules = RULES,
) -> Verdict:
    return decide(window, MIXING_HURTS, roles, POLICY, TIGHT_SLO, rules, memory, now)


def test_the_split_is_two_moves_from_colocated_and_the_way_there_is_worse() -> None:
    window = chat_window()
    colocated, middle, split = (goodput(roles, window) for roles in (COLOCATED, MIDDLE, SPLIT))
    assert split > colocated * (1 + RULES.margin)  # 2.25 vs 0.70 req/s
    assert middle < colocated  # the decode worker idles beside one colocated worker
    assert goodput(("prefill", "decode"), window) == split
    assert moves_from(COLOCATED) == [FIRST, (1, "decode")]  # no split one move away
    assert move_between(COLOCATED, SPLIT) is None and move_between(MIDDLE, SPLIT) == SECOND
    assert move_between(SPLIT, ("decode", "decode")) is None  # cannot serve


def test_two_move_paths_go_through_the_best_middle_then_the_lowest_device() -> None:
    scores: dict[Roles, float] = {SPLIT: 2.0, ("prefill", "decode"): 2.0}
    path = best_two(COLOCATED, lambda roles: scores.get(roles, 0.0), floor=1.0)
    assert path is not None and path.target == SPLIT  # equal targets: the first found
    assert path.moves == (FIRST, SECOND) and path.via == 0.0
    assert best_two(COLOCATED, lambda roles: scores.get(roles, 0.0), floor=2.0) is None
    three: Roles = ("colocated",) * 3
    goal: Roles = ("decode", "decode", "colocated")  # device 0 or device 1 first
    scores = {goal: 5.0, ("decode", "colocated", "colocated"): 1.0}
    scores[("colocated", "decode", "colocated")] = 1.0
    path = best_two(three, lambda roles: scores.get(roles, 0.0), floor=1.0)
    assert path is not None and path.moves == ((0, "decode"), (1, "decode"))  # tie
    scores[("colocated", "decode", "colocated")] = 1.5
    path = best_two(three, lambda roles: scores.get(roles, 0.0), floor=1.0)
    assert path is not None and path.target == goal and path.via == 1.5
    assert path.moves == ((1, "decode"), (0, "decode"))


def test_between_equal_paths_the_one_that_keeps_the_workers_wins() -> None:
    # Device 0 was a prefill worker (its pool is shared): it can turn prefill again in
    # place; device 1 would restart. Both splits score the same.
    scores: dict[Roles, float] = {SPLIT: 2.0, ("prefill", "decode"): 2.0}
    kept = frozenset({(0, "decode"), (1, "decode"), (0, "prefill")})
    path = best_two(COLOCATED, lambda roles: scores.get(roles, 0.0), 1.0, kept)
    assert path is not None and path.target == ("prefill", "decode")
    assert path.moves == ((1, "decode"), (0, "prefill"))
    scores[SPLIT] = 2.1  # a better layout still wins over a kept worker
    path = best_two(COLOCATED, lambda roles: scores.get(roles, 0.0), 1.0, kept)
    assert path is not None and path.target == SPLIT
    # One move: between equal layouts, the kept move.
    three: Roles = ("prefill", "decode", "decode")
    scores = {("prefill", "colocated", "decode"): 3.0, ("prefill", "decode", "colocated"): 3.0}
    one = best_one(three, lambda roles: scores.get(roles, 0.0), 1.0, frozenset({(2, "colocated")}))
    assert one is not None and one.moves == ((2, "colocated"),)
    window, memory = chat_window(), RebalanceMemory()
    verdict = decide(
        window, MIXING_HURTS, COLOCATED, Policy(), TIGHT_SLO,
        RebalanceRules(confirm_windows=1), memory, 100.0, 1, kept,
    )  # fmt: skip
    assert verdict.move == (1, "decode") and verdict.recommended == ("prefill", "decode")


def test_from_colocated_the_first_step_is_confirmed_and_the_target_remembered() -> None:
    window, memory = chat_window(), RebalanceMemory()
    first = mix_look(COLOCATED, window, memory, now=100.0)
    assert first.move is None and memory.target is None
    assert (first.recommended, first.path) == (SPLIT, (FIRST, SECOND))
    assert (
        first.reason == "1 of 2 looks recommend moving device 0 to decode, then device 1 to prefill"
    )
    second = mix_look(COLOCATED, window, memory, now=110.0)
    assert second.move == FIRST and second.path == (FIRST, SECOND)
    assert memory.target == SPLIT and memory.last_move_at == 110.0
    assert second.predicted_recommended == goodput(SPLIT, window)
    assert second.predicted_via == goodput(MIDDLE, window)
    assert second.reason == (
        "move device 0 from colocated to decode, then device 1 from colocated to prefill: "
        f"predicted {current_goodput(window, goodput(COLOCATED, window)):.2f} -> "
        f"{goodput(SPLIT, window):.2f} req/s within the SLO (via {goodput(MIDDLE, window):.2f})"
    )


def test_the_second_step_follows_at_once_within_the_cooldown() -> None:
    memory = RebalanceMemory(last_move_at=110.0, target=SPLIT)
    window = chat_window(2, attainment=0.95)  # at target in the middle: it goes on anyway
    verdict = mix_look(MIDDLE, window, memory, now=120.0)
    assert verdict.move == SECOND and verdict.path == (SECOND,)
    assert verdict.recommended == SPLIT and verdict.reason.startswith("second step: move")
    assert memory.target is None and memory.last_move_at == 120.0
    again = mix_look(SPLIT, chat_window(3), memory, now=130.0)  # arrived: holds
    assert again.move is None and again.reason.startswith("no move is simulated to beat")


def test_the_middle_holds_and_forgets_the_target_when_it_no_longer_wins() -> None:
    # Prompts only (one output token): nothing to decode, so two prefilling colocated
    # workers beat one prefill worker; the split gains nothing on the middle.
    prompts = chat_window(1, rate=8.0, output=1)
    assert goodput(COLOCATED, prompts) > goodput(SPLIT, prompts) == goodput(MIDDLE, prompts)
    memory = RebalanceMemory(last_move_at=110.0, target=SPLIT)
    verdict = mix_look(MIDDLE, prompts, memory, now=120.0)
    assert verdict.move is None and memory.target is None
    assert verdict.recommended == COLOCATED and verdict.reason == "cooldown: 50 s left"
    few = TrafficWindow(20.0, chats(1)[:3], attainment=0.0)  # too few requests to go on
    memory = RebalanceMemory(last_move_at=110.0, target=SPLIT)
    verdict = mix_look(MIDDLE, few, memory, now=120.0)
    assert verdict.move is None and memory.target is None
    assert verdict.reason == "3 requests in the window < 8"


def test_the_second_step_needs_the_target_simulated_to_beat_the_middle() -> None:
    # Few short prompts, one token each: every layout serves them all within the SLO, so
    # the split beats the middle only against the window's measured attainment.
    calm = chat_window(1, attainment=0.3, rate=0.6, output=1)
    assert len(calm.requests) >= RULES.min_requests
    assert goodput(SPLIT, calm) == goodput(MIDDLE, calm) == goodput(COLOCATED, calm)
    assert goodput(SPLIT, calm) > current_goodput(calm, goodput(MIDDLE, calm)) * 1.5
    memory = RebalanceMemory(last_move_at=110.0, target=SPLIT)
    verdict = mix_look(MIDDLE, calm, memory, now=120.0)
    assert verdict.move is None and memory.target is None
    assert verdict.reason == f"no move is simulated to beat {goodput(MIDDLE, calm):.2f} req/s"


def test_a_first_step_obeys_the_cooldown_and_a_refused_one_is_forgotten() -> None:
    memory = RebalanceMemory(last_move_at=100.0)
    verdict = mix_look(COLOCATED, chat_window(), memory, now=110.0)
    assert verdict.move is None and verdict.reason == "cooldown: 50 s left"
    assert verdict.recommended == SPLIT and memory.target is None
    memory = RebalanceMemory(last_move_at=100.0, target=SPLIT)  # the first step never ran
    verdict = mix_look(COLOCATED, chat_window(), memory, now=110.0)
    assert verdict.move is None and memory.target is None


def test_two_move_search_is_skipped_on_boxes_over_the_cap() -> None:
    rules = RebalanceRules(confirm_windows=1, two_move_max_devices=1)
    window = chat_window()
    verdict = mix_look(COLOCATED, window, RebalanceMemory(), now=100.0, rules=rules)
    assert verdict.move is None and verdict.recommended == COLOCATED and verdict.path == ()
    assert verdict.reason == f"no move is simulated to beat {goodput(COLOCATED, window):.2f} req/s"


def test_a_stationary_chat_mix_takes_the_two_steps_and_then_holds() -> None:
    roles, memory, moves = COLOCATED, RebalanceMemory(), []
    for number in range(20):
        requests = chats(300 + number)
        results = simulate(MIXING_HURTS, layout_of_roles(roles), requests, POLICY)
        attainment = sum(1 for r in results if TIGHT_SLO.met_by(r)) / len(results)
        window = TrafficWindow(20.0, requests, attainment)
        verdict = mix_look(roles, window, memory, now=20.0 * number)
        assert verdict.current == roles
        if verdict.move is not None:
            moves.append(verdict.move)
            device, to = verdict.move
            roles = tuple(to if i == device else role for i, role in enumerate(roles))
    assert moves == [FIRST, SECOND] and roles == SPLIT and memory.target is None
    for number in range(5):  # missing the target, yet nothing one or two moves away helps
        window = TrafficWindow(20.0, chats(400 + number), attainment=0.0)
        verdict = mix_look(roles, window, memory, now=1000.0 + 20.0 * number)
        assert verdict.move is None and verdict.reason.startswith("no move is simulated to beat")


# ---------------------------------------------------------------- measured figures

TWO_PREFILL: Roles = ("prefill", "prefill", "decode")  # where STARVED moves
NO_ONE_MEETS = SLO(ttft=1.5, tpot=1e-6)  # in simulation no layout meets it


def blind_look(
    roles: Roles, window: TrafficWindow, memory: RebalanceMemory, now: float, rules: RebalanceRules
) -> Verdict:
    return decide(window, PROFILE, roles, POLICY, NO_ONE_MEETS, rules, memory, now)


def remembered(roles: Roles, window: TrafficWindow, attainment: float, at: float) -> Measurement:
    """What `roles` measured `attainment` on traffic like `window`'s at `at`."""
    mix = mix_of(window)
    return Measurement(at, attainment, attainment * mix.rate, mix)


def test_paths_to_a_layout_and_to_the_nearest_of_a_shape() -> None:
    assert path_between(COLOCATED, SPLIT) is not None
    assert path_between(COLOCATED, SPLIT).moves == (FIRST, SECOND)  # type: ignore[union-attr]
    assert path_between(MIDDLE, SPLIT).moves == (SECOND,)  # type: ignore[union-attr]
    assert path_between(COLOCATED, ("decode", "decode")) is None  # cannot serve
    assert shape(("prefill", "decode", "decode")) == shape(("decode", "prefill", "decode"))
    wanted = shape(("prefill", "decode"))
    two = nearest(COLOCATED, lambda roles: shape(roles) == wanted)
    assert two is not None and two.moves == (FIRST, SECOND)
    assert nearest(COLOCATED, lambda roles: shape(roles) == wanted, two=False) is None


def test_a_look_remembers_what_a_layout_measured_on_a_whole_window() -> None:
    window = TrafficWindow(20.0, long_prompts(1), attainment=0.95)
    memory = RebalanceMemory()
    first = look(STARVED, window, memory, now=100.0)
    assert memory.measured == {} and first.measured is not None  # the roles are new
    assert first.rule == "at-target" and first.measured.attainment == 0.95
    look(STARVED, window, memory, now=120.0)  # a whole window on these roles
    kept = memory.measured[shape(STARVED)]
    rate = len(window.requests) / 20.0
    assert (kept.at, kept.attainment, kept.goodput) == (120.0, 0.95, 0.95 * rate)
    assert kept.mix == TrafficMix(rate, 400.0, 16.0)
    look(TWO_PREFILL, window, memory, now=130.0)  # moved: not measured until 150
    assert list(memory.measured) == [shape(STARVED)]
    later = look(TWO_PREFILL, window, memory, now=150.0)
    assert set(later.remembered) == {shape(STARVED), shape(TWO_PREFILL)}
    look(TWO_PREFILL, window, memory, now=120.0 + RULES.remember_s + 1)  # forgotten
    assert list(memory.measured) == [shape(TWO_PREFILL)]
    # Similar traffic: rate, prompt and output each within a factor 1.5.
    assert kept.mix.similar(TrafficMix(rate * 1.4, 300.0, 20.0), 1.5)
    assert not kept.mix.similar(TrafficMix(rate * 1.6, 400.0, 16.0), 1.5)
    assert not kept.mix.similar(TrafficMix(rate, 400.0, 32.0), 1.5)


def test_when_no_layout_is_simulated_to_meet_the_slo_measurements_decide() -> None:
    low = TrafficWindow(20.0, long_prompts(1), attainment=0.2)
    rules = RebalanceRules(confirm_windows=1)
    # Nothing measured elsewhere: it stays (no move on simulated noise around zero).
    stay = blind_look(TWO_PREFILL, low, RebalanceMemory(), 1000.0, rules)
    assert len(stay.simulated) > 1 and set(stay.simulated.values()) == {0.0}
    assert stay.move is None and stay.rule == "measured-stay"
    assert stay.reason.startswith("measured-stay: every layout simulated at ~0")
    # The starved split measured 0.9 on similar traffic four minutes ago: it goes there.
    measured = {shape(STARVED): remembered(STARVED, low, 0.9, 760.0)}
    memory = RebalanceMemory(measured=dict(measured))
    verdict = blind_look(TWO_PREFILL, low, memory, 1000.0, rules)
    assert verdict.rule == "measured-move" and verdict.move == (0, "decode")
    assert shape(verdict.recommended) == shape(STARVED) and len(verdict.path) == 1
    assert verdict.predicted_recommended == measured[shape(STARVED)].goodput
    assert verdict.reason.startswith("measured move: move device 0 from prefill to decode")
    assert "measured 0.90 of requests within the SLO 240 s ago, this layout 0.20" in verdict.reason
    assert verdict.remembered == measured and memory.judgement is not None
    # Measured worse, or on other traffic (twice the rate): it stays.
    worse = {shape(STARVED): remembered(STARVED, low, 0.05, 760.0)}
    verdict = blind_look(TWO_PREFILL, low, RebalanceMemory(measured=worse), 1000.0, rules)
    assert verdict.move is None and verdict.rule == "measured-stay"
    assert "not a target: 1P+2D (measured 0.05 < 0.20" in verdict.reason
    busier = TrafficWindow(20.0, long_prompts(1, rate=8.0), attainment=0.9)
    other = {shape(STARVED): remembered(STARVED, busier, 0.9, 760.0)}
    verdict = blind_look(TWO_PREFILL, low, RebalanceMemory(measured=other), 1000.0, rules)
    assert verdict.move is None and verdict.rule == "measured-stay" and not verdict.remembered


def test_a_layout_that_measured_worse_is_no_target_on_a_prediction_alone() -> None:
    window = TrafficWindow(20.0, long_prompts(1), attainment=0.5)
    rules = RebalanceRules(confirm_windows=1)
    assert look(STARVED, window, RebalanceMemory(), rules=rules).move == (1, "prefill")
    worse = {shape(TWO_PREFILL): remembered(TWO_PREFILL, window, 0.2, 900.0)}
    verdict = look(STARVED, window, RebalanceMemory(measured=dict(worse)), rules=rules)
    assert verdict.move == (1, "colocated")  # the next best simulated, measured nowhere
    assert set(verdict.barred) == {shape(TWO_PREFILL)}
    with_colocated: Roles = ("prefill", "colocated", "decode")
    worse[shape(with_colocated)] = remembered(with_colocated, window, 0.3, 900.0)
    verdict = look(STARVED, window, RebalanceMemory(measured=dict(worse)), rules=rules)
    assert shape(verdict.recommended) not in worse and set(verdict.barred) == set(worse)
    single = RebalanceRules(confirm_windows=1, two_move_max_devices=0)
    verdict = look(STARVED, window, RebalanceMemory(measured=dict(worse)), rules=single)
    assert verdict.move is None and verdict.rule == "no-better"
    assert verdict.reason.startswith("no move is simulated to beat")
    assert "not a target: 2P+1D (measured 0.20 < 0.50 on similar traffic 100 s ago); " in (
        verdict.reason
    )
    assert "1P+1D+1C (measured 0.30 < 0.50" in verdict.reason
    # On other traffic (answers twice as long) the old measurement does not count.
    longer = tuple(SimRequest(r.arrival_s, 400, 32) for r in long_prompts(1))
    verdict = look(STARVED, TrafficWindow(20.0, longer, 0.5), RebalanceMemory(measured=worse),
                   rules=rules)  # fmt: skip
    assert verdict.move is not None and shape(verdict.recommended) == shape(TWO_PREFILL)


def test_a_move_that_measured_worse_is_rolled_back_once_and_held_off() -> None:
    rules = RebalanceRules(confirm_windows=1)
    memory = RebalanceMemory()
    moved = look(STARVED, TrafficWindow(20.0, long_prompts(1), 0.5), memory, 100.0, rules)
    assert moved.move == (1, "prefill") and moved.rule == "move"
    assert memory.judgement is not None and memory.judgement.before.attainment == 0.5
    worse = TrafficWindow(20.0, long_prompts(2), 0.2)  # the same mix, served worse
    early = look(TWO_PREFILL, worse, memory, 110.0, rules)  # not a whole window yet
    assert early.move is None and early.rule != "rollback" and memory.judgement is not None
    back = look(TWO_PREFILL, worse, memory, 130.0, rules)  # within the dwell: a rollback
    assert back.rule == "rollback" and back.move == (1, "decode") and back.recommended == STARVED
    assert back.reason.startswith(
        "rollback: 2P+1D measured 0.20 of requests within the SLO on similar traffic, "
        "1P+2D 0.50 before the move: move device 1 from prefill to decode; 2P+1D held off 300 s"
    )
    assert memory.judgement is None and shape(TWO_PREFILL) in memory.held_off
    # Back on the starved split, missing the target, the simulator still prefers two
    # prefill workers (either device): held off, then measured worse, never a target.
    for now in (140.0, 200.0, 300.0, 500.0, 700.0):
        window = TrafficWindow(20.0, long_prompts(int(now)), 0.5)
        again = look(STARVED, window, memory, now, rules)
        assert shape(again.recommended) != shape(TWO_PREFILL), again.reason
        why = "held off after a rollback" if now < 430.0 else "measured 0.20 < 0.50"
        assert again.barred[shape(TWO_PREFILL)].startswith(why)
        assert again.simulated[TWO_PREFILL] > again.simulated[STARVED] * 2


def test_a_move_judged_on_heavier_traffic_stands() -> None:
    """Seeded mix 11 (issue 35): a right move to colocated x2 was rolled back on a window
    with a third more requests than the one that moved it, the backlog of heavier
    traffic read as the layout's fault. A window over `judge_load_factor` x the prompt
    or answer tokens per second of the moving one judges nothing; the move stands."""
    rules = RebalanceRules(confirm_windows=1)
    memory = RebalanceMemory()
    moving = TrafficWindow(20.0, long_prompts(1), 0.5)
    moved = look(STARVED, moving, memory, 100.0, rules)
    assert moved.move == (1, "prefill") and memory.judgement is not None
    heavier = TrafficWindow(20.0, long_prompts(2, rate=6.0), 0.2)  # served worse, but busier
    assert mix_of(heavier).heavier(mix_of(moving), rules.judge_load_factor)
    assert mix_of(heavier).similar(mix_of(moving), rules.similar_factor)  # once judged on it
    early = look(TWO_PREFILL, heavier, memory, 110.0, rules)  # not a whole window yet
    assert early.move is None and memory.judgement is not None
    kept = look(TWO_PREFILL, heavier, memory, 130.0, rules)
    assert kept.rule != "rollback" and kept.move is None and memory.judgement is None
    assert shape(TWO_PREFILL) not in memory.held_off


def test_heavier_traffic_is_more_prompt_or_answer_tokens_per_second() -> None:
    base = TrafficMix(1.0, 200.0, 100.0)
    assert not TrafficMix(1.1, 200.0, 100.0).heavier(base, 1.15)
    assert TrafficMix(1.2, 200.0, 100.0).heavier(base, 1.15)  # more requests
    assert TrafficMix(1.0, 240.0, 100.0).heavier(base, 1.15)  # longer prompts: prefill
    assert TrafficMix(1.0, 200.0, 120.0).heavier(base, 1.15)  # longer answers: decode
    assert not TrafficMix(1.3, 150.0, 80.0).heavier(base, 1.15)  # more, but lighter ones
    assert not base.heavier(TrafficMix(2.0, 200.0, 100.0), 1.15)


def test_the_layout_a_move_left_is_no_target_within_the_dwell() -> None:
    prompts = chat_window(1, rate=8.0, output=1)  # colocated wins, two moves back
    rules = RebalanceRules(confirm_windows=1, cooldown_s=0.0)  # only the dwell holds
    memory = RebalanceMemory(last_move_at=100.0, left=COLOCATED)
    held = mix_look(SPLIT, prompts, memory, now=150.0, rules=rules)
    assert held.move is None and held.rule == "no-better"
    assert "not a target: colocated x2 (dwell: left 50 s ago, 40 s to go)" in held.reason
    after = mix_look(SPLIT, prompts, memory, now=191.0, rules=rules)
    assert after.recommended == COLOCATED and after.move == (1, "colocated")
    assert after.rule == "move" and memory.target == COLOCATED
