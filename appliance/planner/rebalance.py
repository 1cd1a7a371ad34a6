"""The autopilot's decision: should one device change its role now?

Each look hands `decide` the last window of traffic (its requests, and the fraction of
those that finished within the SLO), the devices' roles and what it remembers. It
simulates the window's requests on the current roles and on every set of roles one move
away (one device's worker to another role), then moves only when the box misses its
target, the best move is predicted to gain more than a margin, no move was made lately,
and the same move won the last few looks (hysteresis: no flapping on noise).

Two-move lookahead: a single move cannot leave an all-colocated layout (its one valid
move, a device to decode, idles that device), so when no move clears the margin it also
simulates every layout two moves away (rebalance_paths.py; boxes of at most
`rules.two_move_max_devices` devices: O((2n)^2) simulations). A two-move target that
clears the margin is recommended and its first step made under the same rules; memory
keeps the target, and the next look makes the second step at once (no cooldown, no
confirming looks: the layout in the middle is worse) if the target still wins.

The simulation starts each layout empty, so a window predicts steady traffic, not the
backlog the box holds now; and it times workers alone, without the server and clients
that share the cores. Where the box serves the window worse than simulated, the
measured goodput stands for the current layout (`current_goodput`): a move must still be
simulated to beat the current layout, and its gain is judged against the lower figure.
Pure: no torch, no asyncio.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from appliance.bench.metrics import SLO
from appliance.planner.layout import layout_of_roles, roles_problem
from appliance.planner.profile import Profile
from appliance.planner.rebalance_paths import (
    Move,
    Path,
    Roles,
    Score,
    best_one,
    best_two,
    move_between,
    moves_from,
)
from appliance.planner.simulator import Policy, SimRequest, simulate

__all__ = [
    "Move",
    "RebalanceMemory",
    "RebalanceRules",
    "Roles",
    "TrafficWindow",
    "Verdict",
    "decide",
    "moves_from",
    "predicted_goodput",
]

EPSILON = 1e-9  # goodput (req/s) below which a layout counts as serving nothing


@dataclass(frozen=True)
class RebalanceRules:
    """When a predicted gain is worth a move."""

    margin: float = 0.15  # predicted goodput gain (fraction) a move must clear
    target_attainment: float = 0.9  # no move while measured attainment is at least this
    cooldown_s: float = 60.0  # no move within this long after the last one
    confirm_windows: int = 2  # the same move recommended this many looks in a row
    min_requests: int = 8  # fewer requests in the window: hold
    # Two-move search (only when no single move clears the margin) on boxes of at most
    # this many devices: O((2n)^2) simulations of the window, ~120 layouts at 8 devices
    # (about 1 s for 80 requests at ~8 ms each). 0: single moves only.
    two_move_max_devices: int = 8

    def __post_init__(self) -> None:
        checks = [
            (self.margin >= 0, f"margin must be >= 0, got {self.margin}"),
            (
                0 <= self.target_attainment <= 1,
                f"target_attainment must be in [0, 1], got {self.target_attainment}",
            ),
            (self.cooldown_s >= 0, f"cooldown_s must be >= 0, got {self.cooldown_s}"),
            (
                self.confirm_windows >= 1,
                f"confirm_windows must be >= 1, got {self.confirm_windows}",
            ),
            (self.min_requests >= 0, f"min_requests must be >= 0, got {self.min_requests}"),
            (
                self.two_move_max_devices >= 0,
                f"two_move_max_devices must be >= 0, got {self.two_move_max_devices}",
            ),
        ]
        _check(checks)


@dataclass(frozen=True)
class TrafficWindow:
    """The traffic of one look's window."""

    duration_s: float  # > 0
    requests: tuple[SimRequest, ...]  # arrivals relative to the window's start
    attainment: float | None  # measured fraction of finished requests within the SLO

    def __post_init__(self) -> None:
        late = [r.arrival_s for r in self.requests if r.arrival_s > self.duration_s]
        checks = [
            (
                math.isfinite(self.duration_s) and self.duration_s > 0,
                f"duration_s must be a finite number > 0, got {self.duration_s}",
            ),
            (
                self.attainment is None or 0 <= self.attainment <= 1,
                f"attainment must be None or in [0, 1], got {self.attainment}",
            ),
            (
                not late,
                f"a request arrives at {max(late, default=0.0)} s, after the window's "
                f"{self.duration_s} s",
            ),
        ]
        _check(checks)


@dataclass
class RebalanceMemory:
    """What the rebalancer remembers between looks (`decide` updates it)."""

    last_move_at: float | None = None
    streak: Move | None = None  # the move recommended in the last looks
    streak_count: int = 0  # how many looks in a row
    target: Roles | None = None  # after the first step of two: where the second leads


@dataclass(frozen=True)
class Verdict:
    """One look's answer: the best roles one (or two) moves away, and whether to move
    now."""

    current: Roles
    recommended: Roles  # current when no move is predicted better (or none was tried)
    move: Move | None  # (device, to_role) to do now; None = hold
    predicted_current: float  # goodput req/s: requests within the SLO / window duration
    predicted_recommended: float
    reason: str  # why it moves or holds, one line
    path: tuple[Move, ...] = ()  # the moves to recommended, in order; [0] is move if any
    predicted_via: float | None = None  # a two-move path's layout in the middle


def predicted_goodput(
    profile: Profile,
    roles: Sequence[str | None],
    window: TrafficWindow,
    policy: Policy,
    slo: SLO,
    device_size: int = 1,
) -> float:
    """Requests per second of the window that the roles would serve within the SLO."""
    layout = layout_of_roles(roles, device_size)
    results = simulate(profile, layout, window.requests, policy)
    good = sum(1 for result in results if slo.met_by(result))  # met_by needs ok
    return good / window.duration_s


def decide(
    window: TrafficWindow,
    profile: Profile,
    roles: Sequence[str | None],
    policy: Policy,
    slo: SLO,
    rules: RebalanceRules,
    memory: RebalanceMemory,
    now: float,
    device_size: int = 1,
    in_place: frozenset[Move] = frozenset(),
) -> Verdict:
    """Hold or move one device, per `rules`; updates `memory`. A window with too few
    requests, or whose measured attainment meets the target, holds without simulating
    the moves (recommended is then the current roles). After the first step of a
    two-move path (`memory.target`), the second is made at once if the target still
    wins (see `_second_step`); else the look decides afresh. `in_place`: the moves that
    would keep their device's worker, preferred between equally good paths."""
    current: Roles = tuple(roles)
    problem = roles_problem(current)
    if problem is not None:
        raise ValueError(f"the current roles {current} cannot serve: {problem}")
    score = _scorer(window, profile, policy, slo, device_size)
    simulated = score(current)
    target, memory.target = memory.target, None
    if target is not None:
        second = _second_step(window, current, target, simulated, score, rules, memory, now)
        if second is not None:
            return second
    return _fresh(window, current, simulated, score, rules, memory, now, in_place)


def current_goodput(window: TrafficWindow, simulated: float) -> float:
    """The current layout's goodput on the window: the simulated one, or the measured one
    (attainment times the window's requests per second) where that is lower."""
    if window.attainment is None:
        return simulated
    return min(simulated, window.attainment * len(window.requests) / window.duration_s)


def _scorer(
    window: TrafficWindow, profile: Profile, policy: Policy, slo: SLO, device_size: int
) -> Score:
    """Predicted goodput of a set of roles on the window, each simulated once."""
    known: dict[Roles, float] = {}

    def score(roles: Roles) -> float:
        if roles not in known:
            known[roles] = predicted_goodput(profile, roles, window, policy, slo, device_size)
        return known[roles]

    return score


def _second_step(
    window: TrafficWindow,
    current: Roles,
    target: Roles,
    simulated: float,
    score: Score,
    rules: RebalanceRules,
    memory: RebalanceMemory,
    now: float,
) -> Verdict | None:
    """The second step to `target`, made now (no cooldown, no confirming looks, nor the
    attainment target) when the window has enough requests, the target is one move away,
    is at least as good as the best layout one move away, is simulated to beat the
    current layout's `simulated` goodput, and beats its `current_goodput` by the margin
    (the first step's rules); None otherwise (decide afresh)."""
    step = move_between(current, target)
    if step is None or len(window.requests) < rules.min_requests:
        return None
    here = current_goodput(window, simulated)
    best, goal = best_one(current, score, simulated), score(target)
    if best is None or goal < best.goodput or _worth(here, goal, rules) is not None:
        return None
    memory.last_move_at, memory.streak, memory.streak_count = now, None, 0
    device, to = step
    reason = (
        f"second step: move device {device} from {current[device]} to {to}: predicted "
        f"{here:.2f} -> {goal:.2f} req/s within the SLO"
    )
    return Verdict(current, target, step, here, goal, reason, path=(step,))


def _fresh(
    window: TrafficWindow,
    current: Roles,
    simulated: float,
    score: Score,
    rules: RebalanceRules,
    memory: RebalanceMemory,
    now: float,
    in_place: frozenset[Move],
) -> Verdict:
    """Hold, or make the first (or only) move of the best path worth it, per `rules`: the
    path must beat the current layout's `simulated` goodput, and its gain is judged
    against `current_goodput`."""
    here = current_goodput(window, simulated)
    held = _quiet(window, rules)
    if held is not None:
        return _hold(memory, Verdict(current, current, None, here, here, held))
    best = _best_path(current, simulated, score, rules, in_place)
    if best is None:
        nothing = f"no move is simulated to beat {simulated:.2f} req/s"
        return _hold(memory, Verdict(current, current, None, here, here, nothing))
    proposal = _proposal(current, here, best)
    worth = _worth(here, best.goodput, rules)
    if worth is not None:
        return _hold(memory, replace(proposal, reason=worth))
    return _confirm(memory, rules, now, proposal, best)


def _best_path(
    current: Roles, here: float, score: Score, rules: RebalanceRules, in_place: frozenset[Move]
) -> Path | None:
    """The best layout one move away; when it does not clear the margin (on a box of at
    most `rules.two_move_max_devices` devices), the best two moves away if better still.
    None when nothing beats the current roles."""
    one = best_one(current, score, here, in_place)
    if one is not None and _worth(here, one.goodput, rules) is None:
        return one
    if len(current) > rules.two_move_max_devices:
        return one
    return best_two(current, score, one.goodput if one else here, in_place) or one


def _proposal(current: Roles, here: float, best: Path) -> Verdict:
    """A verdict that holds, recommending `best`'s target (reason to be filled in)."""
    return Verdict(
        current, best.target, None, here, best.goodput, "", path=best.moves, predicted_via=best.via
    )


def _quiet(window: TrafficWindow, rules: RebalanceRules) -> str | None:
    """Why the window gives no cause to move, before any prediction."""
    count = len(window.requests)
    if count < rules.min_requests:
        return f"{count} requests in the window < {rules.min_requests}"
    if window.attainment is None:
        return "no request finished in the window"
    if window.attainment >= rules.target_attainment:
        return f"attainment {window.attainment:.2f} >= target {rules.target_attainment:.2f}"
    return None


def _worth(here: float, there: float, rules: RebalanceRules) -> str | None:
    """Why a predicted gain is not worth a move (None: it is)."""
    gain = (there - here) / max(here, EPSILON)
    if there > here and gain > rules.margin:
        return None
    return f"gain {gain:.0%} < margin {rules.margin:.0%}"


def _confirm(
    memory: RebalanceMemory, rules: RebalanceRules, now: float, proposal: Verdict, best: Path
) -> Verdict:
    """A path worth taking: its first move made now unless cooldown or too short a
    streak (of the same first move) holds it; a two-move path's target is remembered."""
    move = best.moves[0]
    if memory.streak == move:
        memory.streak_count += 1
    else:
        memory.streak, memory.streak_count = move, 1
    wait = _cooldown_left(memory, rules, now)
    if wait > 0:
        return replace(proposal, reason=f"cooldown: {wait:.0f} s left")
    if memory.streak_count < rules.confirm_windows:
        count = f"{memory.streak_count} of {rules.confirm_windows}"
        steps = ", then ".join(f"device {device} to {to}" for device, to in best.moves)
        return replace(proposal, reason=f"{count} looks recommend moving {steps}")
    memory.last_move_at, memory.streak, memory.streak_count = now, None, 0
    memory.target = best.target if len(best.moves) > 1 else None
    return replace(proposal, move=move, reason=_move_reason(proposal, best))


def _move_reason(proposal: Verdict, best: Path) -> str:
    """'move device 1 from colocated to decode, then device 0 from colocated to prefill:
    predicted 0.85 -> 1.70 req/s within the SLO (via 0.10)'."""
    roles, steps = list(proposal.current), []
    for device, to in best.moves:
        steps.append(f"device {device} from {roles[device]} to {to}")
        roles[device] = to
    via = f" (via {best.via:.2f})" if best.via is not None else ""
    before, after = proposal.predicted_current, proposal.predicted_recommended
    return (
        f"move {', then '.join(steps)}: predicted {before:.2f} -> {after:.2f} req/s "
        f"within the SLO{via}"
    )


def _cooldown_left(memory: RebalanceMemory, rules: RebalanceRules, now: float) -> float:
    if memory.last_move_at is None:
        return 0.0
    return rules.cooldown_s - (now - memory.last_move_at)


def _hold(memory: RebalanceMemory, verdict: Verdict) -> Verdict:
    """Hold with nothing worth moving: the streak ends."""
    memory.streak, memory.streak_count = None, 0
    return verdict


def _check(checks: list[tuple[bool, str]]) -> None:
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
