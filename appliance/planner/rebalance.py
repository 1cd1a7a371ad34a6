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

What the box measured counts beside what the simulator predicts (docs/autopilot.md):
- Memory: each look whose window ran wholly on the current layout (the roles unchanged
  for the window's length) and has `rules.min_requests` requests records that layout's
  (by its `shape`: which device holds which role aside)
  measured attainment and goodput, when, and the window's traffic mix (`TrafficMix`:
  rate, mean prompt and output tokens), kept `rules.remember_s`. Two mixes are similar
  when each of the three figures is within a factor `rules.similar_factor` of the other.
- A layout that measured worse on similar traffic (its attainment below this window's
  by more than `rules.attainment_noise`) is no target on a prediction alone.
- Measurements decide where the simulator cannot: every layout it simulated serves ~0
  (at most `rules.blind_fraction` of the window's requests per second), or it rates the
  current layout at over twice what the box measures. Then the layout that measured
  best on similar traffic is the target if it beat this window by the margin and the
  noise; with every layout simulated at ~0 and none such, the box stays.
- Rollback: once the layout a move led to has run a whole window of similar traffic, a
  measured attainment below the one that moved it (by more than the noise, and under
  the target) moves back at once (no cooldown, no confirming looks), once; the layout
  rolled back from is held off `rules.hold_off_s` while the traffic stays similar. A
  window heavier than the one that moved it (over `rules.judge_load_factor` x its
  prompt or answer tokens per second) judges nothing: the move stands.
- Dwell: within `rules.dwell_s` of a move, the layout it left is no target, unless the
  move back is a rollback.
- The edge of the SLO (planner/headroom.py): where the window carries its requests'
  measured latencies, a window at target holds only if the target's share of them keep
  within `rules.headroom` of each limit; one without that headroom compares layouts on
  the SLO scaled by it. Simulated requests are judged as this box serves them: the SLO
  divided by the box's slowdown over the simulator on this window's requests (unless
  that would leave no layout one move away serving anything: then the profile does not
  describe the box's speed, and its own ranking stands).
Every verdict carries its inputs (each layout's simulated goodput, this window's and the
remembered measurements, the layouts barred as targets and why) and the rule that
decided.
Pure: no torch, no asyncio.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from appliance.core.goodput import SLO, RequestResult
from appliance.planner.headroom import (
    Latency,
    Slowdown,
    calibrated,
    headroom_attainment,
    slowdown,
)
from appliance.planner.layout import layout_of_roles, roles_problem
from appliance.planner.profile import Profile
from appliance.planner.rebalance_paths import (
    Barred,
    Move,
    Path,
    Roles,
    Score,
    best_one,
    best_two,
    move_between,
    moved,
    moves_from,
    nearest,
    path_between,
)
from appliance.planner.simulator import Policy, SimRequest, simulate

__all__ = [
    "Measurement",
    "Move",
    "RebalanceMemory",
    "RebalanceRules",
    "Roles",
    "TrafficMix",
    "TrafficWindow",
    "Verdict",
    "decide",
    "measurement_of",
    "mix_of",
    "moves_from",
    "predicted_goodput",
    "shape",
]

EPSILON = 1e-9  # goodput (req/s) below which a layout counts as serving nothing
# The simulator is contradicted where the box measures less than this fraction of the
# goodput it simulates for the current layout.
CONTRADICTED = 0.5


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
    # What was measured counts beside what is simulated (module docstring).
    dwell_s: float = 90.0  # the layout a move left is no target this long (but a rollback)
    hold_off_s: float = 300.0  # a layout rolled back from is no target this long
    remember_s: float = 600.0  # a layout's measurement counts this long
    similar_factor: float = 1.5  # traffic mixes within this factor are similar
    attainment_noise: float = 0.1  # measured attainments closer than this are equal
    # A rollback judges the target only on a window whose prompt and answer tokens per
    # second are at most this x those of the window that moved it: worse service of
    # heavier traffic says nothing against a layout.
    judge_load_factor: float = 1.15
    blind_fraction: float = 0.05  # simulated goodput at most this x the rate is ~0
    # At target only with headroom: this fraction of the window's requests within this
    # fraction of each limit (planner/headroom.py); else layouts are compared on it.
    headroom: float = 0.8

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
            (self.dwell_s >= 0, f"dwell_s must be >= 0, got {self.dwell_s}"),
            (self.hold_off_s >= 0, f"hold_off_s must be >= 0, got {self.hold_off_s}"),
            (self.remember_s >= 0, f"remember_s must be >= 0, got {self.remember_s}"),
            (
                self.similar_factor >= 1,
                f"similar_factor must be >= 1, got {self.similar_factor}",
            ),
            (
                0 <= self.attainment_noise <= 1,
                f"attainment_noise must be in [0, 1], got {self.attainment_noise}",
            ),
            (
                self.judge_load_factor >= 1,
                f"judge_load_factor must be >= 1, got {self.judge_load_factor}",
            ),
            (
                0 <= self.blind_fraction <= 1,
                f"blind_fraction must be in [0, 1], got {self.blind_fraction}",
            ),
            (0 < self.headroom <= 1, f"headroom must be in (0, 1], got {self.headroom}"),
        ]
        _check(checks)


@dataclass(frozen=True)
class TrafficWindow:
    """The traffic of one look's window."""

    duration_s: float  # > 0
    requests: tuple[SimRequest, ...]  # arrivals relative to the window's start
    attainment: float | None  # measured fraction of finished requests within the SLO
    # Each request's measured latencies, in the order of `requests` (or none: a window
    # without them is judged on attainment alone, and the simulator is not calibrated).
    latencies: tuple[Latency, ...] = ()

    def __post_init__(self) -> None:
        late = [r.arrival_s for r in self.requests if r.arrival_s > self.duration_s]
        checks = [
            (
                not self.latencies or len(self.latencies) == len(self.requests),
                f"{len(self.latencies)} latencies for {len(self.requests)} requests",
            ),
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


@dataclass(frozen=True)
class TrafficMix:
    """What a window's traffic was like, to tell whether two measurements met similar
    traffic: requests per second, mean prompt tokens, mean output tokens (a running
    request's output so far)."""

    rate: float
    prompt: float
    output: float

    def similar(self, other: TrafficMix, factor: float) -> bool:
        """Each of the three figures within `factor` of the other's (1.5: 1.0 and 1.4 req/s
        are similar, 1.0 and 1.6 are not)."""
        pairs = ((self.rate, other.rate), (self.prompt, other.prompt))
        return all(_within(a, b, factor) for a, b in (*pairs, (self.output, other.output)))

    def heavier(self, other: TrafficMix, factor: float) -> bool:
        """Whether this traffic asks more than `factor` x `other`'s prompt tokens per
        second or answer tokens per second (the prefill and the decode work)."""
        prefill, decode = self.rate * self.prompt, self.rate * self.output
        return prefill > factor * other.rate * other.prompt or (
            decode > factor * other.rate * other.output
        )

    def describe(self) -> str:
        return f"{self.rate:.2f} req/s, {self.prompt:.0f}/{self.output:.0f} tokens in/out"


@dataclass(frozen=True)
class Measurement:
    """What the box measured on one window: when (the look's clock), the fraction of its
    requests within the SLO, that as goodput (req/s), and the traffic it was."""

    at: float
    attainment: float
    goodput: float
    mix: TrafficMix


@dataclass(frozen=True)
class Judgement:
    """A move (or two-move path) to be judged once its target is measured: the layout it
    left, its target, and what the layout left measured when it moved."""

    start: Roles
    target: Roles
    before: Measurement


@dataclass
class RebalanceMemory:
    """What the rebalancer remembers between looks (`decide` updates it)."""

    last_move_at: float | None = None
    streak: Move | None = None  # the move recommended in the last looks
    streak_count: int = 0  # how many looks in a row
    target: Roles | None = None  # after the first step of two: where the second leads
    # How that first step was chosen: None (simulated), "measured" or "rollback"; the
    # last two take their second step without simulating again.
    target_rule: str | None = None
    seen: Roles | None = None  # the roles at the last look, and since when
    seen_since: float = 0.0
    # By shape: the latest measurement of each layout, and the layouts held off (until
    # when, and the traffic they measured worse on).
    measured: dict[Roles, Measurement] = field(default_factory=dict)
    held_off: dict[Roles, tuple[float, TrafficMix]] = field(default_factory=dict)
    judgement: Judgement | None = None  # the last move, until its target is measured
    left: Roles | None = None  # the layout the last move (or path) left: it dwells

    def moved(self, current: Roles, path: Path, now: float, before: Measurement | None) -> None:
        """Note the first (or only) move of `path` from `current`, made at `now`: a path
        of two is remembered for its second step, its target is judged once measured
        (against `before`, when given), and the layout left dwells."""
        self.last_move_at, self.streak, self.streak_count = now, None, 0
        self.target = path.target if len(path.moves) > 1 else None
        self.target_rule = None
        self.left = current
        self.judgement = None if before is None else Judgement(current, path.target, before)

    def applied(self, verdict: Verdict, now: float) -> None:
        """An operator applied the first move of `verdict`'s path (as a move of its own)."""
        path = Path(verdict.path, verdict.recommended, verdict.predicted_recommended)
        self.moved(verdict.current, path, now, verdict.measured)


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
    # The rule that decided: few-requests, none-finished, at-target, no-better, margin,
    # cooldown, confirming, move, second-step, measured-move, measured-step,
    # measured-stay, rollback, rollback-step.
    rule: str = ""
    # Its inputs: each layout's simulated goodput on this window, this window's
    # measurement, the remembered ones on similar traffic and the layouts barred as
    # targets (these two by shape).
    simulated: Mapping[Roles, float] = field(default_factory=dict)
    measured: Measurement | None = None
    remembered: Mapping[Roles, Measurement] = field(default_factory=dict)
    barred: Mapping[Roles, str] = field(default_factory=dict)
    # The box's measured latencies over the simulator's on this window (the simulated
    # requests judged by the SLO divided by it where `calibrated`), and the fraction of the window's
    # requests within `rules.headroom` of each limit (None: not measured).
    slowdown: Slowdown = field(default_factory=Slowdown)
    calibrated: bool = False  # whether the simulated requests were judged by it
    headroom: float | None = None


def predicted_goodput(
    profile: Profile,
    roles: Sequence[str | None],
    window: TrafficWindow,
    policy: Policy,
    slo: SLO,
    device_size: int = 1,
) -> float:
    """Requests per second of the window that the roles would serve within the SLO."""
    return _goodput(simulated_results(profile, roles, window, policy, device_size), window, slo)


def simulated_results(
    profile: Profile,
    roles: Sequence[str | None],
    window: TrafficWindow,
    policy: Policy,
    device_size: int = 1,
) -> list[RequestResult]:
    """The window's requests as the roles would serve them, in the window's order."""
    return simulate(profile, layout_of_roles(roles, device_size), window.requests, policy)


def _goodput(results: Sequence[RequestResult], window: TrafficWindow, slo: SLO) -> float:
    good = sum(1 for result in results if slo.met_by(result))  # met_by needs ok
    return good / window.duration_s


def shape(roles: Sequence[str | None]) -> Roles:
    """The roles in a canonical order: layouts of one shape differ only in which device
    holds which role, and serve alike (the devices are alike), so they share what was
    measured and what is barred."""
    return tuple(sorted(roles, key=lambda role: role or ""))


def mix_of(window: TrafficWindow) -> TrafficMix:
    """The window's rate and mean prompt and output tokens."""
    count = len(window.requests)
    if not count:
        return TrafficMix(0.0, 0.0, 0.0)
    prompt = sum(r.prompt_tokens for r in window.requests) / count
    output = sum(r.output_tokens for r in window.requests) / count
    return TrafficMix(count / window.duration_s, prompt, output)


def measurement_of(window: TrafficWindow, now: float) -> Measurement | None:
    """What the box measured on the window; None when nothing finished in it."""
    if window.attainment is None or not window.requests:
        return None
    mix = mix_of(window)
    return Measurement(now, window.attainment, window.attainment * mix.rate, mix)


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
    would keep their device's worker, preferred between equally good paths. The verdict
    carries its inputs and the rule that decided.

    Where the window carries its requests' measured latencies, simulated requests are
    judged as this box serves them (the SLO divided by its slowdown over the simulator
    on this window, planner/headroom.py), and a window at target without headroom does
    not hold: its layouts are compared on the SLO scaled by `rules.headroom`."""
    current: Roles = tuple(roles)
    problem = roles_problem(current)
    if problem is not None:
        raise ValueError(f"the current roles {current} cannot serve: {problem}")
    done = {current: simulated_results(profile, current, window, policy, device_size)}
    slow = slowdown(window.latencies, done[current], rules.min_requests)
    room = headroom_attainment(window.latencies, slo, rules.headroom)
    factor = rules.headroom if _tight(window, room, rules) else 1.0
    applied = max(slow.ttft, slow.tpot) > 1.0 and _quiet(window, rules, room) is None
    if applied:  # a look that holds at once scores the current layout alone
        _simulate_neighbours(done, current, profile, window, policy, device_size)
        applied = not _blinds(window, done, calibrated(slo, slow, factor), rules)
    judged_by = calibrated(slo, slow if applied else Slowdown(), factor)
    score = _Scorer(window, profile, policy, judged_by, device_size, done)
    measured = measurement_of(window, now)
    _remember(memory, current, window, measured, rules, now)
    look = _Look(
        window, current, score(current), score, rules, memory, now, in_place, measured, room
    )
    verdict = _decide(look)
    return replace(
        verdict,
        simulated=dict(score.known),
        measured=measured,
        remembered=look.similar,
        barred={**look.worse, **look.hard},
        slowdown=slow,
        calibrated=applied,
        headroom=room,
    )


def _simulate_neighbours(
    done: dict[Roles, list[RequestResult]],
    current: Roles,
    profile: Profile,
    window: TrafficWindow,
    policy: Policy,
    size: int,
) -> None:
    """Add every layout one move from `current` to `done`, simulated (the look scores
    them anyway unless it holds at once)."""
    for move in moves_from(current):
        roles = moved(current, move)
        if roles not in done:
            done[roles] = simulated_results(profile, roles, window, policy, size)


def _blinds(
    window: TrafficWindow,
    done: dict[Roles, list[RequestResult]],
    judged_by: SLO,
    rules: RebalanceRules,
) -> bool:
    """Whether judging by `judged_by` would leave the current layout and every layout
    one move away serving ~0 (`rules.blind_fraction` of the window's rate). A slowdown
    that large says the profile does not describe this box's speed at all (another box's,
    a hand-made one): the simulator's ranking on its own terms is then all it offers, and
    the rules that weigh measurements judge the rest, as before the slowdown was
    measured."""
    rate = len(window.requests) / window.duration_s
    return all(
        _goodput(results, window, judged_by) <= rules.blind_fraction * rate
        for results in done.values()
    )


def _tight(window: TrafficWindow, room: float | None, rules: RebalanceRules) -> bool:
    """At target, but without headroom: the window's attainment meets the target while
    fewer than the target's fraction of its requests keep within `rules.headroom` of
    each limit. The box copes at the edge, where a little more traffic tips every running
    request over at once; it is not a reason to hold."""
    at_target = window.attainment is not None and window.attainment >= rules.target_attainment
    return at_target and room is not None and room < rules.target_attainment


def current_goodput(window: TrafficWindow, simulated: float) -> float:
    """The current layout's goodput on the window: the simulated one, or the measured one
    (attainment times the window's requests per second) where that is lower."""
    if window.attainment is None:
        return simulated
    return min(simulated, window.attainment * len(window.requests) / window.duration_s)


class _Scorer:
    """Predicted goodput of a set of roles on the window (judged by `slo`), each
    simulated once (`done`: layouts simulated already); `known` holds every layout
    scored so far."""

    def __init__(
        self,
        window: TrafficWindow,
        profile: Profile,
        policy: Policy,
        slo: SLO,
        size: int,
        done: Mapping[Roles, list[RequestResult]],
    ) -> None:
        self.window, self.profile, self.policy, self.slo, self.size = (
            window, profile, policy, slo, size,
        )  # fmt: skip
        self.done = dict(done)
        self.known: dict[Roles, float] = {}

    def __call__(self, roles: Roles) -> float:
        if roles not in self.known:
            results = self.done.pop(roles, None)
            if results is None:
                results = simulated_results(
                    self.profile, roles, self.window, self.policy, self.size
                )
            self.known[roles] = _goodput(results, self.window, self.slo)
        return self.known[roles]


def _remember(
    memory: RebalanceMemory,
    current: Roles,
    window: TrafficWindow,
    measured: Measurement | None,
    rules: RebalanceRules,
    now: float,
) -> None:
    """Note when the roles changed; forget old measurements and lapsed hold-offs; keep
    this window's measurement where it ran wholly on the current layout."""
    if memory.seen != current:
        memory.seen, memory.seen_since = current, now
    memory.measured = {
        roles: m for roles, m in memory.measured.items() if now - m.at <= rules.remember_s
    }
    memory.held_off = {roles: h for roles, h in memory.held_off.items() if h[0] > now}
    settled = now - memory.seen_since >= window.duration_s
    if measured is not None and settled and len(window.requests) >= rules.min_requests:
        memory.measured[shape(current)] = measured


@dataclass
class _Look:
    """One look's inputs, and what follows from them: the remembered measurements on
    similar traffic and the layouts barred as targets."""

    window: TrafficWindow
    current: Roles
    simulated: float  # the current layout's simulated goodput
    score: _Scorer
    rules: RebalanceRules
    memory: RebalanceMemory
    now: float
    in_place: frozenset[Move]
    measured: Measurement | None  # this window's
    headroom: float | None  # the fraction of its requests within rules.headroom of the SLO
    similar: dict[Roles, Measurement] = field(init=False)
    worse: dict[Roles, str] = field(init=False)  # measured worse: no target on a prediction
    hard: dict[Roles, str] = field(init=False)  # held off, dwelling: no target but a rollback

    def __post_init__(self) -> None:
        rules, memory, now, measured = self.rules, self.memory, self.now, self.measured
        self.similar = {}
        if measured is not None:
            self.similar = {
                roles: m
                for roles, m in memory.measured.items()
                if m.mix.similar(measured.mix, rules.similar_factor)
            }
        self.worse = {
            roles: (
                f"measured {m.attainment:.2f} < {measured.attainment:.2f} on similar "
                f"traffic {now - m.at:.0f} s ago"
            )
            for roles, m in self.similar.items()
            if measured is not None
            and roles != shape(self.current)
            and m.attainment < measured.attainment - rules.attainment_noise
        }
        self.hard = {
            roles: f"held off after a rollback: {until - now:.0f} s left"
            for roles, (until, mix) in memory.held_off.items()
            if measured is None or mix.similar(measured.mix, rules.similar_factor)
        }
        last, left = memory.last_move_at, memory.left
        if last is not None and left is not None and now - last < rules.dwell_s:
            self.hard.setdefault(
                shape(left),
                f"dwell: left {now - last:.0f} s ago, {rules.dwell_s - now + last:.0f} s to go",
            )

    @property
    def here(self) -> float:
        return current_goodput(self.window, self.simulated)

    def barred(self, roles: Roles) -> bool:
        """Whether `roles` may not be a target on a prediction."""
        key = shape(roles)
        return key in self.worse or key in self.hard


def _decide(look: _Look) -> Verdict:
    memory = look.memory
    target, memory.target = memory.target, None
    rule, memory.target_rule = memory.target_rule, None
    if target is not None:
        step = _second_step(look, target) if rule is None else _forced_step(look, target, rule)
        if step is not None:
            return step
    rollback = _judge(look)
    if rollback is not None:
        return rollback
    return _fresh(look)


def _second_step(look: _Look, target: Roles) -> Verdict | None:
    """The second step to `target`, made now (no cooldown, no confirming looks, nor the
    attainment target) when the window has enough requests, the target is one move away,
    is at least as good as the best layout one move away, is simulated to beat the
    current layout's simulated goodput, and beats its `current_goodput` by the margin
    (the first step's rules); None otherwise (decide afresh)."""
    current, memory, rules = look.current, look.memory, look.rules
    step = move_between(current, target)
    if step is None or len(look.window.requests) < rules.min_requests:
        return None
    here = look.here
    best, goal = best_one(current, look.score, look.simulated), look.score(target)
    if best is None or goal < best.goodput or _worth(here, goal, rules) is not None:
        return None
    memory.last_move_at, memory.streak, memory.streak_count = look.now, None, 0
    device, to = step
    reason = (
        f"second step: move device {device} from {current[device]} to {to}: predicted "
        f"{here:.2f} -> {goal:.2f} req/s within the SLO"
    )
    return Verdict(current, target, step, here, goal, reason, path=(step,), rule="second-step")


def _forced_step(look: _Look, target: Roles, rule: str) -> Verdict | None:
    """The second step of a path chosen on measurements ("measured") or of a rollback,
    made now if the target is one move away (nothing simulated: the middle layout is
    no fair measure)."""
    current, memory = look.current, look.memory
    step = move_between(current, target)
    if step is None:
        return None
    memory.last_move_at, memory.streak, memory.streak_count = look.now, None, 0
    device, to = step
    then = memory.measured.get(shape(target))
    goal = then.goodput if then is not None else look.score(target)
    here = look.measured.goodput if look.measured is not None else look.here
    reason = f"{rule} second step: move device {device} from {current[device]} to {to}"
    return Verdict(current, target, step, here, goal, reason, path=(step,), rule=f"{rule}-step")


def _judge(look: _Look) -> Verdict | None:
    """Roll the last move back (once) when its target, measured on a whole window of
    traffic similar to the one that moved it, met the SLO for fewer requests (by more
    than the noise, and under the target): the first step back now, the layout held
    off. None otherwise; the move is judged once."""
    memory, rules, current, measured = look.memory, look.rules, look.current, look.measured
    judgement = memory.judgement
    if judgement is None:
        return None
    if current != judgement.target:
        memory.judgement = None  # the path was left, or another move came between
        return None
    settled = look.now - memory.seen_since >= look.window.duration_s
    if measured is None or not settled or len(look.window.requests) < rules.min_requests:
        return None  # not measured yet
    memory.judgement = None
    before = judgement.before
    if measured.mix.heavier(before.mix, rules.judge_load_factor):
        # Traffic grew since the move: the backlog and the load are the traffic's, not
        # the layout's (found on a seeded mix, issue 35: a right move to colocated x2
        # rolled back on a window with a third more requests than the one that moved it).
        return None
    if (
        measured.attainment >= rules.target_attainment
        or not before.mix.similar(measured.mix, rules.similar_factor)
        or measured.attainment >= before.attainment - rules.attainment_noise
    ):
        return None
    path = path_between(current, judgement.start, look.in_place)
    if path is None:
        return None
    memory.held_off[shape(current)] = (look.now + rules.hold_off_s, measured.mix)
    memory.moved(current, path, look.now, None)
    memory.target_rule = "rollback" if len(path.moves) > 1 else None
    look.hard[shape(current)] = f"held off after a rollback: {rules.hold_off_s:.0f} s left"
    reason = (
        f"rollback: {_name(current)} measured {measured.attainment:.2f} of requests within "
        f"the SLO on similar traffic, {_name(judgement.start)} {before.attainment:.2f} "
        f"before the move: {_steps(current, path.moves)}; {_name(current)} held off "
        f"{rules.hold_off_s:.0f} s"
    )
    return Verdict(
        current,
        judgement.start,
        path.moves[0],
        measured.goodput,
        before.goodput,
        reason,
        path=path.moves,
        rule="rollback",
    )


def _fresh(look: _Look) -> Verdict:
    """Hold, or make the first (or only) move of the best path worth it, per the rules:
    measurements first where the simulator cannot tell (`_by_measurement`); else the
    path (to a layout not barred) must beat the current layout's simulated goodput, and
    its gain is judged against `current_goodput`."""
    current, memory, rules, simulated = look.current, look.memory, look.rules, look.simulated
    here = look.here
    held = _quiet(look.window, rules, look.headroom)
    if held is not None:
        why, rule = held
        return _hold(memory, Verdict(current, current, None, here, here, why, rule=rule))
    best = _best_path(current, simulated, look.score, rules, look.in_place, look.barred)
    by_measurement = _by_measurement(look)
    if by_measurement is not None:
        return by_measurement
    if best is None:
        nothing = (
            f"no move is simulated to beat {simulated:.2f} req/s{_tight_note(look)}"
            f"{_barred_note(look)}"
        )
        return _hold(memory, Verdict(current, current, None, here, here, nothing, rule="no-better"))
    proposal = _proposal(current, here, best)
    worth = _worth(here, best.goodput, rules)
    if worth is not None:
        reason = worth + _tight_note(look) + _barred_note(look)
        return _hold(memory, replace(proposal, reason=reason, rule="margin"))
    verdict = _confirm(look, proposal, best, _move_reason(proposal, best), "move")
    note = _tight_note(look)  # why a window at target may move (or confirm, or cool down)
    return replace(verdict, reason=verdict.reason + note) if note else verdict


def _by_measurement(look: _Look) -> Verdict | None:
    """Where the simulator cannot tell (every layout it simulated at ~0, or the current
    one simulated at over twice what the box measures), the layout that measured best on
    similar traffic (not held off nor dwelling, at most two moves away) is the target if
    it beat this window's attainment by the margin and the noise; with every layout at
    ~0 and none such, the box stays. None: the simulator decides."""
    measured, rules, current = look.measured, look.rules, look.current
    if measured is None:
        return None
    best_simulated = max(look.score.known.values())
    blind = best_simulated <= rules.blind_fraction * measured.mix.rate
    if not blind and measured.goodput >= CONTRADICTED * look.simulated:
        return None
    if blind:
        why = f"every layout simulated at ~0 (at most {best_simulated:.2f} req/s)"
    else:
        why = f"simulated {look.simulated:.2f} req/s here, measured {measured.goodput:.2f}"
    best: tuple[Measurement, Path] | None = None
    two = len(current) <= rules.two_move_max_devices
    for key, then in look.similar.items():
        if key == shape(current) or key in look.hard:
            continue
        path = nearest(current, _of_shape(key), look.in_place, two)
        if path is None:
            continue
        gain = then.attainment - measured.attainment
        if gain <= rules.attainment_noise or gain <= rules.margin * measured.attainment:
            continue
        if best is None or then.attainment > best[0].attainment:
            best = then, path
    if best is None:
        if not blind:
            return None
        reason = (
            f"measured-stay: {why}: measurements decide, and no layout measured better on "
            f"similar traffic than this one's {measured.attainment:.2f}{_barred_note(look)}"
        )
        stay = Verdict(
            current, current, None, measured.goodput, measured.goodput, reason, rule="measured-stay"
        )
        return _hold(look.memory, stay)
    then, path = best
    proposal = Verdict(
        current, path.target, None, measured.goodput, then.goodput, "", path=path.moves
    )
    reason = (
        f"measured move: {_steps(current, path.moves)}: on similar traffic "
        f"{_name(path.target)} measured {then.attainment:.2f} of requests within the SLO "
        f"{look.now - then.at:.0f} s ago, this layout {measured.attainment:.2f} now; {why}"
    )
    return _confirm(look, proposal, path, reason, "measured-move")


def _best_path(
    current: Roles,
    here: float,
    score: Score,
    rules: RebalanceRules,
    in_place: frozenset[Move],
    barred: Barred,
) -> Path | None:
    """The best layout one move away; when it does not clear the margin (on a box of at
    most `rules.two_move_max_devices` devices), the best two moves away if better still.
    Never a layout in `barred`. None when nothing beats the current roles."""
    one = best_one(current, score, here, in_place, barred)
    if one is not None and _worth(here, one.goodput, rules) is None:
        return one
    if len(current) > rules.two_move_max_devices:
        return one
    return best_two(current, score, one.goodput if one else here, in_place, barred) or one


def _proposal(current: Roles, here: float, best: Path) -> Verdict:
    """A verdict that holds, recommending `best`'s target (reason to be filled in)."""
    return Verdict(
        current, best.target, None, here, best.goodput, "", path=best.moves, predicted_via=best.via
    )


def _quiet(
    window: TrafficWindow, rules: RebalanceRules, headroom: float | None
) -> tuple[str, str] | None:
    """Why the window gives no cause to move, before any prediction, and the rule. At
    target holds only with headroom (`_tight`): `headroom` is the fraction of the
    window's requests within `rules.headroom` of each limit (None: not measured)."""
    count = len(window.requests)
    if count < rules.min_requests:
        return f"{count} requests in the window < {rules.min_requests}", "few-requests"
    if window.attainment is None:
        return "no request finished in the window", "none-finished"
    if window.attainment >= rules.target_attainment and not _tight(window, headroom, rules):
        reason = f"attainment {window.attainment:.2f} >= target {rules.target_attainment:.2f}"
        if headroom is not None:
            reason += f", {headroom:.2f} within {rules.headroom:.0%} of the SLO"
        return reason, "at-target"
    return None


def _worth(here: float, there: float, rules: RebalanceRules) -> str | None:
    """Why a predicted gain is not worth a move (None: it is)."""
    gain = (there - here) / max(here, EPSILON)
    if there > here and gain > rules.margin:
        return None
    return f"gain {gain:.0%} < margin {rules.margin:.0%}"


def _confirm(look: _Look, proposal: Verdict, best: Path, moving: str, rule: str) -> Verdict:
    """A path worth taking: its first move made now (reason `moving`) unless cooldown or
    too short a streak (of the same first move) holds it; a two-move path's target is
    remembered, and the move is judged once its target is measured."""
    memory, rules, now = look.memory, look.rules, look.now
    move = best.moves[0]
    if memory.streak == move:
        memory.streak_count += 1
    else:
        memory.streak, memory.streak_count = move, 1
    wait = _cooldown_left(memory, rules, now)
    if wait > 0:
        return replace(proposal, reason=f"cooldown: {wait:.0f} s left", rule="cooldown")
    if memory.streak_count < rules.confirm_windows:
        count = f"{memory.streak_count} of {rules.confirm_windows}"
        steps = ", then ".join(f"device {device} to {to}" for device, to in best.moves)
        reason = f"{count} looks recommend moving {steps}"
        return replace(proposal, reason=reason, rule="confirming")
    memory.moved(look.current, best, now, look.measured)
    if rule == "measured-move" and memory.target is not None:
        memory.target_rule = "measured"
    return replace(proposal, move=move, reason=moving, rule=rule)


def _move_reason(proposal: Verdict, best: Path) -> str:
    """'move device 1 from colocated to decode, then device 0 from colocated to prefill:
    predicted 0.85 -> 1.70 req/s within the SLO (via 0.10)'."""
    via = f" (via {best.via:.2f})" if best.via is not None else ""
    before, after = proposal.predicted_current, proposal.predicted_recommended
    return (
        f"{_steps(proposal.current, best.moves)}: predicted {before:.2f} -> {after:.2f} req/s "
        f"within the SLO{via}"
    )


def _steps(current: Roles, moves: tuple[Move, ...]) -> str:
    """'move device 1 from colocated to decode, then device 0 from colocated to prefill'."""
    roles, steps = list(current), []
    for device, to in moves:
        steps.append(f"device {device} from {roles[device]} to {to}")
        roles[device] = to
    return f"move {', then '.join(steps)}"


def _tight_note(look: _Look) -> str:
    """'; at target without headroom: 0.62 of requests within 80% of the SLO, layouts
    compared on it' when the look compared layouts on the scaled SLO; '' otherwise."""
    window, rules = look.window, look.rules
    if look.headroom is None or not _tight(window, look.headroom, rules):
        return ""
    return (
        f"; at target without headroom: {look.headroom:.2f} of requests within "
        f"{rules.headroom:.0%} of the SLO, layouts compared on it"
    )


def _barred_note(look: _Look) -> str:
    """'; not a target: 1P+1D (measured 0.10 < 0.60 on similar traffic 40 s ago)' for
    the barred layouts this look simulated; '' when none."""
    barred = {**look.worse, **look.hard}
    scored = {shape(roles) for roles in look.score.known} - {shape(look.current)}
    notes = [f"{_name(key)} ({why})" for key, why in barred.items() if key in scored]
    return f"; not a target: {'; '.join(notes)}" if notes else ""


def _of_shape(key: Roles) -> Barred:
    """Whether a set of roles has the shape `key`."""
    return lambda roles: shape(roles) == key


def _name(roles: Roles) -> str:
    """A layout as tables name it ('colocated x2', '1P+1D')."""
    try:
        return layout_of_roles(roles).label
    except ValueError:
        return ",".join(role or "-" for role in roles)


def _within(a: float, b: float, factor: float) -> bool:
    low, high = sorted((a, b))
    return high <= factor * low + EPSILON


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
